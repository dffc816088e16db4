"""A rank's share of a resharding plan (``build_plan(src, dst, rank=r)``), computed from the layouts' rank
groups alone, equals rank r's part of the whole plan, built from every rank's tensors; the steps both ends
of every transfer compute run to the end without deadlock; the layouts' parts are their tensors.

See [Note: plan cells] in :mod:`hybridmem.reshard.plan` and [Note: plan schedule] in
:mod:`hybridmem.reshard.schedule`. The share-equals-whole property draws 20 cases in CI (each builds every
rank's plan with buckets of a few elements: about 2 s) and 60 under ``HYBRIDMEM_TESTS_FULL=1``; hypothesis
draws new ones on every run.
"""

from __future__ import annotations

import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridmem.config import ParallelLayout
from hybridmem.reshard import (
    ModelSpec,
    build_plan,
    hf_layout,
    hf_source_layout,
    megatron_layout,
    vllm_layout,
)
from hybridmem.reshard.plan import Transfer
from tests._full import TESTS_FULL
from tests.reshard.families import COMMON, MODELS
from tests.reshard.test_offline_property import deepseek_case, dense_case, moe_case


def _share_of(whole, rank: int) -> list[tuple[tuple[int, int, int], tuple[Transfer, ...]]]:
    steps = [(k, tuple(t for t in b if rank in (t.src_rank, t.dst_rank)))
             for k, b in zip(whole.keys, whole.buckets, strict=False)]
    return [(k, b) for k, b in steps if b]


def _assert_shares_equal_whole(src, dst, *, itemsize: int = 2, bucket: int = 1 << 20) -> None:
    whole = build_plan(src, dst, itemsize=itemsize, bucket_nbytes=bucket)
    for r in range(src.world_size):
        share = build_plan(src, dst, itemsize=itemsize, bucket_nbytes=bucket, rank=r)
        assert share.local[r] == whole.local[r], (r, src, dst)
        assert list(zip(share.keys, share.buckets, strict=False)) == _share_of(whole, r), (r, src, dst)
        for figure in ("recv_nbytes", "send_nbytes", "peak_temp_nbytes", "min_recv_nbytes"):
            assert getattr(share, figure)(r) == getattr(whole, figure)(r), (figure, r)


def _run_to_the_end(shares) -> int:
    """Play every rank's steps as the executor runs them: a rank reaching a step posts all its sends and
    receives, then waits for all of them; an operation completes once its peer has posted the matching one
    (the same step, the same place among the transfers between the two). Every step must complete, within
    as many rounds as there are steps. Returns the rounds taken."""
    world = len(shares)
    at = [0] * world
    todo = [list(zip(p.keys, p.buckets, strict=False)) for p in shares]
    where = [{key: i for i, (key, _) in enumerate(steps)} for steps in todo]
    rounds = 0
    while any(at[r] < len(todo[r]) for r in range(world)):
        rounds += 1
        done = []
        for r in range(world):
            if at[r] == len(todo[r]):
                continue
            key, mine = todo[r][at[r]]
            peers = {t.dst_rank if t.src_rank == r else t.src_rank for t in mine}
            for peer in peers:
                assert key in where[peer], f"rank {r} has step {key} with rank {peer}, which does not"
                theirs = todo[peer][where[peer][key]][1]
                assert [t for t in mine if peer in (t.src_rank, t.dst_rank)] == \
                       [t for t in theirs if r in (t.src_rank, t.dst_rank)], (r, peer, key)
            if all(where[peer][key] <= at[peer] for peer in peers):  # every peer has posted it
                done.append(r)
        assert done, ("deadlock: ranks at steps "
                      f"{[todo[r][at[r]][0] if at[r] < len(todo[r]) else None for r in range(world)]}")
        for r in done:
            at[r] += 1
        assert rounds <= sum(len(t) for t in todo)
    return rounds


def _pairs_by_layout(case, hf_dst: bool):
    spec, src, dst, world = case[:4]
    conv = {}
    if len(case) > 4:
        from hybridmem.reshard import MegatronConvention
        conv = dict(convention=MegatronConvention(norm_style="te" if case[4] else "local"))
    destination = (hf_layout(spec, ParallelLayout(pp=dst.pp), world) if hf_dst
                   else vllm_layout(spec, dst, world))
    return megatron_layout(spec, src, world, **conv), destination


@settings(max_examples=60 if TESTS_FULL else 10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(dense_case(), moe_case(), deepseek_case()), st.booleans(), st.sampled_from([2, 4]),
       st.integers(2, 512))
def test_each_ranks_share_equals_its_part_of_the_whole_plan(case, hf_dst, itemsize, bucket_elems):
    src, dst = _pairs_by_layout(case, hf_dst)
    _assert_shares_equal_whole(src, dst, itemsize=itemsize, bucket=bucket_elems * itemsize)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(dense_case(), moe_case(), deepseek_case()), st.booleans(), st.integers(2, 256))
def test_every_ranks_steps_run_to_the_end_with_bounded_staging(case, hf_dst, bucket_elems):
    src, dst = _pairs_by_layout(case, hf_dst)
    bucket = bucket_elems * 2
    shares = [build_plan(src, dst, itemsize=2, bucket_nbytes=bucket, rank=r) for r in range(src.world_size)]
    _run_to_the_end(shares)
    for r, share in enumerate(shares):
        assert share.recv_nbytes(r) == share.min_recv_nbytes(r)
        for bucket_transfers in share.buckets:
            sent = [t for t in bucket_transfers if t.src_rank == r]
            got = [t for t in bucket_transfers if t.dst_rank == r]
            assert len({t.dst_rank for t in sent}) <= 1 and len({t.src_rank for t in got}) <= 1
            load = sum(t.numel * share.cell_itemsize(t.hf_name) for t in bucket_transfers)
            row = max(t.numel // (b - a) * share.cell_itemsize(t.hf_name)
                      for t in bucket_transfers for a, b in t.box[:1])
            assert load <= max(bucket, 2 * row), (r, load, bucket, row)  # one row larger than half: alone


@pytest.mark.parametrize("model_id", sorted(MODELS))
def test_every_family_from_fsdp2_shards_and_from_megatron(model_id):
    """Every described family, from FSDP2 shards (transformers' names) and from Megatron where the family
    has a Megatron layout (a multimodal model's names have none), into vLLM at TP 2 with expert parallelism
    for MoE models."""
    family, kw = MODELS[model_id]
    spec = ModelSpec.from_hf_config(transformers.AutoConfig.for_model(family, **{**COMMON, **kw}).to_dict())
    moe = spec.num_experts > 0
    dst = vllm_layout(spec, ParallelLayout(tp=2, ep=4 if moe else 1), 4)
    _assert_shares_equal_whole(hf_source_layout(spec, 4, shard_size=4), dst, bucket=4096)
    _assert_shares_equal_whole(hf_source_layout(spec, 4, shard_size=2),
                               hf_layout(spec, ParallelLayout(pp=2), 4), bucket=4096)
    if spec.description.megatron is None and not spec.multimodal:
        pp = 2 if spec.num_hidden_layers % 2 == 0 and not moe else 1
        _assert_shares_equal_whole(megatron_layout(spec, ParallelLayout(tp=2, pp=pp, ep=2 if moe else 1), 4),
                                   dst, bucket=4096)


@pytest.mark.parametrize("train,infer,world", [((2, 1, 8), (8, 1, 16), 16), ((4, 1, 8), (8, 2, 8), 32),
                                               ((2, 2, 4), (4, 1, 32), 32)])
def test_deepseek_v3_shape_at_scale(train, infer, world):
    """A DeepSeek-V3-shaped spec (MLA, 4 dense layers then MoE, shared experts, router bias) at up to 32
    ranks, expert parallel on both sides: every share equals the whole plan's part."""
    spec = ModelSpec.from_hf_config(dict(
        model_type="deepseek_v3", hidden_size=64, num_attention_heads=16, num_key_value_heads=16,
        intermediate_size=128, num_hidden_layers=6, vocab_size=512, n_routed_experts=32, n_shared_experts=1,
        moe_intermediate_size=32, first_k_dense_replace=2, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, topk_method="noaux_tc",
        tie_word_embeddings=False))
    lay = lambda tp, pp, ep: ParallelLayout(tp=tp, pp=pp, ep=ep)  # noqa: E731
    _assert_shares_equal_whole(megatron_layout(spec, lay(*train), world),
                               vllm_layout(spec, lay(*infer), world), bucket=1 << 14)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(dense_case(), moe_case(), deepseek_case()), st.booleans())
def test_a_layouts_parts_are_its_tensors(case, hf_dst):
    """[Note: layout parts] in :mod:`hybridmem.reshard.layouts`: for every rank, the parts of the groups it is
    in are exactly its tensors."""
    for layout in _pairs_by_layout(case, hf_dst):
        for rank in range(layout.world_size):
            merged = {}
            for part in layout.part_groups():
                (key,) = [k for k, ranks in part.groups.items() if rank in ranks]
                part = part.build(key)
                assert not set(part) & set(merged), sorted(set(part) & set(merged))
                merged.update(part)
            assert merged == layout.tensors(rank), (layout, rank)


def test_a_share_answers_only_for_its_rank():
    spec = ModelSpec(family="qwen2", hidden_size=16, num_attention_heads=8, num_key_value_heads=4, head_dim=2,
                     intermediate_size=32, num_hidden_layers=2, vocab_size=100)
    share = build_plan(megatron_layout(spec, ParallelLayout(tp=2), 4),
                       vllm_layout(spec, ParallelLayout(tp=4), 4), rank=1)
    assert share.recv_nbytes(1) > 0
    with pytest.raises(ValueError, match=r"rank 1's share; build_plan\(..., rank=2\) gives rank 2's"):
        share.recv_nbytes(2)
    with pytest.raises(ValueError, match="rank=4 outside world_size=4"):
        build_plan(megatron_layout(spec, ParallelLayout(tp=2), 4),
                   vllm_layout(spec, ParallelLayout(tp=4), 4), rank=4)
