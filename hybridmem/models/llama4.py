"""Llama 4 text (``llama4_text``: the language model of Scout and Maverick): grouped-query attention (a RoPE
layer's q/k L2 norm and a NoPE layer's attention temperature have no weights), every
``interleave_moe_layer_step``-th layer a mixture of experts with one shared expert and a sigmoid router, the
other layers dense of ``intermediate_size_mlp``.

The checkpoint (and transformers' modules) call the MLP ``feed_forward``, the router ``feed_forward.router``
and stack the routed experts transposed: ``feed_forward.experts.gate_up_proj`` [E, H, 2I] (gate then up
columns) and ``feed_forward.experts.down_proj`` [E, I, H]; the shared expert is ``feed_forward.shared_expert``
of the experts' width ``intermediate_size``. vLLM keeps ``feed_forward`` and its loader reorders each q and k
head's rows from interleaved rotary pairs to halves (it rotates halves where the checkpoint rotates pairs).

The Hub's checkpoints are multimodal (``llama4``): the text config nested as ``text_config``, the text weights
under ``language_model.`` (``language_model.model.layers.*``, ``language_model.lm_head.weight``, as
transformers' ``Llama4ForConditionalGeneration`` saves them too); such a config gives the text model's spec,
and transformers' causal LM of such a checkpoint is the text model with the names above.
"""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import gqa_fields, moe_fields
from hybridmem.models.family import ConfigGetter, Family


def read_config(get: ConfigGetter) -> dict[str, Any]:
    if get("attention_bias", False):
        raise ValueError("attention_bias=True is not supported for llama4_text (vLLM's Llama 4 builds no "
                         "attention biases)")
    step = int(get("interleave_moe_layer_step", 1) or 1)
    fields = gqa_fields(get, qkv_bias=False)
    layers = fields["num_hidden_layers"]
    moe_layers = get("moe_layers")
    expected = list(range(step - 1, layers, step))
    if moe_layers is not None and list(moe_layers) != expected:
        # vLLM places MoE layers by interleave_moe_layer_step alone.
        raise ValueError(f"moe_layers={list(moe_layers)} is not supported for llama4_text; expected every "
                         f"interleave_moe_layer_step={step}-th layer, {expected}, "
                         f"where vLLM's Llama 4 puts them")
    width = int(get("intermediate_size"))
    fields.update(moe_fields(get, experts_keys=("num_local_experts",), expert_width_key="intermediate_size",
                             shared_width=width))
    fields["intermediate_size"] = int(get("intermediate_size_mlp") or 0) if step > 1 else 0
    fields["moe_layer_step"] = step
    return fields


LLAMA4 = Family(
    name="llama4_text",
    architectures=("Llama4ForCausalLM",),
    read_config=read_config,
    moe=True,
    shared_expert="shared_expert",
    checkpoint_renames=((r"^mlp\.gate\.", "feed_forward.router."), (r"^mlp\.", "feed_forward.")),
    checkpoint_stacked=(
        (r"mlp\.experts\.(\d+)\.gate_proj\.weight", "feed_forward.experts.gate_up_proj", True),
        (r"mlp\.experts\.(\d+)\.up_proj\.weight", "feed_forward.experts.gate_up_proj", True),
        (r"mlp\.experts\.(\d+)\.down_proj\.weight", "feed_forward.experts.down_proj", True),
    ),
    module_names="checkpoint",
    vllm_renames=((r"^mlp\.gate\.", "feed_forward.router."), (r"^mlp\.", "feed_forward.")),
    vllm_rotary_permute=True,
    multimodal_types=("llama4",),
    megatron="hybridmem's Megatron names do not cover Llama 4's interleaved dense and MoE layers, and its "
             "rotary pairs are interleaved where megatron-core rotates halves",
    embedded_engine="Llama 4's mixture of experts, NoPE layers with attention temperature and q/k L2 norms "
                    "are no blocks of the embedded engine",
)
