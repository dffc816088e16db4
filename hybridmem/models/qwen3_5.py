"""Qwen3.5: a hybrid of gated delta-net (linear attention) layers and full attention layers; dense
(``qwen3_5_text``, every layer a dense MLP) or MoE (``qwen3_5_moe_text``, every layer routed experts and a
sigmoid-gated shared expert, as Qwen2-MoE's; transformers' modules fuse the experts, the checkpoint holds
them one by one).

``layer_types`` says which layer is which (by default every fourth layer is full attention). A full
attention layer is Qwen3's (q/k norms over one head) with an output gate: ``self_attn.q_proj`` holds
``[q_h; gate_h]`` per head, ``2 * num_attention_heads * head_dim`` rows. A gated delta-net layer holds
``linear_attn.in_proj_qkv`` ([q; k; v] rows: key, key and value widths), ``in_proj_z`` (value width),
``in_proj_b`` and ``in_proj_a`` (a row per value head), a depthwise ``conv1d`` over [q; k; v]
([rows, 1, kernel]), ``A_log`` and ``dt_bias`` (per value head), a gated RMSNorm over one value head
(``norm``) and ``out_proj``. Canonically [q; k; v] of ``in_proj_qkv`` and of ``conv1d`` are three tensors
each (``linear_attn.in_proj_q.weight``, ``linear_attn.conv1d_q.weight``, ...), stored fused.

vLLM (0.32 and 0.33 alike) fuses ``in_proj_qkvz`` and ``in_proj_ba``; each TP rank holds its share of the
rows of every part in turn (``[q_r; k_r; v_r; z_r]``, ``[b_r; a_r]``), the convolution ``[q_r; k_r; v_r]``
too; ``A_log`` and ``dt_bias`` are split by value heads, ``out_proj`` by columns. It builds the token
embedding on every pipeline stage, the final norm and the head on the last.
"""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import gqa_fields, moe_fields, require
from hybridmem.models.family import ConfigGetter, Family

_LAYER_TYPES = ("linear_attention", "full_attention")


def linear_attention_fields(get: ConfigGetter) -> dict[str, Any]:
    """ModelSpec fields of Qwen3.5's gated delta-net layers: which layers they are (``layer_types``, else
    every layer but each ``full_attention_interval``-th) and their sizes."""
    require(get, "num_hidden_layers", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim")
    layers = int(get("num_hidden_layers"))
    types = get("layer_types")
    if types is None:
        interval = int(get("full_attention_interval", 4) or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    types = list(types)
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown or len(types) != layers:
        raise ValueError(f"layer_types={types} must give one of {list(_LAYER_TYPES)} for each of the "
                         f"num_hidden_layers={layers} layers")
    return dict(
        linear_attention_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        linear_num_key_heads=int(get("linear_num_key_heads")),
        linear_num_value_heads=int(get("linear_num_value_heads")),
        linear_key_head_dim=int(get("linear_key_head_dim")),
        linear_value_head_dim=int(get("linear_value_head_dim")),
        linear_conv_kernel_dim=int(get("linear_conv_kernel_dim")),
    )


def read_config(get: ConfigGetter) -> dict[str, Any]:
    if get("attention_bias", False):
        # transformers would bias q/k/v and o; vLLM's Qwen3.5 builds no o_proj bias and reads no q/k/v bias.
        raise ValueError("attention_bias=True is not supported for Qwen3.5 (its checkpoints have no "
                         "attention biases and vLLM's Qwen3.5 builds none)")
    if get("layer_scale", False):
        raise ValueError("layer_scale=True is not supported for Qwen3.5 (transformers' Qwen3.5 has no layer "
                         "scales)")
    return {**gqa_fields(get, qkv_bias=False, qk_norm=True), **linear_attention_fields(get)}


_CHECKPOINT_FUSED = (
    (tuple(f"linear_attn.in_proj_{x}.weight" for x in "qkv"), "linear_attn.in_proj_qkv.weight"),
    (tuple(f"linear_attn.conv1d_{x}.weight" for x in "qkv"), "linear_attn.conv1d.weight"),
)
_MEGATRON = ("megatron-core's GPTModel has no gated delta-net (linear attention) layers and no attention "
             "output gate")
_EMBEDDED = ("gated delta-net (linear attention) layers and gated attention are no blocks of the embedded "
             "engine")

QWEN3_5 = Family(
    name="qwen3_5_text",
    multimodal_types=("qwen3_5",),
    architectures=("Qwen3_5ForCausalLM",),
    read_config=read_config,
    attention_output_gate=True,
    checkpoint_fused=_CHECKPOINT_FUSED,
    module_names="checkpoint",
    vllm_embedding_every_stage=True,
    megatron=_MEGATRON,
    embedded_engine=_EMBEDDED,
)


def read_moe_config(get: ConfigGetter) -> dict[str, Any]:
    fields = read_config(get)
    fields.update(moe_fields(get, experts_keys=("num_experts", "num_local_experts"),
                             shared_width=get("shared_expert_intermediate_size", 0) or 0))
    fields["intermediate_size"] = 0  # every layer MoE
    return fields


QWEN3_5_MOE = Family(
    name="qwen3_5_moe_text",
    multimodal_types=("qwen3_5_moe",),
    architectures=("Qwen3_5MoeForCausalLM",),
    read_config=read_moe_config,
    moe=True,
    shared_expert="shared_expert",
    shared_expert_gate=True,
    attention_output_gate=True,
    checkpoint_fused=_CHECKPOINT_FUSED,
    vllm_embedding_every_stage=True,
    megatron=_MEGATRON,
    embedded_engine=_EMBEDDED,
)
