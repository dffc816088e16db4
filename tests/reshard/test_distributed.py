"""Distributed execution over gloo (a reused pool of 4 processes) equals reshard_offline, with
received bytes equal to the plan's minimum; the HF stream and ReshardSync (with verification)."""

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
    reshard_offline,
    stream_peak_nbytes,
    vllm_layout,
)
from hybridmem.testing.workers import WorkerPool
from tests.reshard import _tasks
from tests.reshard.reference import megatron_shard, random_full, vllm_shard
from tests.reshard.test_offline_property import dense_case

MAX_WORLD = 4


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(MAX_WORLD, timeout_s=300) as p:
        yield p


def _offline(spec, src, dst, world):
    full = random_full(spec)
    train = [megatron_shard(full, spec, tp=src.tp, pp=src.pp, ep=src.ep, world=world, rank=r)
             for r in range(world)]
    return full, reshard_offline(train, model=spec, src=src, dst=dst)


def _check_run(pool, spec, src, dst, world, bucket):
    results = pool.run(_tasks.run_plan_task, spec, src, dst, bucket, world_size=world)
    full, offline = _offline(spec, src, dst, world)
    plan = build_plan(megatron_layout(spec, src, world), vllm_layout(spec, dst, world), itemsize=4,
                      bucket_nbytes=bucket)
    for r, (out, stats) in enumerate(results):
        assert set(out) == set(offline[r])
        for name, t in offline[r].items():
            assert torch.equal(out[name], t), (r, name)
        ref = vllm_shard(full, spec, tp=dst.tp, pp=dst.pp, ep=dst.ep, world=world, rank=r)
        assert all(torch.equal(out[n], t) for n, t in ref.items())
        assert stats.received_nbytes == stats.min_received_nbytes == plan.min_recv_nbytes(r)
        assert stats.sent_nbytes == plan.send_nbytes(r)
        assert stats.temp_peak_nbytes <= bucket
    return results


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=dense_case(max_world=MAX_WORLD))
def test_distributed_equals_offline(pool, case):
    spec, src, dst, world, _ = case
    _check_run(pool, spec, src, dst, world, bucket=128)


MOE = ModelSpec(family="qwen2_moe", hidden_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=2,
                intermediate_size=0, num_hidden_layers=2, vocab_size=70, qkv_bias=True, num_experts=8,
                moe_intermediate_size=4, shared_expert_intermediate_size=8)


@pytest.mark.parametrize("src,dst", [(ParallelLayout(ep=4), ParallelLayout(tp=4)),
                                     (ParallelLayout(tp=2, ep=2), ParallelLayout(tp=1, ep=4))])
def test_distributed_moe(pool, src, dst):
    _check_run(pool, MOE, src, dst, 4, bucket=256)


DEEPSEEK = ModelSpec(family="deepseek_v3", hidden_size=8, num_attention_heads=4, num_key_value_heads=4,
                     head_dim=6, intermediate_size=8, num_hidden_layers=2, vocab_size=70, num_experts=4,
                     moe_intermediate_size=4, shared_expert_intermediate_size=8, first_k_dense_replace=1,
                     q_lora_rank=4, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)


@pytest.mark.parametrize("src,dst", [(ParallelLayout(tp=2, ep=2), ParallelLayout(tp=4)),  # EP -> TP
                                     (ParallelLayout(tp=2, pp=2), ParallelLayout(tp=1, ep=4))])  # -> EP
def test_distributed_deepseek(pool, src, dst):
    _check_run(pool, DEEPSEEK, src, dst, 4, bucket=256)


def test_router_bias_travels_in_fp32_on_a_bf16_wire(pool):
    """DeepSeek's routing-score correction bias must not be rounded to bf16: PP2 -> PP1 moves stage 1's
    layers (bias included) over the wire, in place and as an HF stream."""
    src, dst = ParallelLayout(tp=1, pp=2), ParallelLayout(tp=2)
    results = pool.run(_tasks.bf16_wire_with_fp32_bias_task, DEEPSEEK, src, dst, 256, world_size=2)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    for rank, (full, out, stats, min_nbytes, streamed) in enumerate(results):
        ref = vllm_shard(full, DEEPSEEK, tp=dst.tp, pp=dst.pp, ep=dst.ep, world=2, rank=rank)
        for name, t in ref.items():
            assert out[name].dtype == t.dtype and torch.equal(out[name], t), (rank, name)
        assert out[bias].dtype == torch.float32 and not torch.equal(out[bias], out[bias].bfloat16().float())
        assert stats.received_nbytes == min_nbytes  # the bias counted at 4 bytes per element
        assert streamed[bias].dtype == torch.float32 and torch.equal(streamed[bias], full[bias])
    # Rank 0 held only stage 0 (layer 0): it received layer 1, its 4-element fp32 bias among it.
    assert results[0][2].received_nbytes > 0


def test_stream_of_full_hf_tensors(pool):
    spec = ModelSpec(family="qwen3", hidden_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                     intermediate_size=16, num_hidden_layers=3, vocab_size=33, qk_norm=True,
                     tie_word_embeddings=True)
    results = pool.run(_tasks.stream_task, spec, ParallelLayout(tp=2, pp=1), ParallelLayout(tp=2, pp=2), 200,
                       world_size=4)
    for r, (names, ok, stats, expected) in enumerate(results):
        assert ok, r
        assert sorted(names) == expected and len(names) == len(set(names))
        assert stats.received_nbytes == stats.min_received_nbytes
    # Stage 0 (ranks 0,1) has layers 0-1 and the embedding; stage 1 (ranks 2,3) layer 2, norm and the
    # tied embedding (vLLM keeps embed_tokens on the last stage when tied).
    assert "model.layers.1.mlp.up_proj.weight" in results[0][0] and "model.norm.weight" not in results[0][0]
    assert {"model.norm.weight", "model.embed_tokens.weight",
            "model.layers.2.mlp.up_proj.weight"} <= set(results[3][0])


SPEC = ModelSpec(family="qwen2", hidden_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=2,
                 intermediate_size=8, num_hidden_layers=2, vocab_size=70, qkv_bias=True)


@pytest.mark.parametrize("route", ["in_place", "layout", "hf"])
@pytest.mark.parametrize("src", [ParallelLayout(tp=2, pp=2), ParallelLayout(tp=2)], ids=["tp2pp2", "tp2"])
def test_reshard_sync_writes_engine_and_verifies(pool, route, src):
    """From TP2xPP2 into TP2, and from TP2 into TP4 (where a rank can have nothing to send or receive, and
    still takes part in the checksum comparison): in place, as a stream of the engine's own layout, and as
    full HF tensors."""
    dst = ParallelLayout(tp=2) if src.pp == 2 else ParallelLayout(tp=4)
    results = pool.run(_tasks.sync_task, SPEC, src, dst, route=route, world_size=4)
    full = random_full(SPEC)
    for r, (got, stats, error, temp) in enumerate(results):
        assert error is None, error
        ref = full if route == "hf" else vllm_shard(full, SPEC, tp=dst.tp, pp=1, ep=1, world=4, rank=r)
        assert set(got) == set(ref)
        assert all(torch.equal(got[n], t) for n, t in ref.items())
        assert stats.received_nbytes == stats.min_received_nbytes
        # a stream's complete tensors in flight count beside the staging buckets
        in_flight = 0 if route == "in_place" else stream_peak_nbytes(
            _plan(SPEC, src, dst, r, hf=route == "hf"), r, torch.float32)
        assert stats.temp_peak_nbytes <= temp - in_flight <= 256
        assert (stats.temp_peak_nbytes > 0) == (stats.sent_nbytes + stats.received_nbytes > 0)


def _plan(spec, src, dst, rank, *, hf):
    return build_plan(megatron_layout(spec, src, 4), (hf_layout if hf else vllm_layout)(spec, dst, 4),
                      itemsize=4, bucket_nbytes=256, rank=rank)


@pytest.mark.parametrize("route", ["in_place", "layout"])
def test_reshard_sync_detects_corruption(pool, route):
    results = pool.run(_tasks.sync_task, SPEC, ParallelLayout(tp=2, pp=2), ParallelLayout(tp=2),
                       route=route, corrupt_rank=1, world_size=4)
    for _got, _stats, error, _ in results:
        assert error is not None and error.startswith("WeightSyncError")
        assert "written on rank 1" in error
