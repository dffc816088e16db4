"""MiniMax-M2 (and M2.1, M2.5; ``minimax_m2``): grouped-query attention with one RMSNorm over all query heads
and one over all key heads, every layer a mixture of experts (no shared expert) routed by sigmoid scores
with a correction bias.

The checkpoint names the MoE block ``block_sparse_moe``, an expert's projections ``w1`` (gate), ``w3`` (up)
and ``w2`` (down), and the router bias ``block_sparse_moe.e_score_correction_bias``; vLLM keeps those
names. transformers' modules call the block ``mlp`` with fused experts (the canonical names) and hold the
bias as a buffer of the block, ``mlp.e_score_correction_bias``. ``q_norm`` / ``k_norm`` weigh
``num_attention_heads * head_dim`` / ``num_key_value_heads * head_dim`` and vLLM splits them by heads under
TP. The config's ``intermediate_size`` is one expert's width; partial RoPE (``rotary_dim``) changes no
tensor. The multi-token-prediction modules (``num_mtp_modules``) are built by neither transformers nor
vLLM's main model and are not synced.
"""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import gqa_fields, moe_fields
from hybridmem.models.family import ConfigGetter, Family, RouterBias


def read_config(get: ConfigGetter) -> dict[str, Any]:
    if get("attention_bias", False):
        raise ValueError("attention_bias=True is not supported for minimax_m2 (transformers' MiniMax-M2 has "
                         "no attention biases)")
    if not get("use_routing_bias", False):
        # transformers always holds the bias (and writes it); vLLM builds it only with use_routing_bias.
        raise ValueError(f"use_routing_bias={get('use_routing_bias')!r} is not supported for minimax_m2; "
                         f"expected True, as MiniMax-M2 ships (vLLM otherwise has no place for the router's "
                         f"correction bias that transformers' checkpoints hold)")
    if get("tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings=True is not supported for minimax_m2 (vLLM's "
                         "MiniMaxM2ForCausalLM always has its own lm_head)")
    fields = gqa_fields(get, qkv_bias=False, qk_norm=True)
    fields.update(moe_fields(get, experts_keys=("num_local_experts",), expert_width_key="intermediate_size"))
    fields["intermediate_size"] = 0  # no dense MLP
    return fields


MINIMAX_M2 = Family(
    name="minimax_m2",
    architectures=("MiniMaxM2ForCausalLM",),
    read_config=read_config,
    moe=True,
    router_bias=RouterBias.ALWAYS,
    qk_norm_all_heads=True,
    checkpoint_renames=(
        (r"^mlp\.gate\.e_score_correction_bias$", "block_sparse_moe.e_score_correction_bias"),
        (r"^mlp\.gate\.", "block_sparse_moe.gate."),
        (r"^mlp\.experts\.(\d+)\.gate_proj\.", r"block_sparse_moe.experts.\1.w1."),
        (r"^mlp\.experts\.(\d+)\.up_proj\.", r"block_sparse_moe.experts.\1.w3."),
        (r"^mlp\.experts\.(\d+)\.down_proj\.", r"block_sparse_moe.experts.\1.w2."),
    ),
    module_renames=((r"^mlp\.gate\.e_score_correction_bias$", "mlp.e_score_correction_bias"),),
    vllm_renames=(
        (r"^mlp\.gate\.e_score_correction_bias$", "block_sparse_moe.e_score_correction_bias"),
        (r"^mlp\.(gate|experts)\.", r"block_sparse_moe.\1."),
    ),
    megatron="megatron-core's q/k layernorm normalizes each head over head_dim; MiniMax-M2's q_norm and "
             "k_norm normalize all heads together (weights of num_heads * head_dim)",
    embedded_engine="MiniMax-M2's mixture of experts and its q/k norms over all heads are no blocks of the "
                    "embedded engine",
)
