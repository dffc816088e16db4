"""Shard specs, names and layouts read from real Megatron models (TP2 and EP2 against TP1/EP1).

With ``use_cpu_initialization`` Megatron draws every full weight from the CPU generator and slices it,
so the same seed gives the same full weights at any TP size: concatenating the TP2 shards along each
spec's ``partition_dim`` in ``shard_index`` order must give the TP1 tensor bitwise.
"""

from __future__ import annotations

import _megatron_tasks as tasks
import pytest
import torch

from hybridmem.testing.megatron_models import TinyGPTSpec

pytestmark = pytest.mark.megatron

DENSE = dict(num_layers=2)
MOE = dict(num_layers=2, num_moe_experts=4, moe_ffn_hidden_size=32)


@pytest.fixture(scope="module")
def collected(megatron_pools):
    out = {}
    pool = megatron_pools.get(1)
    out["tp1"] = pool.run(tasks.collect_weights, TinyGPTSpec(**DENSE))
    out["ep1"] = pool.run(tasks.collect_weights, TinyGPTSpec(**MOE))
    pool = megatron_pools.get(2)
    out["tp2"] = pool.run(tasks.collect_weights, TinyGPTSpec(tp=2, **DENSE))
    out["ep2"] = pool.run(tasks.collect_weights, TinyGPTSpec(ep=2, **MOE))
    return out


def _assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Full tensors by global name, from each rank's weights and specs (no knowledge of Megatron)."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    specs = {}
    for rank in per_rank:
        for name, t in rank["weights"].items():
            spec = rank["specs"][name]
            specs[spec.global_name] = spec
            pieces.setdefault(spec.global_name, {})
            if spec.partition_dim is None:
                if 0 in pieces[spec.global_name]:
                    assert torch.equal(pieces[spec.global_name][0], t), (
                        f"replicated {name} differs across ranks")
                pieces[spec.global_name][0] = t
            else:
                pieces[spec.global_name][spec.shard_index] = t
    full = {}
    for gname, by_index in pieces.items():
        spec = specs[gname]
        assert sorted(by_index) == list(range(spec.num_shards)), (gname, sorted(by_index))
        parts = [by_index[i] for i in range(spec.num_shards)]
        if spec.fused == "gate_up" and spec.partition_dim is not None:
            # Each shard is [gate_r; up_r]: the full tensor is [gate_0; gate_1; ...; up_0; up_1; ...].
            halves = [p.chunk(2, dim=spec.partition_dim) for p in parts]
            full[gname] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=spec.partition_dim)
        elif spec.partition_dim is None:
            full[gname] = parts[0]
        else:
            full[gname] = torch.cat(parts, dim=spec.partition_dim)
        assert tuple(full[gname].shape) == spec.global_shape, (gname, full[gname].shape, spec.global_shape)
    return full


def test_names_have_no_ddp_prefix(collected):
    names = list(collected["tp2"][0]["weights"])
    assert names and not any(n.startswith("module.") for n in names), names
    assert "embedding.word_embeddings.weight" in names and "output_layer.weight" in names
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in names


def test_tp2_shards_reassemble_to_tp1_weights(collected):
    reference = collected["tp1"][0]["weights"]
    full = _assemble(collected["tp2"])
    assert full.keys() == reference.keys()
    for name, t in reference.items():
        assert torch.equal(full[name], t), name


def test_tp2_specs_follow_megatron_attributes(collected):
    specs = collected["tp2"][1]["specs"]
    qkv = specs["decoder.layers.0.self_attention.linear_qkv.weight"]
    # (heads + 2 * groups) * head_dim rows, split over TP on dim 0; head_dim = 32 / 4 = 8.
    assert (qkv.partition_dim, qkv.num_shards, qkv.shard_index, qkv.fused) == (0, 2, 1, "qkv")
    assert qkv.global_shape == ((4 + 2 * 2) * 8, 32) and qkv.local_shape == ((4 + 2 * 2) * 8 // 2, 32)
    proj = specs["decoder.layers.0.self_attention.linear_proj.weight"]
    assert (proj.partition_dim, proj.global_shape) == (1, (32, 32))
    fc1 = specs["decoder.layers.0.mlp.linear_fc1.weight"]
    assert (fc1.partition_dim, fc1.global_shape, fc1.fused) == (0, (2 * 64, 32), "gate_up")
    norm = specs["decoder.layers.0.input_layernorm.weight"]
    assert (norm.partition_dim, norm.num_shards, norm.is_expert) == (None, 1, False)
    emb = specs["embedding.word_embeddings.weight"]
    assert (emb.partition_dim, emb.global_shape) == (0, (64, 32))
    assert {s.layer_index for s in specs.values() if s.layer_index is not None} == {0, 1}


def test_ep2_experts_get_global_indices(collected):
    per_rank = collected["ep2"]
    expert_names = {}
    for rank, out in enumerate(per_rank):
        for name, spec in out["specs"].items():
            if spec.is_expert:
                assert ".experts.local_experts." in name, name
                expert_names.setdefault(spec.global_name, []).append((rank, spec.expert_index))
    # 4 experts x 2 layers x (fc1, fc2), each held by exactly one rank, 2 experts per rank.
    assert len(expert_names) == 4 * 2 * 2
    assert all(len(v) == 1 for v in expert_names.values()), expert_names
    for (rank, index) in (v[0] for v in expert_names.values()):
        assert index // 2 == rank, (rank, index)
    full, reference = _assemble(per_rank), collected["ep1"][0]["weights"]
    assert full.keys() == reference.keys()
    # Each EP rank draws only its own experts from the generator, so everything drawn after the first
    # expert differs from EP1's values; what is drawn before (embedding, layer 0 attention) must not.
    drawn_before_experts = [n for n in reference
                            if n.startswith(("embedding.", "decoder.layers.0.self_attention."))]
    assert len(drawn_before_experts) == 3
    for name, t in reference.items():
        assert full[name].shape == t.shape, name
    for name in drawn_before_experts:
        assert torch.equal(full[name], reference[name]), name


def test_source_layout(collected):
    layouts = [r["layout"] for r in collected["tp2"]]
    assert [(x.tp, x.pp, x.ep, x.dp, x.tp_rank, x.pp_rank, x.ep_rank) for x in layouts] == [
        (2, 1, 1, 1, 0, 0, 0),
        (2, 1, 1, 1, 1, 0, 0),
    ]
    layouts = [r["layout"] for r in collected["ep2"]]
    assert [(x.tp, x.ep, x.dp, x.ep_rank) for x in layouts] == [(1, 2, 2, 0), (1, 2, 2, 1)]


def test_model_spec_dict(collected):
    dense = collected["tp2"][0]["model_spec"]
    assert dense == {
        "model_type": "llama",
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "vocab_size": 64,
        "tie_word_embeddings": False,
        "rms_norm_eps": dense["rms_norm_eps"],
        "attention_bias": False,
        "qkv_bias": False,
    }
    moe = collected["ep2"][0]["model_spec"]
    assert (moe["model_type"], moe["num_experts"], moe["moe_intermediate_size"],
            moe["num_experts_per_tok"]) == ("qwen2_moe", 4, 32, 2)
    try:
        from hybridmem.reshard.spec import ModelSpec
    except ImportError:
        return  # the reshard package is not on this branch
    for d in (dense, moe):
        ModelSpec.from_hf_config(d)
