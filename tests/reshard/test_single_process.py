"""Single-process paths on every device (CPU always, CUDA when present): run_plan, ReshardSync, verify."""

from __future__ import annotations

import pytest
import torch

from hybridmem.config import ParallelLayout
from hybridmem.errors import WeightSyncError
from hybridmem.reshard import (
    MegatronConvention,
    ModelSpec,
    build_plan,
    megatron_layout,
    shard,
    unshard,
    vllm_layout,
)
from hybridmem.reshard.checksum import verify_offline
from hybridmem.reshard.execute import run_plan
from hybridmem.weight_sync import ReshardSync
from tests.reshard._tasks import ParamEngine, sync_engine
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
    target = {n: torch.full(t.shape, 7.0, dtype=torch.bfloat16, device=device)
              for n, t in dst.tensors(0).items()}
    out, stats = run_plan(plan, rank=0, src=shard(full, src, 0), dst=target)
    ref = vllm_shard({k: v.cpu() for k, v in full.items()}, SPEC, tp=1, pp=1, ep=1, world=1, rank=0)
    for name, t in ref.items():
        assert out[name] is target[name]
        assert torch.equal(out[name].cpu(), t), name  # padding rows (77 -> 128) were zeroed
    assert stats.received_nbytes == stats.min_received_nbytes == 0
    assert stats.num_tensors == len(ref)


@pytest.mark.parametrize("route", ["in_place", "layout", "hf"])
def test_reshard_sync_single_process(device, route):
    full = _full(device)
    train = shard(full, megatron_layout(SPEC, ParallelLayout(), 1), 0)
    dst = vllm_layout(SPEC, ParallelLayout(), 1)
    engine = sync_engine(route, dst, 0, dtype=torch.bfloat16, device=device)
    sync = ReshardSync(SPEC, ParallelLayout(), ParallelLayout(), None, lambda: train, engine, verify=True)
    stats = sync.sync()
    got = engine.tensors if route == "in_place" else engine.loaded
    ref = full if route == "hf" else shard(full, dst, 0)
    assert set(got) == set(ref) and all(torch.equal(got[n], t) for n, t in ref.items())
    assert stats.num_tensors == len(ref) and stats.received_nbytes == 0


def test_verify_offline_names_the_bad_slice():
    full = random_full(SPEC)
    src = megatron_layout(SPEC, ParallelLayout(tp=2), 2)
    dst = vllm_layout(SPEC, ParallelLayout(tp=1), 2)
    plan = build_plan(src, dst, itemsize=4)
    train = [shard(full, src, r) for r in range(2)]
    out = [shard(full, dst, r) for r in range(2)]
    assert (verify_offline(plan, train, out)
            == len(plan.local[0]) + len(plan.local[1]) + sum(map(len, plan.buckets)))
    # Swap two columns of one row-parallel weight: the plain sum is unchanged, the weighted one is not.
    w = out[1]["model.layers.1.self_attn.o_proj.weight"]
    w[:, [0, 1]] = w[:, [1, 0]]
    with pytest.raises(WeightSyncError,
                       match=r"model.layers.1.self_attn.o_proj.weight slice .* written on rank 1"):
        verify_offline(plan, train, out)


def test_mixed_source_dtypes_are_cast_to_the_wire_dtype_and_verified():
    """Megatron keeps norms in fp32 beside bf16 weights: the sync casts them, and verify still passes."""
    full = random_full(SPEC, dtype=torch.float32)
    train = {n: (t if "norm" in n else t.to(torch.bfloat16))
             for n, t in shard(full, megatron_layout(SPEC, ParallelLayout(), 1), 0).items()}
    assert {t.dtype for t in train.values()} == {torch.float32, torch.bfloat16}
    dst = vllm_layout(SPEC, ParallelLayout(), 1)
    engine = ParamEngine({n: torch.zeros(t.shape, dtype=torch.bfloat16) for n, t in dst.tensors(0).items()})
    ReshardSync(SPEC, ParallelLayout(), ParallelLayout(), None, lambda: train, engine, verify=True,
                dtype=torch.bfloat16).sync()
    ref = vllm_shard(full, SPEC, tp=1, pp=1, ep=1, world=1, rank=0)
    for name, t in ref.items():
        assert torch.equal(engine.tensors[name], t.to(torch.bfloat16)), name


def test_unshard_keeps_each_tensor_dtype():
    full = random_full(SPEC, dtype=torch.float32)
    layout = megatron_layout(SPEC, ParallelLayout(tp=2), 2)
    per_rank = [{n: (t if "norm" in n else t.to(torch.bfloat16)) for n, t in shard(full, layout, r).items()}
                for r in range(2)]
    back = unshard(per_rank, layout)
    assert (back["model.norm.weight"].dtype == torch.float32
            and torch.equal(back["model.norm.weight"], full["model.norm.weight"]))
    assert back["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16


def test_padded_vocab_size_overrides_the_divisor_and_is_checked():
    conv = MegatronConvention(padded_vocab_size=80)
    layout = megatron_layout(SPEC, ParallelLayout(tp=2), 2, convention=conv)
    assert layout.tensors(0)["embedding.word_embeddings.weight"].shape[0] == 40  # not 256 / 2
    with pytest.raises(ValueError, match="padded_vocab_size=76 must be >= vocab_size=77"):
        megatron_layout(SPEC, ParallelLayout(tp=2), 2,
                        convention=MegatronConvention(padded_vocab_size=76)).tensors(0)
    with pytest.raises(ValueError, match="padded_vocab_size=0"):
        MegatronConvention(padded_vocab_size=0)
