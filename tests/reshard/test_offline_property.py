"""reshard_offline equals independent references, over random specs and layouts (hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridmem.config import ParallelLayout
from hybridmem.reshard import (
    MegatronConvention,
    ModelSpec,
    build_plan,
    megatron_layout,
    reshard_offline,
    shard,
    unshard,
    vllm_layout,
)
from tests.reshard.reference import megatron_shard, random_full, vllm_shard


@st.composite
def dense_case(draw, max_world: int = 8):
    """A dense spec and a (train, infer) layout pair valid on a world of 1-``max_world`` ranks."""
    tp_t = draw(st.sampled_from([t for t in (1, 2, 4, 8) if t <= max_world]))
    pp_t = draw(st.sampled_from([p for p in (1, 2, 4) if tp_t * p <= max_world]))
    dp_t = draw(st.sampled_from([d for d in (1, 2, 4, 8) if tp_t * pp_t * d <= max_world]))
    world = tp_t * pp_t * dp_t
    tp_i = draw(st.sampled_from([t for t in (1, 2, 4, 8) if world % t == 0]))
    pp_i = draw(st.sampled_from([p for p in (1, 2) if world % (tp_i * p) == 0]))
    # Megatron needs tp_t | query groups; vLLM needs tp_i | heads and tp_i, kv dividing one another
    # (always true here: both are powers of two).
    kv = tp_t * draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 2, 3])) * max(1, tp_i // kv)
    layers = draw(st.integers(2, 3)) if pp_t == 1 else pp_t * draw(st.integers(1, 2))
    spec = ModelSpec(
        family=draw(st.sampled_from(["llama", "qwen2", "qwen3"])),
        hidden_size=draw(st.sampled_from([8, 12, 16])),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=draw(st.sampled_from([2, 4])),
        intermediate_size=8 * draw(st.integers(1, 3)),
        num_hidden_layers=layers,
        vocab_size=draw(st.integers(5, 200)),
        qkv_bias=draw(st.booleans()),
        qk_norm=draw(st.booleans()),
        tie_word_embeddings=draw(st.booleans()),
    )
    te = draw(st.booleans())
    return spec, ParallelLayout(tp=tp_t, pp=pp_t), ParallelLayout(tp=tp_i, pp=pp_i), world, te


def _check(spec, src, dst, world, te=False, bucket=1 << 20):
    full = random_full(spec)
    conv = MegatronConvention(norm_style="te" if te else "local")
    train = [megatron_shard(full, spec, tp=src.tp, pp=src.pp, ep=src.ep, world=world, rank=r, te=te)
             for r in range(world)]
    # Our Megatron layout reproduces the reference Megatron shards exactly (names, shapes, values).
    m_layout = megatron_layout(spec, src, world, convention=conv)
    for r in range(world):
        ours = shard(full, m_layout, r)
        assert set(ours) == set(train[r]), (r, set(ours) ^ set(train[r]))
        for name, t in train[r].items():
            assert torch.equal(ours[name], t), (r, name)
    out = reshard_offline(train, model=spec, src=src, dst=dst, megatron=conv, bucket_nbytes=bucket)
    for r in range(world):
        ref = vllm_shard(full, spec, tp=dst.tp, pp=dst.pp, ep=dst.ep, world=world, rank=r)
        assert set(out[r]) == set(ref), (r, set(out[r]) ^ set(ref))
        for name, t in ref.items():
            assert torch.equal(out[r][name], t), (r, name, src, dst)
    # unshard(vLLM shards) gives back the full tensors (real vocab rows, padding dropped).
    back = unshard(out, vllm_layout(spec, dst, world))
    for name, t in full.items():
        assert torch.equal(back[name], t), name


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dense_case())
def test_dense_offline_matches_reference(case):
    spec, src, dst, world, te = case
    _check(spec, src, dst, world, te=te, bucket=64)


@st.composite
def moe_case(draw):
    family = draw(st.sampled_from(["qwen2_moe", "qwen3_moe"]))
    tp_t = draw(st.sampled_from([1, 2]))
    ep_t = draw(st.sampled_from([1, 2, 4]))
    dp_t = ep_t * draw(st.sampled_from([1, 2]))
    world = tp_t * dp_t
    if world > 8:
        dp_t, world = ep_t, tp_t * ep_t
    tp_i = draw(st.sampled_from([t for t in (1, 2, 4) if world % t == 0]))
    ep_i = draw(st.sampled_from([e for e in (1, 2, 4, 8) if world % e == 0]))
    spec = ModelSpec(
        family=family, hidden_size=8, num_attention_heads=8,
        num_key_value_heads=4, head_dim=2, intermediate_size=0, num_hidden_layers=2,
        vocab_size=draw(st.integers(5, 90)), qkv_bias=family == "qwen2_moe", qk_norm=family == "qwen3_moe",
        tie_word_embeddings=draw(st.booleans()), num_experts=8,
        moe_intermediate_size=4 * draw(st.integers(1, 2)),
        shared_expert_intermediate_size=8 if family == "qwen2_moe" else 0,
    )
    return spec, ParallelLayout(tp=tp_t, ep=ep_t), ParallelLayout(tp=tp_i, ep=ep_i), world


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_case())
def test_moe_offline_matches_reference(case):
    spec, src, dst, world = case
    _check(spec, src, dst, world, bucket=96)


@st.composite
def deepseek_case(draw):
    """DeepSeek-V3-style specs (MLA with or without q_lora, dense-first layers, shared experts, router
    bias)."""
    tp_t, pp_t, ep_t = (draw(st.sampled_from([1, 2])) for _ in range(3))
    dp_t = ep_t * draw(st.sampled_from([1, 2]))
    world = tp_t * pp_t * dp_t
    layers = pp_t * draw(st.integers(1, 2))
    tp_i = draw(st.sampled_from([t for t in (1, 2, 4) if world % t == 0]))
    pp_i = draw(st.sampled_from([p for p in (1, 2) if world % (tp_i * p) == 0 and p <= layers]))
    ep_i = draw(st.sampled_from([e for e in (1, 2, 4) if (world // pp_i) % e == 0]))  # ep | dp*tp
    nope, rope = draw(st.sampled_from([2, 4])), 2
    spec = ModelSpec(
        family="deepseek_v3", hidden_size=8, num_attention_heads=4, num_key_value_heads=4,
        head_dim=nope + rope, intermediate_size=8, num_hidden_layers=layers,
        vocab_size=draw(st.integers(5, 90)), tie_word_embeddings=draw(st.booleans()), num_experts=4,
        moe_intermediate_size=4, shared_expert_intermediate_size=draw(st.sampled_from([0, 4, 8])),
        first_k_dense_replace=draw(st.integers(0, layers)), q_lora_rank=draw(st.sampled_from([0, 4, 8])),
        kv_lora_rank=draw(st.sampled_from([2, 6])), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
        v_head_dim=draw(st.sampled_from([2, 4])),
    )
    return spec, ParallelLayout(tp=tp_t, pp=pp_t, ep=ep_t), ParallelLayout(tp=tp_i, pp=pp_i, ep=ep_i), world


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(deepseek_case())
def test_deepseek_offline_matches_reference(case):
    spec, src, dst, world = case
    _check(spec, src, dst, world, bucket=80)


def test_deepseek_q_a_and_kv_a_are_gathered_into_vllms_fused_replicated_tensor():
    """Megatron TP2 splits q_a and kv_a by rows; every vLLM rank needs both whole, fused: each rank lacks
    exactly the other rank's half of both."""
    spec = ModelSpec(family="deepseek_v3", hidden_size=8, num_attention_heads=4, num_key_value_heads=4,
                     head_dim=6, intermediate_size=8, num_hidden_layers=1, vocab_size=64, num_experts=4,
                     moe_intermediate_size=4, first_k_dense_replace=1, q_lora_rank=4, kv_lora_rank=6,
                     qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)
    _check(spec, ParallelLayout(tp=2), ParallelLayout(tp=2), 2)
    # Megatron holding the vocab padded as vLLM pads it (64 rows), so the vocab rows line up too.
    conv = MegatronConvention(padded_vocab_size=64)
    src = megatron_layout(spec, ParallelLayout(tp=2), 2, convention=conv)
    dst = vllm_layout(spec, ParallelLayout(tp=2), 2)
    plan = build_plan(src, dst, itemsize=2)
    fused = dst.tensors(0)["model.layers.0.self_attn.fused_qkv_a_proj.weight"]
    assert fused.shape == (4 + 6 + 2, 8)
    # Everything else lines up rank for rank (both sides chunk the same rows by rank): each rank receives
    # the other's half of q_a (4 rows) and of kv_a (6 + 2 rows), H=8 columns, 2 bytes each.
    assert all(plan.min_recv_nbytes(r) == (4 + 8) // 2 * 8 * 2 for r in range(2))


@pytest.mark.parametrize(
    "src,dst,world",
    [
        (ParallelLayout(tp=1, ep=4), ParallelLayout(tp=4), 4),  # EP -> TP
        (ParallelLayout(tp=2, ep=2), ParallelLayout(tp=1, ep=4), 4),  # EP -> EP'
        (ParallelLayout(tp=1, ep=2), ParallelLayout(tp=2, ep=2), 4),  # EP -> TP x EP (vLLM ep=2 < tp*dp)
        (ParallelLayout(tp=2, ep=1), ParallelLayout(tp=2, ep=4), 4),  # TP -> EP
    ],
)
def test_moe_named_conversions(src, dst, world):
    spec = ModelSpec(family="qwen2_moe", hidden_size=8, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=2, intermediate_size=0, num_hidden_layers=2, vocab_size=70, qkv_bias=True,
                     num_experts=8, moe_intermediate_size=4, shared_expert_intermediate_size=8)
    _check(spec, src, dst, world)


def test_moe_uneven_vllm_experts():
    """vLLM spreads 6 experts over ep=4 as 2, 2, 1, 1 (linear placement); Megatron holds 3 + 3 (ep=2)."""
    spec = ModelSpec(family="qwen3_moe", hidden_size=8, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=2, intermediate_size=0, num_hidden_layers=1, vocab_size=64, qk_norm=True,
                     num_experts=6, moe_intermediate_size=4)
    _check(spec, ParallelLayout(ep=2), ParallelLayout(tp=1, ep=4), 4)
    layout = vllm_layout(spec, ParallelLayout(tp=1, ep=4), 4)
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    assert [layout.tensors(r)[w13].shape[0] for r in range(4)] == [2, 2, 1, 1]


def test_moe_ep_to_tp_moves_only_missing_bytes():
    """EP4 -> TP4 on 4 ranks: each rank had 2 whole experts, now needs a quarter of each of 8."""
    spec = ModelSpec(family="qwen3_moe", hidden_size=8, num_attention_heads=4, num_key_value_heads=4,
                     head_dim=2, intermediate_size=0, num_hidden_layers=1, vocab_size=64, qk_norm=True,
                     num_experts=8, moe_intermediate_size=4)
    src, dst = megatron_layout(spec, ParallelLayout(ep=4), 4), vllm_layout(spec, ParallelLayout(tp=4), 4)
    plan = build_plan(src, dst, itemsize=2)
    h, i, e = 8, 4, 8
    expert = 3 * h * i  # gate, up, down of one expert
    # Per rank: needs 1/4 of each of 8 experts = 2 experts' worth; already holds 1/4 of its own 2.
    need_experts = e * expert // 4 - 2 * expert // 4
    # Dense part (attention, embed) comes from the replicated TP1 source: every rank holds it all.
    assert all(plan.min_recv_nbytes(r) == need_experts * 2 for r in range(4))
    assert all(plan.recv_nbytes(r) == plan.min_recv_nbytes(r) for r in range(4))


def test_vllm_pp_layers_match_vllm_rule():
    from hybridmem.reshard.stages import vllm_pp_layers
    from tests.reshard.reference import vllm_stage_layers

    for n in range(1, 13):
        for pp in range(1, min(n, 5) + 1):
            stages = [vllm_pp_layers(n, s, pp) for s in range(pp)]
            assert [list(s) for s in stages] == [vllm_stage_layers(n, pp, s) for s in range(pp)]
            assert sum(stages, ()) == tuple(range(n))
    # vLLM's own example: 5 layers on 3 stages -> [1, 2, 2]? no: the extra goes to stage pp-2 first.
    assert [len(vllm_pp_layers(5, s, 3)) for s in range(3)] == [2, 2, 1]
