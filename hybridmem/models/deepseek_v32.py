"""DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``): DeepSeek sparse attention, DeepSeek-V3's
multi-latent attention and MoE (:mod:`hybridmem.models.deepseek_v3`) with a lightning indexer in every layer's
attention (``self_attn.indexer.*``: ``wq_b``, ``wk``, a LayerNorm ``k_norm`` with a bias, ``weights_proj``).

GLM-5's configs can let a layer reuse the previous layer's top-k tokens (``indexer_types`` ``"shared"``, from
``index_topk_freq`` or ``index_topk_pattern``): such a layer has no indexer in transformers' and vLLM's
models. The layout tables give every layer one, so those configs are refused by name.
"""

from __future__ import annotations

from typing import Any

from hybridmem.models.deepseek_v3 import read_config as _read_deepseek_v3
from hybridmem.models.family import ConfigGetter, Family, RouterBias


def _read_config(get: ConfigGetter, name: str) -> dict[str, Any]:
    fields = _read_deepseek_v3(get)
    if not fields["q_lora_rank"]:
        raise ValueError(f"q_lora_rank={get('q_lora_rank')!r} is not supported for {name} (the indexer's "
                         f"wq_b projects the query latent: expected a positive rank)")
    layers = fields["num_hidden_layers"]
    shared = [i for i, t in enumerate(get("indexer_types") or ()) if t != "full"]
    pattern = get("index_topk_pattern")
    if pattern is not None:
        shared += [i for i, c in enumerate(pattern) if c not in ("F", "full")]
    freq = get("index_topk_freq", 1) or 1
    if shared or freq != 1:
        raise ValueError(f"{name} layers {sorted(set(shared))} (index_topk_freq={freq}) reuse another "
                         f"layer's top-k tokens and have no indexer; not supported (expected every layer "
                         f"'full')")
    dense = fields["first_k_dense_replace"]
    expected = ["dense"] * min(dense, layers) + ["sparse"] * max(layers - dense, 0)
    mlp_types = get("mlp_layer_types")
    if mlp_types is not None and list(mlp_types) != expected:
        raise ValueError(f"mlp_layer_types={list(mlp_types)} is not supported for {name}; expected the first "
                         f"first_k_dense_replace={dense} layers dense and the rest sparse, "
                         f"as vLLM places them")
    fields["index_n_heads"] = int(get("index_n_heads"))
    fields["index_head_dim"] = int(get("index_head_dim"))
    return fields


def read_deepseek_v32(get: ConfigGetter) -> dict[str, Any]:
    """DeepSeek-V3.2's config: DeepSeek-V3's keys plus ``index_n_heads`` and ``index_head_dim``."""
    return _read_config(get, "deepseek_v32")


def read_glm_moe_dsa(get: ConfigGetter) -> dict[str, Any]:
    """GLM-5's config: as DeepSeek-V3.2's (refusing layers without an indexer)."""
    return _read_config(get, "glm_moe_dsa")


_MEGATRON = "megatron-core has no DeepSeek sparse attention indexer (self_attn.indexer.*)"
_ENGINE = ("DeepSeek sparse attention: MLA with a top-k token indexer, which the embedded engine has no "
           "block for")

DEEPSEEK_V32 = Family(name="deepseek_v32", architectures=("DeepseekV32ForCausalLM",),
                      read_config=read_deepseek_v32, moe=True, mla=True, sparse_attention_indexer=True,
                      router_bias=RouterBias.NOAUX_TC, shared_expert="shared_experts", megatron=_MEGATRON,
                      embedded_engine=_ENGINE)
GLM_MOE_DSA = Family(name="glm_moe_dsa", architectures=("GlmMoeDsaForCausalLM",),
                     read_config=read_glm_moe_dsa, moe=True, mla=True, sparse_attention_indexer=True,
                     router_bias=RouterBias.NOAUX_TC, shared_expert="shared_experts", megatron=_MEGATRON,
                     embedded_engine=_ENGINE)
