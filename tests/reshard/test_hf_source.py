"""HF-named source layouts (replicated, FSDP2) against real transformers models and torch.chunk.

Independent references: the tensors of a real transformers model (``named_parameters()``), FSDP2's
row split re-derived with ``torch.chunk`` (what ``fully_shard`` uses), transformers' fused expert
tensors un-fused with plain indexing, and vLLM shards from ``tests/reshard/reference.py``.
"""

from __future__ import annotations

import pytest
import torch

from hybridmem.config import ParallelLayout
from hybridmem.reshard import ModelSpec, build_plan, vllm_layout
from hybridmem.reshard.hf_source import fsdp_rows, hf_source_layout, looks_hf_named
from hybridmem.reshard.transforms import build_local, piece_view
from tests.reshard.hf_reference import (
    chunk_rows,
    element_ids,
    fsdp_to_vllm_lacking,
    fused,
    unfused,
)
from tests.reshard.reference import vllm_shard
from tests.reshard.test_spec import _config

transformers = pytest.importorskip("transformers")

FAMILIES = ["llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "deepseek_v3"]


@pytest.mark.parametrize("n,shards", [(61, 4), (5, 4), (2, 4), (6, 4), (8, 4), (1, 2), (64, 1), (3, 3)])
def test_fsdp_rows_are_torch_chunk(n, shards):
    assert [fsdp_rows(n, s, shards) for s in range(shards)] == chunk_rows(n, shards)


def _model(family: str, tied: bool, seed: int = 0):
    cfg = _config(family, tied)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b))
    return cfg, model


def _module_tensors(model) -> dict[str, torch.Tensor]:
    out = {n: p.detach() for n, p in model.named_parameters()}
    out.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    return out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_local_tensors_equal_chunks_of_the_hf_model(family, tied):
    cfg, model = _model(family, tied)
    spec = ModelSpec.from_hf_config(cfg)
    module = _module_tensors(model)
    full = unfused(module)
    bias = {n for n in module if n.endswith("e_score_correction_bias")}  # a buffer: FSDP2 leaves it whole
    for shards, world in ((1, 1), (1, 2), (2, 4), (4, 4), (3, 6)):
        layout = hf_source_layout(spec, world, shard_size=shards, replicated=bias)
        for rank in range(world):
            tensors = layout.tensors(rank)
            assert sorted(tensors) == sorted(module), f"{family} rank {rank}: names differ from the HF model"
            for name, local in tensors.items():
                if name in bias or shards == 1:
                    expected = module[name]
                else:
                    lo, hi = chunk_rows(module[name].shape[0], shards)[rank % shards]
                    expected = module[name][lo:hi]
                got = build_local(local, full, dtype=expected.dtype)
                assert torch.equal(got, expected), f"{family} {name} shard {rank % shards}/{shards}"


@pytest.mark.parametrize("family,tied,tp", [("qwen2", False, 4), ("llama", True, 2), ("qwen3_moe", False, 2),
                                            ("qwen2_moe", True, 2), ("deepseek_v3", False, 2),
                                            ("qwen3", True, 1)])
def test_fsdp_to_vllm_plan_moves_exactly_what_each_rank_lacks(family, tied, tp):
    cfg, model = _model(family, tied)
    spec = ModelSpec.from_hf_config(cfg)
    world = 4
    names = list(_module_tensors(model))
    bias = {n for n in names if n.endswith("e_score_correction_bias")}
    src = hf_source_layout(spec, world, shard_size=world, replicated=bias)
    dst = vllm_layout(spec, ParallelLayout(tp=tp), world)
    plan = build_plan(src, dst, itemsize=8, bucket_nbytes=4096)
    lacking = fsdp_to_vllm_lacking(spec, names, world=world, shards=world, tp=tp, replicated=bias)
    for rank in range(world):
        assert plan.min_recv_nbytes(rank) == plan.recv_nbytes(rank) == 8 * lacking[rank], (
            f"{family} TP{tp} rank {rank}: plan {plan.recv_nbytes(rank)} B, independent minimum "
            f"{8 * lacking[rank]} B")
    ids = element_ids(spec.full_shapes())
    module_ids = fused(ids, names)
    # Running the plan in one process over the ranks' local tensors gives the reference vLLM shards.
    local = [{n: (t if n in bias else (t.chunk(world)[r] if r < len(t.chunk(world)) else t[:0]))
              for n, t in module_ids.items()} for r in range(world)]
    out = [{n: torch.zeros(lt.shape, dtype=torch.float64) for n, lt in dst.tensors(r).items()}
           for r in range(world)]
    for transfers in (*plan.local, *plan.buckets):
        for t in transfers:
            piece_view(out[t.dst_rank][t.dst_name], t.dst_piece, t.box).copy_(
                piece_view(local[t.src_rank][t.src_name], t.src_piece, t.box))
    for rank in range(world):
        want = vllm_shard(ids, spec, tp=tp, pp=1, ep=1, world=world, rank=rank)
        assert sorted(out[rank]) == sorted(want)
        for name in want:
            assert torch.equal(out[rank][name], want[name]), f"{family} TP{tp} rank {rank} {name}"


def test_replicated_source_needs_no_bytes():
    cfg, _ = _model("qwen2", False)
    spec = ModelSpec.from_hf_config(cfg)
    plan = build_plan(hf_source_layout(spec, 4), vllm_layout(spec, ParallelLayout(tp=2), 4), itemsize=2)
    assert [plan.recv_nbytes(r) for r in range(4)] == [0, 0, 0, 0]
    assert not plan.buckets


def test_bad_arguments_are_named():
    cfg, _ = _model("qwen2", False)
    spec = ModelSpec.from_hf_config(cfg)
    with pytest.raises(ValueError, match="shard_size=3 must be >= 1 and divide world_size=4"):
        hf_source_layout(spec, 4, shard_size=3)
    with pytest.raises(ValueError, match=r"replicated names \['model.nope'\]"):
        hf_source_layout(spec, 4, shard_size=4, replicated=["model.nope"])
    assert looks_hf_named(["model.embed_tokens.weight", "model.norm.weight"])
    assert not looks_hf_named(["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"])


@pytest.mark.parametrize("family", ["qwen3_moe", "llama"])
def test_fsdp_to_full_hf_tensors_for_load_weights_engines(family):
    """Engines that only take ``load_weights`` get full HF tensors: each rank lacks all but its own rows."""
    from hybridmem.reshard import hf_layout

    cfg, model = _model(family, True)
    spec = ModelSpec.from_hf_config(cfg)
    module = _module_tensors(model)
    plan = build_plan(hf_source_layout(spec, 4, shard_size=4), hf_layout(spec, ParallelLayout(tp=2), 4),
                      itemsize=4, bucket_nbytes=1 << 20)
    total = sum(t.numel() for t in module.values())
    for rank in range(4):
        held = sum(t[slice(*chunk_rows(t.shape[0], 4)[rank])].numel() for t in module.values())
        assert plan.recv_nbytes(rank) == plan.min_recv_nbytes(rank) == 4 * (total - held), rank
