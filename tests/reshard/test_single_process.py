"""Single-process paths on every device (CPU always, CUDA when present): run_plan, ReshardSync, verify."""

from __future__ import annotations

import pytest
import torch

from hybridmem.config import ParallelLayout
from hybridmem.errors import WeightSyncError
from hybridmem.reshard import ModelSpec, build_plan, megatron_layout, shard, vllm_layout
from hybridmem.reshard.checksum import verify_offline
from hybridmem.reshard.execute import run_plan
from hybridmem.reshard.sync import ReshardSync
from tests.reshard._tasks import LoadOnlyEngine, ParamEngine
from tests.reshard.reference import random_full, vllm_shard

SPEC = ModelSpec(family="qwen3", hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 intermediate_size=32, num_hidden_layers=2, vocab_size=77, qk_norm=True)


def _full(device, dtype=torch.bfloat16):
    return {k: v.to(device) for k, v in random_full(SPEC, dtype=dtype).items()}


def test_run_plan_world1_writes_in_place(device):
    full = _full(device)
    src = megatron_layout(SPEC, ParallelLayout(), 1)
    dst = vllm_layout(SPEC, ParallelLayout(), 1)
    plan = build_plan(src, dst, itemsize=2)
    target = {n: torch.full(t.shape, 7.0, dtype=torch.bfloat16, device=device) for n, t in dst.tensors(0).items()}
    out, stats = run_plan(plan, rank=0, src=shard(full, src, 0), dst=target)
    ref = vllm_shard({k: v.cpu() for k, v in full.items()}, SPEC, tp=1, pp=1, ep=1, world=1, rank=0)
    for name, t in ref.items():
        assert out[name] is target[name]
        assert torch.equal(out[name].cpu(), t), name  # padding rows (77 -> 128) were zeroed
    assert stats.received_nbytes == stats.min_received_nbytes == 0
    assert stats.num_tensors == len(ref)


@pytest.mark.parametrize("in_place", [True, False])
def test_reshard_sync_single_process(device, in_place):
    full = _full(device)
    train = shard(full, megatron_layout(SPEC, ParallelLayout(), 1), 0)
    dst = vllm_layout(SPEC, ParallelLayout(), 1)
    if in_place:
        engine = ParamEngine({n: torch.zeros(t.shape, dtype=torch.bfloat16, device=device) for n, t in dst.tensors(0).items()})
    else:
        engine = LoadOnlyEngine()
    sync = ReshardSync(SPEC, ParallelLayout(), ParallelLayout(), None, lambda: train, engine, verify=True)
    stats = sync.sync()
    got = engine.tensors if in_place else engine.loaded
    ref = shard(full, dst, 0) if in_place else full
    assert set(got) == set(ref) and all(torch.equal(got[n], t) for n, t in ref.items())
    assert stats.num_tensors == len(ref) and stats.received_nbytes == 0


def test_verify_offline_names_the_bad_slice():
    full = random_full(SPEC)
    src = megatron_layout(SPEC, ParallelLayout(tp=2), 2)
    dst = vllm_layout(SPEC, ParallelLayout(tp=1), 2)
    plan = build_plan(src, dst, itemsize=4)
    train = [shard(full, src, r) for r in range(2)]
    out = [shard(full, dst, r) for r in range(2)]
    assert verify_offline(plan, train, out) == len(plan.local[0]) + len(plan.local[1]) + sum(map(len, plan.buckets))
    # Swap two columns of one row-parallel weight: the plain sum is unchanged, the weighted one is not.
    w = out[1]["model.layers.1.self_attn.o_proj.weight"]
    w[:, [0, 1]] = w[:, [1, 0]]
    with pytest.raises(WeightSyncError, match=r"model.layers.1.self_attn.o_proj.weight slice .* written on rank 1"):
        verify_offline(plan, train, out)
