"""DeepSeek-V3 (and R1): multi-latent attention; the first ``first_k_dense_replace`` layers dense, the rest
MoE with shared experts and a routing-score correction bias (``moe_layer_freq`` 1, as DeepSeek-V3 ships;
no multi-token-prediction layers)."""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import require
from hybridmem.models.family import ConfigGetter, Family, RouterBias


def read_config(get: ConfigGetter) -> dict[str, Any]:
    require(get, "hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
    if get("attention_bias", False):
        raise ValueError("attention_bias=True is not supported for deepseek_v3 (DeepSeek-V3 has none)")
    if get("rope_interleave", True) is False:
        # HF then rotates halves while Megatron's MLA and vLLM rotate pairs: the rope rows would need a
        # permutation, which the layout tables do not apply.
        raise ValueError("rope_interleave=False is not supported for deepseek_v3 (expected True, its default)")
    freq = get("moe_layer_freq", 1) or 1
    if freq != 1:
        raise ValueError(f"moe_layer_freq={freq} is not supported; expected 1 (every layer after "
                         f"first_k_dense_replace is MoE)")
    heads = int(get("num_attention_heads"))
    nope, rope = int(get("qk_nope_head_dim")), int(get("qk_rope_head_dim"))
    moe = int(get("moe_intermediate_size"))
    return dict(
        hidden_size=int(get("hidden_size")),
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=nope + rope,
        intermediate_size=int(get("intermediate_size") or 0),
        num_hidden_layers=int(get("num_hidden_layers")),
        vocab_size=int(get("vocab_size")),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        num_experts=int(get("n_routed_experts")),
        moe_intermediate_size=moe,
        shared_expert_intermediate_size=moe * int(get("n_shared_experts", 0) or 0),
        first_k_dense_replace=int(get("first_k_dense_replace", 0) or 0),
        q_lora_rank=int(get("q_lora_rank") or 0),
        kv_lora_rank=int(get("kv_lora_rank")),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(get("v_head_dim")),
        topk_method=get("topk_method"),
    )


DEEPSEEK_V3 = Family(name="deepseek_v3", architectures=("DeepseekV3ForCausalLM",), read_config=read_config,
                     moe=True, mla=True, router_bias=RouterBias.NOAUX_TC, shared_expert="shared_experts")
