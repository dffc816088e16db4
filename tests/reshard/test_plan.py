"""ReshardPlan: minimal received bytes (checked against element ids), bucket bounds, caching, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from hybridmem.config import ParallelLayout
from hybridmem.reshard import (
    ModelSpec,
    build_plan,
    hf_layout,
    megatron_layout,
    vllm_layout,
)
from tests.reshard.reference import megatron_shard, vllm_shard
from tests.reshard.test_offline_property import dense_case

SPEC = ModelSpec(family="qwen2", hidden_size=16, num_attention_heads=8, num_key_value_heads=4, head_dim=2,
                 intermediate_size=32, num_hidden_layers=4, vocab_size=100, qkv_bias=True)


def _id_tensors(spec):
    """Every element of every HF tensor holds a distinct positive id (exact in float64)."""
    out, base = {}, 1
    for name, shape in spec.full_shapes().items():
        n = torch.Size(shape).numel()
        out[name] = torch.arange(base, base + n, dtype=torch.float64).reshape(shape)
        base += n
    return out


def _ids(tensors):
    ids = set()
    for t in tensors.values():
        ids.update(int(x) for x in t.flatten().tolist() if x != 0)
    return ids


def _min_by_ids(spec, src, dst, world, rank):
    ids = _id_tensors(spec)
    held = _ids(megatron_shard(ids, spec, tp=src.tp, pp=src.pp, ep=src.ep, world=world, rank=rank))
    need = vllm_shard(ids, spec, tp=dst.tp, pp=dst.pp, ep=dst.ep, world=world, rank=rank)
    # Count with multiplicity on the destination (kv heads are never duplicated within one rank).
    return sum(int(((t != 0) & ~torch.isin(t, torch.tensor(sorted(held), dtype=torch.float64))).sum())
               for t in need.values())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dense_case())
def test_plan_receives_exactly_the_missing_elements(case):
    spec, src, dst, world, _ = case
    plan = build_plan(megatron_layout(spec, src, world), vllm_layout(spec, dst, world), itemsize=2,
                      bucket_nbytes=64)
    for r in range(world):
        expected = _min_by_ids(spec, src, dst, world, r) * 2
        assert plan.min_recv_nbytes(r) == expected, (r, src, dst)
        assert plan.recv_nbytes(r) == expected
        assert plan.peak_temp_nbytes(r) <= 64
    assert sum(plan.recv_nbytes(r) for r in range(world)) == sum(plan.send_nbytes(r) for r in range(world))


def test_tp4_to_tp2_exact_bytes():
    """TP4 -> TP2 on 4 ranks (vLLM: 2 replicas). Per split layer tensor, rank r needs TP2 half r % 2 and
    holds TP4 quarter r: ranks 0 and 3 lack one quarter, ranks 1 and 2 lack two. Vocab: Megatron pads
    100 rows to 512 so TP4 rank 0 holds all 100 real rows; vLLM pads to 128, half = 64 rows."""
    src = megatron_layout(SPEC, ParallelLayout(tp=4), 4)
    dst = vllm_layout(SPEC, ParallelLayout(tp=2), 4)
    plan = build_plan(src, dst, itemsize=2)
    h, q, kv, f = 16, 16, 8, 32
    split_numel = (q + 2 * kv) * h + (q + 2 * kv) + h * q + 2 * f * h + h * f
    layers = SPEC.num_hidden_layers * split_numel
    vocab_rows = {0: 0, 1: 36, 2: 64, 3: 36}  # per vocab tensor (embed and lm_head)
    quarters = {0: 1, 1: 2, 2: 2, 3: 1}
    for r in range(4):
        expected = (layers * quarters[r] // 4 + 2 * vocab_rows[r] * h) * 2
        assert plan.min_recv_nbytes(r) == expected, r
        assert plan.recv_nbytes(r) == expected
    # verl-style all-gather-to-full: every rank receives 3/4 of every split tensor.
    assert max(plan.recv_nbytes(r) for r in range(4)) < layers * 3 // 4 * 2


def test_plan_is_cached_and_pure():
    src = megatron_layout(SPEC, ParallelLayout(tp=2), 4)
    dst = vllm_layout(SPEC, ParallelLayout(tp=4), 4)
    a = build_plan(src, dst, itemsize=2, bucket_nbytes=1024)
    b = build_plan(megatron_layout(SPEC, ParallelLayout(tp=2), 4), vllm_layout(SPEC, ParallelLayout(tp=4), 4),
                   itemsize=2, bucket_nbytes=1024)
    assert a is b
    assert build_plan(src, dst, itemsize=2, bucket_nbytes=2048) is not a


@pytest.mark.parametrize("bucket", [40, 256, 4096, 1 << 30])
def test_buckets_bound_temp_memory(bucket):
    plan = build_plan(megatron_layout(SPEC, ParallelLayout(tp=2, pp=2), 4),
                      vllm_layout(SPEC, ParallelLayout(tp=1), 4), itemsize=2, bucket_nbytes=bucket)
    for r in range(4):
        assert 0 < plan.peak_temp_nbytes(r) <= bucket
        assert plan.recv_nbytes(r) == plan.min_recv_nbytes(r)
    for bucket_transfers in plan.buckets:
        for r in range(4):
            load = sum(t.numel * 2 for t in bucket_transfers if r in (t.src_rank, t.dst_rank))
            assert load <= bucket


def test_hf_destination_needs_full_stage_tensors():
    plan = build_plan(megatron_layout(SPEC, ParallelLayout(tp=2), 2),
                      hf_layout(SPEC, ParallelLayout(tp=2), 2), itemsize=4)
    full = sum(torch.Size(s).numel() for s in SPEC.full_shapes().values()) * 4
    for r in range(2):
        assert plan.dst_nbytes(r) == full
        assert plan.recv_nbytes(r) == plan.min_recv_nbytes(r) < full


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: megatron_layout(SPEC, ParallelLayout(tp=2, pp=2), 6),
         r"world_size=6 is not divisible by tp\*pp=2\*2"),
        (lambda: megatron_layout(SPEC, ParallelLayout(tp=8), 8),
         "training tp=8 must divide the query groups num_key_value_heads=4"),
        (lambda: megatron_layout(SPEC, ParallelLayout(pp=3), 3),
         "training pp=3 does not divide num_hidden_layers=4"),
        (lambda: vllm_layout(SPEC, ParallelLayout(tp=3), 3),
         "inference tp=3 does not divide num_attention_heads=8"),
        (lambda: vllm_layout(SPEC, ParallelLayout(tp=4), 6), r"world_size=6 is not divisible by tp\*pp=4\*1"),
        (lambda: vllm_layout(SPEC, ParallelLayout(pp=8), 8), "inference pp=8 exceeds num_hidden_layers=4"),
        (lambda: vllm_layout(SPEC, ParallelLayout(ep=2), 2), "ep=2 given for a dense model"),
    ],
)
def test_invalid_layouts_name_numbers(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_invalid_moe_layouts_name_numbers():
    moe = ModelSpec(family="qwen3_moe", hidden_size=8, num_attention_heads=4, num_key_value_heads=4,
                    head_dim=2, intermediate_size=0, num_hidden_layers=2, vocab_size=64, num_experts=6,
                    moe_intermediate_size=4)
    with pytest.raises(ValueError, match=r"training ep=4 does not divide dp=2"):
        megatron_layout(moe, ParallelLayout(tp=2, ep=4), 4)
    with pytest.raises(ValueError, match="training ep=4 does not divide num_experts=6"):
        megatron_layout(moe, ParallelLayout(ep=4), 4)
    with pytest.raises(ValueError,
                       match=r"inference ep=4 must divide dp\*tp=1\*2 and not exceed num_experts=6"):
        vllm_layout(moe, ParallelLayout(tp=2, ep=4), 2)


def test_mismatched_plans_rejected():
    other = ModelSpec(hidden_size=8, num_attention_heads=4, num_key_value_heads=4, head_dim=2,
                      intermediate_size=8, num_hidden_layers=1, vocab_size=8)
    with pytest.raises(ValueError, match="specs differ"):
        build_plan(megatron_layout(SPEC, ParallelLayout(), 1), vllm_layout(other, ParallelLayout(), 1))
    with pytest.raises(ValueError, match="source world_size=2 != destination world_size=1"):
        build_plan(megatron_layout(SPEC, ParallelLayout(), 2), vllm_layout(SPEC, ParallelLayout(), 1))


def test_invalid_mla_layouts_name_the_numbers():
    from hybridmem.reshard import MegatronConvention

    spec = ModelSpec(family="deepseek_v3", hidden_size=8, num_attention_heads=4, num_key_value_heads=4,
                     head_dim=6, intermediate_size=8, num_hidden_layers=2, vocab_size=64, num_experts=4,
                     moe_intermediate_size=4, q_lora_rank=6, kv_lora_rank=6, qk_nope_head_dim=4,
                     qk_rope_head_dim=2, v_head_dim=4)
    with pytest.raises(ValueError,
                       match=r"tp=4 must divide q_lora_rank=6 and kv_lora_rank \+ qk_rope_head_dim=8"):
        megatron_layout(spec, ParallelLayout(tp=4), 4)
    with pytest.raises(ValueError, match="norm_style='te' is not supported for MLA"):
        megatron_layout(spec, ParallelLayout(tp=2), 2, convention=MegatronConvention(norm_style="te"))
    megatron_layout(spec, ParallelLayout(tp=2), 2)  # 6 and 8 split in two


QWEN3_FP8 = ModelSpec(family="qwen3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=128, intermediate_size=512, num_hidden_layers=2, vocab_size=256,
                      tie_word_embeddings=False)
"""The tiny Qwen3 of tests/planner/test_fp8_plan.py, whose Megatron TP 2 halves are whole 128-blocks."""


@pytest.mark.parametrize("bucket", [2**13, 3 * 2**14 + 1000, 2**30])
def test_a_quantized_plan_cuts_its_fp8_weights_between_blocks_only(bucket):
    """Buckets too small for a weight's half cut it into parts, and a part cut inside a 128-row block would
    have to move in bf16: cut between blocks only, every part of a whole-block half still moves quantized,
    and each of two TP 1 engine ranks receives what it lacks, by hand (tests/planner/test_fp8_plan.py's
    figure): per layer 393,216 weight elements at one byte and 24 blocks at four, and half the bf16 embedding
    and head rows."""
    from hybridmem.reshard.conventions import VLLMConvention
    from hybridmem.weight_sync.fp8 import Fp8Target

    fp8 = VLLMConvention(weight_block_size=(128, 128))
    layout = vllm_layout(QWEN3_FP8, ParallelLayout(), 2, convention=fp8)
    target = Fp8Target(layout, 0)
    plan = build_plan(megatron_layout(QWEN3_FP8, ParallelLayout(tp=2), 2), target.plan_layout(), itemsize=2,
                      bucket_nbytes=bucket, quantized=target.quantized_names())
    cells = [t for step in plan.buckets for t in step if t.hf_name in plan.quantized]
    assert cells and all(plan.quantizes(t) for t in cells)
    # the small buckets did cut (uncut: 2 ranks x 7 weights x 2 layers)
    assert (len(cells) > 2 * 7 * 2) == (bucket < 2**30)
    moved = 2 * (393_216 + 4 * 24) + 2 * (128 * 256) * 2
    assert [plan.recv_nbytes(r) for r in range(2)] == [moved] * 2
    assert [plan.min_recv_nbytes(r) for r in range(2)] == [moved] * 2
