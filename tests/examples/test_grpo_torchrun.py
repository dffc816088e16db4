"""The GRPO demo started by torchrun instead of spawning its own processes (see [Note: demo under torchrun]
in :mod:`hybridmem.examples.grpo`).

Two torchrun "nodes" on this machine (``--nnodes 2 --node-rank 0|1``, one process each, rendezvous on
127.0.0.1) train the same policy as ``hybridmem demo`` spawning two processes: the reward of every
iteration is the same, and it learns. Each trainer and engine the demo offers also runs under one
torchrun node of two processes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from hybridmem.examples import grpo

pytestmark = pytest.mark.slow

ITERS = "10"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*launcher: str, demo: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "hybridmem", "demo", *demo]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in grpo.TORCHRUN_VARS}


def test_two_torchrun_nodes_learn_as_the_spawned_demo_does(tmp_path):
    port = str(_free_port())
    nodes = []
    for node in (0, 1):
        out = tmp_path / f"node{node}"
        cmd = _torchrun("--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1", "--master-addr",
                        "127.0.0.1", "--master-port", port, demo=["--iters", ITERS, "--out", str(out)])
        nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=_env()))
    logs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert not (tmp_path / "node1" / "grpo.json").exists()  # the summary is rank 0's
    torchrun = json.loads((tmp_path / "node0" / "grpo.json").read_text())
    grpo.main(["--iters", ITERS, "--out", str(tmp_path / "spawned")])
    spawned = json.loads((tmp_path / "spawned" / "grpo.json").read_text())
    assert [r["reward"] for r in torchrun["iterations"]] == [r["reward"] for r in spawned["iterations"]]
    assert torchrun["last5_reward"] > torchrun["first5_reward"], torchrun
    assert torchrun["max_logprob_gap"] < 1e-4


@pytest.mark.parametrize("demo", [["--trainer", "megatron"], ["--trainer", "fsdp", "--infer-tp", "2"],
                                  ["--engine", "vllm"]], ids=["megatron", "fsdp", "vllm"])
def test_every_trainer_and_engine_runs_under_torchrun(tmp_path, demo):
    if demo[0] == "--trainer" and demo[1] == "megatron":
        pytest.importorskip("megatron.core")
    if demo[0] == "--engine":
        pytest.importorskip("vllm")
    cmd = _torchrun("--standalone", "--nproc-per-node", "2",
                    demo=["--iters", "2", "--out", str(tmp_path), *demo])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((tmp_path / "grpo.json").read_text())
    assert len(summary["iterations"]) == 2 and summary["max_logprob_gap"] < 1e-4


def test_a_world_size_other_than_torchruns_is_refused(monkeypatch, tmp_path):
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as info:
        grpo.main(["--world-size", "4", "--out", str(tmp_path)])
    assert info.value.code == 2
