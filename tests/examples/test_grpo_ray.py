"""``hybridmem demo --launcher ray``, each run as its own process and checked by its exit status: a Ray
driver over one worker actor per rank (trainer rank, engine, reference and reward model co-resident in the
actor) learns with the reward of every iteration equal to the spawned demo's, on one raylet and on two
raylets of this machine (Ray's test cluster, standing in for two nodes), with a reward model as with the
rule; the reference and the reward model hold no device bytes outside their own tasks; every trainer and
engine runs under it (vLLM in the actor's process, and vLLM's engine core in a process of its own), one actor
alone too (the GPU suite's Ray run: one actor holding the GPU's bundle)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hybridmem.examples import grpo
from tests._full import full_only

pytest.importorskip("ray")

pytestmark = pytest.mark.slow

ITERS = "10"
TRAINING_OWNERS = ("train param", "train grad", "optimizer")


def _ray_demo(out, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in grpo.TORCHRUN_VARS and k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, "-m", "hybridmem", "demo", "--launcher", "ray", "--out", str(out),
                           *args], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((out / "grpo.json").read_text())


def _spawned(tmp_path_factory, *args: str) -> dict:
    out = tmp_path_factory.mktemp("spawned")
    grpo.main(["--iters", ITERS, "--out", str(out), *args])
    return json.loads((out / "grpo.json").read_text())


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> dict:
    """The default layout: training TP2 (one data-parallel rank), two inference replicas."""
    return _spawned(tmp_path_factory)


@pytest.fixture(scope="module")
def spawned_dp(tmp_path_factory) -> dict:
    """Training TP1: two data-parallel ranks, so the driver's dispatch of each rank's share counts."""
    return _spawned(tmp_path_factory, "--train-tp", "1")


def _rewards(summary: dict) -> list[float]:
    return [r["reward"] for r in summary["iterations"]]


def _assert_co_residents_only_in_their_tasks(summary: dict, names: tuple[str, ...]) -> None:
    phases = {phase for _, phase, _ in summary["memory_samples"]}
    assert {"train", "infer", *names} <= phases, phases
    for _, phase, owners in summary["memory_samples"]:
        for name in names:
            assert (owners[name] > 0) == (phase == name), (phase, owners)
        if phase == "infer":
            assert all(owners[o] == 0 for o in TRAINING_OWNERS) and owners["kv cache"] > 0, owners
        if phase in ("train", *names):
            assert owners["train param"] > 0 and owners["engine weights"] == owners["kv cache"] == 0, (
                phase, owners)


def test_the_ray_demo_learns_as_the_spawned_demo_does(tmp_path, spawned):
    summary = _ray_demo(tmp_path, "--iters", ITERS)
    assert _rewards(summary) == _rewards(spawned)
    assert summary["last5_reward"] > summary["first5_reward"] and summary["max_logprob_gap"] < 1e-4
    assert len({w["pid"] for w in summary["workers"]}) == 2
    _assert_co_residents_only_in_their_tasks(summary, ("reference",))


def test_two_raylets_with_a_reward_model_learn_as_the_spawned_demo_does(tmp_path, spawned_dp):
    """The reward model scores as the task's rule does (see hybridmem/examples/grpo/reward.py), so the run
    scored by the model on two raylets gives the spawned rule run's rewards; data parallel over the two."""
    summary = _ray_demo(tmp_path, "--iters", ITERS, "--ray-nodes", "2", "--reward", "model",
                        "--train-tp", "1")
    assert len({w["node_id"] for w in summary["workers"]}) == 2, summary["workers"]  # a raylet each
    assert _rewards(summary) == _rewards(spawned_dp) and summary["last5_reward"] > summary["first5_reward"]
    _assert_co_residents_only_in_their_tasks(summary, ("reference", "reward"))


def test_the_spawned_demo_with_a_reward_model_learns_as_with_the_rule(tmp_path, spawned):
    grpo.main(["--iters", ITERS, "--reward", "model", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "grpo.json").read_text())
    assert _rewards(summary) == _rewards(spawned)
    for _, phase, owners in summary["memory_samples"]:
        assert (owners["reward"] > 0) == (phase == "reward"), (phase, owners)


@pytest.mark.parametrize("demo", [
    ["--trainer", "megatron", "--engine", "vllm", "--world-size", "1", "--train-tp", "1"],
    # Two actors resharding into the engine's layout run in the learning tests above, and FSDP2 in
    # tests/examples/test_grpo_demo.py and test_grpo_torchrun.py.
    pytest.param(["--trainer", "fsdp", "--infer-tp", "2"],
                 marks=full_only("two actors run in the tests above")),
    # vLLM's engine core in a process of its own per actor: a minute and a half on a 2-core machine.
    pytest.param(["--engine", "vllm-server"], marks=full_only("vLLM runs in the actor's process in CI")),
], ids=["megatron-vllm-one-actor", "fsdp", "vllm-server"])
def test_every_trainer_and_engine_runs_on_ray(tmp_path, demo):
    if "megatron" in demo:
        pytest.importorskip("megatron.core")
    if "vllm" in demo:
        pytest.importorskip("vllm")
    summary = _ray_demo(tmp_path, "--iters", "2", *demo)
    assert len(summary["iterations"]) == 2 and summary["max_logprob_gap"] < 1e-4


@pytest.mark.parametrize("args,named", [
    (["--launcher", "ray", "--ray-nodes", "0"], "--ray-nodes 0"),
    (["--launcher", "ray", "--ray-nodes", "3"], "--ray-nodes 3"),  # more raylets than the 2 workers
    (["--ray-nodes", "2"], "--launcher spawn"),
    (["--launcher", "ray", "--ray-nodes", "2", "--ray-address", "auto"], "--ray-address"),
])
def test_bad_ray_arguments_are_refused_in_one_line(tmp_path, capsys, args, named):
    with pytest.raises(SystemExit) as info:
        grpo.main([*args, "--out", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1, err
