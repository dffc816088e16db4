"""The GRPO demo end to end (2 gloo processes, CPU): it learns, the engine's log-probs equal the actor's
(the resharded weights are the trained ones), and each phase holds only its own state on the device."""

from __future__ import annotations

import json

import pytest

from hybridmem.examples import grpo

TRAINING_OWNERS = ("train param", "train grad", "optimizer")
ENGINE_OWNERS = ("engine weights", "kv cache")


def _run(tmp_path, *args: str) -> dict:
    grpo.main(["--out", str(tmp_path), *args])
    return json.loads((tmp_path / "grpo.json").read_text())


def _assert_phases_apart(summary: dict) -> None:
    for _, phase, owners in summary["memory_samples"]:
        if phase == "infer":
            assert all(owners[o] == 0 for o in TRAINING_OWNERS), owners
            assert owners["engine weights"] > 0 and owners["kv cache"] > 0, owners
            assert owners["reference"] == 0, owners
        elif phase == "train":
            assert all(owners[o] == 0 for o in (*ENGINE_OWNERS, "reference")), owners
            assert owners["train param"] > 0, owners
        elif phase == "reference":
            assert owners["reference"] > 0 and owners["train param"] == 0, owners


@pytest.mark.slow
def test_demo_learns_and_keeps_phases_apart(tmp_path):
    summary = _run(tmp_path, "--iters", "14")  # main() itself exits non-zero if the reward did not rise
    assert summary["last5_reward"] > summary["first5_reward"] + 0.05, summary["last5_reward"]
    assert summary["max_logprob_gap"] < 1e-4
    assert (tmp_path / "reward.png").stat().st_size > 0 and (tmp_path / "memory.png").stat().st_size > 0
    _assert_phases_apart(summary)
    moved = [row["moved_nbytes"] for row in summary["iterations"]]
    assert moved[1:] == [moved[1]] * (len(moved) - 1), "bytes moved per iteration should be constant"


@pytest.mark.slow
@pytest.mark.parametrize("train_tp,infer_tp", [(1, 2), (2, 2)])
def test_demo_other_layouts_sync_exact_weights(tmp_path, train_tp, infer_tp):
    summary = _run(tmp_path, "--iters", "2", "--train-tp", str(train_tp), "--infer-tp", str(infer_tp))
    assert summary["max_logprob_gap"] < 1e-4


@pytest.mark.slow
def test_demo_megatron_trainer(tmp_path):
    """megatron-core's GPTModel (DDP, its Adam) as the actor: the engine's log-probs equal Megatron's
    vocab-parallel ones, Megatron's buffers and workspaces leave the device in INFER."""
    pytest.importorskip("megatron.core")
    summary = _run(tmp_path, "--iters", "3", "--trainer", "megatron")
    assert summary["max_logprob_gap"] < 1e-4
    _assert_phases_apart(summary)
    infer = [owners for _, phase, owners in summary["memory_samples"] if phase == "infer"]
    assert infer and all(o["megatron workspaces"] == 0 for o in infer), infer
    rows = summary["iterations"]
    assert all(r["moved_nbytes"] > 0 for r in rows) and rows[-1]["reward"] >= 0


@pytest.mark.slow
def test_demo_fsdp_trainer(tmp_path):
    """A transformers Qwen2 with FSDP2 fully_shard as the actor, resharded into the TP2 engine: the engine's
    log-probs equal the actor's, and FSDP2's shards and buffers leave the device in INFER."""
    summary = _run(tmp_path, "--iters", "3", "--trainer", "fsdp", "--infer-tp", "2")
    assert summary["max_logprob_gap"] < 1e-4
    _assert_phases_apart(summary)
    infer = [owners for _, phase, owners in summary["memory_samples"] if phase == "infer"]
    assert infer and all(o["fsdp unsharded"] == 0 for o in infer), infer


def test_demo_rejects_layout_that_does_not_fit(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        grpo.main(["--out", str(tmp_path), "--train-tp", "3"])
    assert info.value.code == 2
    assert "--train-tp 3 is not allowed with --world-size 2" in capsys.readouterr().err
    assert not list(tmp_path.iterdir()), "nothing runs before the arguments are checked"


@pytest.mark.slow
def test_demo_with_real_vllm_megatron_tp2(tmp_path):
    """``--engine vllm``: vLLM's CPU build at TP2 (external_launcher) in the two Megatron TP2 training
    processes; vLLM's log-probs of the sampled tokens equal Megatron's on the resharded weights."""
    pytest.importorskip("vllm")
    pytest.importorskip("megatron.core")
    summary = _run(tmp_path, "--iters", "3", "--engine", "vllm", "--trainer", "megatron", "--infer-tp", "2")
    assert summary["max_logprob_gap"] < 1e-4
    assert len(summary["iterations"]) == 3
