"""DeepSeek-V3 (and R1): multi-latent attention; the first ``first_k_dense_replace`` layers dense, the rest
MoE with shared experts and a routing-score correction bias (``moe_layer_freq`` 1, as DeepSeek-V3 ships;
no multi-token-prediction layers).

Kimi-K2.5 (``kimi_k25``) is this text model inside a multimodal config (``text_config``, whose ``model_type``
the Hub's config calls ``kimi_k2``) with a vision tower and projector. Its checkpoint keeps the text model
under ``language_model.`` (``language_model.model.layers.*``, ``language_model.lm_head.weight``); vLLM's
``KimiK25ForConditionalGeneration`` builds DeepSeek-V3's text model under ``language_model.`` and loads those
names as they are; transformers 5.19's ``Kimi_K25ForConditionalGeneration`` names its modules
``model.language_model.*`` and ``lm_head.weight``. Only the text model is synced: the vision tower and the
projector are no part of the spec."""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import require
from hybridmem.models.family import ConfigGetter, Family, RouterBias, TextModelNames


def read_config(get: ConfigGetter) -> dict[str, Any]:
    require(get, "hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
    if get("attention_bias", False):
        raise ValueError("attention_bias=True is not supported for deepseek_v3 (DeepSeek-V3 has none)")
    if get("rope_interleave", True) is False:
        # HF then rotates halves while Megatron's MLA and vLLM rotate pairs: the rope rows would need a
        # permutation, which the layout tables do not apply.
        raise ValueError("rope_interleave=False is not supported for deepseek_v3 (expected True, its "
                         "default)")
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


KIMI_K25_NAMES = TextModelNames(
    checkpoint=(("", "language_model."),),
    vllm=(("", "language_model."),),
    modules=(("model.", "model.language_model."),),
    vllm_not_synced=("vision_tower.", "mm_projector."),
)
"""Kimi-K2.5's names of the text model's tensors."""

DEEPSEEK_V3 = Family(name="deepseek_v3", architectures=("DeepseekV3ForCausalLM",), read_config=read_config,
                     multimodal_types=("kimi_k25",), multimodal_names=(("kimi_k25", KIMI_K25_NAMES),),
                     moe=True, mla=True, router_bias=RouterBias.NOAUX_TC, shared_expert="shared_experts")
