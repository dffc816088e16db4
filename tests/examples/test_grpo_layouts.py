"""The demo's TP sizes: the README's two-node command passes the demo's checks as printed, and a TP the
4-head default policy cannot split runs on a policy widened for it (hybridmem.examples.grpo.widen_for_tp).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from hybridmem.examples import grpo
from hybridmem.examples.grpo.loop import DemoConfig

ROOT = Path(__file__).resolve().parents[2]


def readme_torchrun_command() -> tuple[argparse.Namespace, list[str]]:
    """torchrun's options and the demo's arguments of the README's multi-node command, as printed."""
    text = (ROOT / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", text, re.DOTALL) if "--nnodes" in b]
    words = shlex.split(block.replace("\\\n", " "), comments=True)
    start = words.index("torchrun")
    split = words.index("-m", start)
    launcher = argparse.ArgumentParser()
    for flag in ("--nnodes", "--node-rank", "--nproc-per-node"):
        launcher.add_argument(flag, type=int)
    for flag in ("--master-addr", "--master-port"):
        launcher.add_argument(flag)
    torchrun = launcher.parse_args(words[start + 1:split])
    assert words[split + 1:split + 3] == ["hybridmem", "demo"], words
    return torchrun, words[split + 3:]


def test_readme_two_node_command_passes_the_demos_checks_as_printed(monkeypatch):
    torchrun, demo_args = readme_torchrun_command()
    world = torchrun.nnodes * torchrun.nproc_per_node
    # What torchrun sets in the first process of node 0, on a node with one GPU per process.
    env = {"RANK": str(torchrun.node_rank * torchrun.nproc_per_node), "LOCAL_RANK": "0",
           "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(torchrun.nproc_per_node),
           "MASTER_ADDR": torchrun.master_addr, "MASTER_PORT": torchrun.master_port}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: torchrun.nproc_per_node)
    parser = grpo._parser()
    args = parser.parse_args(demo_args)
    grpo.check_args(args, parser)  # exits with status 2 and one line on a mistake
    assert args.world_size == world == 16
    model = grpo.demo_policy(args)
    train_tp, infer_tp = args.train_tp, args.infer_tp
    assert (train_tp, infer_tp) == (8, 4), demo_args
    # Megatron-style training TP: every rank holds whole attention and KV heads and an equal MLP slice;
    # vLLM-style inference TP: whole attention heads, KV heads split or replicated.
    assert model.num_attention_heads % train_tp == 0 and model.num_key_value_heads % train_tp == 0
    assert model.intermediate_size % train_tp == 0 and model.intermediate_size % infer_tp == 0
    assert model.num_attention_heads % infer_tp == 0 and model.num_key_value_heads % infer_tp == 0
    assert model.hidden_size == model.num_attention_heads * model.head_dim


def test_default_layouts_keep_the_four_head_policy():
    base = DemoConfig().model
    for train_tp, infer_tp in ((2, 1), (1, 2), (2, 2), (1, 1), (2, 4)):
        assert grpo.widen_for_tp(base, train_tp, infer_tp) is base, (train_tp, infer_tp)


@pytest.mark.parametrize("train_tp,infer_tp,factor", [(4, 2, 2), (8, 4, 4), (3, 2, 3)])
def test_a_tp_the_default_policy_cannot_split_widens_it_by_the_least_factor(train_tp, infer_tp, factor):
    base = DemoConfig().model
    wide = grpo.widen_for_tp(base, train_tp, infer_tp)
    assert (wide.num_attention_heads, wide.num_key_value_heads, wide.hidden_size, wide.intermediate_size) == (
        factor * base.num_attention_heads, factor * base.num_key_value_heads, factor * base.hidden_size,
        factor * base.intermediate_size)
    assert (wide.head_dim, wide.num_hidden_layers, wide.vocab_size) == (base.head_dim, base.num_hidden_layers,
                                                                       base.vocab_size)


def test_megatron_tp_that_does_not_divide_the_vocabulary_is_refused_in_one_line(tmp_path, capsys):
    pytest.importorskip("megatron.core")
    with pytest.raises(SystemExit) as info:
        grpo.main(["--out", str(tmp_path), "--world-size", "3", "--train-tp", "3", "--trainer", "megatron"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and (
        "--train-tp 3 is not allowed with --world-size 3: expected one of [1]" in err[0]), err
    assert "vocabulary of 16" in err[0]


@pytest.mark.slow
def test_train_tp_four_runs_on_the_widened_policy_and_syncs_exact_weights(tmp_path):
    # Refused before the policy followed the TP (2 KV heads do not split over 4 training ranks).
    grpo.main(["--out", str(tmp_path), "--world-size", "4", "--train-tp", "4", "--infer-tp", "2",
               "--iters", "2"])
    summary = json.loads((tmp_path / "grpo.json").read_text())
    assert len(summary["iterations"]) == 2 and summary["max_logprob_gap"] < 1e-4
