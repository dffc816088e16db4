"""Gemma 4 (text, ``gemma4_text``): Gemma 3's sandwich norms and q/k norms, full-attention layers with a head
width and kv heads of their own between sliding ones (``global_head_dim``, ``num_global_key_value_heads``),
where ``attention_k_eq_v`` the full layers' values are their keys (no ``v_proj``), and a ``layer_scalar`` per
layer. Tied embeddings by default.

With ``enable_moe_block`` (the 26B-A4B model) every layer has routed experts beside its dense MLP: a router
(``router.proj``, an input ``scale`` and a ``per_expert_scale``), experts stacked over experts in the
checkpoint (``experts.gate_up_proj`` [E, 2I, H] with each expert's gate rows then up rows,
``experts.down_proj`` [E, H, I]), and three more norms.

The Hub's checkpoints are multimodal (``gemma4``, transformers' ``Gemma4ForConditionalGeneration``): the text
config nested as ``text_config``, the text weights under ``model.language_model.*`` beside the vision (and
audio) towers and their projections (``model.vision_tower.*``, ``model.embed_vision.*``,
``model.audio_tower.*``, ``model.embed_audio.*``), which are not synced. Such a config gives the text model's
spec marked ``gemma4`` (``ModelSpec.multimodal``): its checkpoint and vLLM names are the text model's (vLLM's
``Gemma4ForCausalLM`` reads the multimodal checkpoint, dropping ``model.language_model.``'s
``language_model.`` and the towers), and its module names are the multimodal class's
(``model.language_model.*``, ``lm_head.weight``), the class transformers builds of such a checkpoint (its
``Gemma4ForCausalLM`` does not read one).

With ``hidden_size_per_layer_input`` P > 0 (transformers' default, 256, as in the E2B/E4B models) the model
has per-layer input embeddings (``Family.per_layer_inputs``): ``embed_tokens_per_layer``
[``vocab_size_per_layer_input``, L * P], its ``per_layer_model_projection`` and ``per_layer_projection_norm``,
and in every layer a ``per_layer_input_gate``, a ``per_layer_projection`` and a ``post_per_layer_input_norm``.

Not read: layers sharing another layer's keys and values (``num_kv_shared_layers``, the E2B/E4B models, and
with it ``use_double_wide_mlp``, which widens only those layers), attention biases; each is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridmem.models.common import gqa_fields, require
from hybridmem.models.family import ConfigGetter, Family, TextModelNames

_FULL = "full_attention"


def layer_types(get: ConfigGetter) -> list[str]:
    """The config's ``layer_types``; without them transformers' default: every sixth layer and the last one
    full attention, the others sliding."""
    n = int(get("num_hidden_layers"))
    types = get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 6 else _FULL for i in range(n)]
        types[-1] = _FULL
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries; expected num_hidden_layers={n}")
    return list(types)


def _layer_override(get: ConfigGetter, layer: int, key: str) -> Any:
    """``key`` of ``per_layer_config[layer]`` as transformers >= 5.19 keeps it (an object per layer, or in a
    ``config.json`` a dict keyed by the layer as a string); ``None`` where the config has none."""
    per_layer = get("per_layer_config")
    if per_layer is None:
        return None
    if isinstance(per_layer, Mapping):
        return (per_layer.get(str(layer)) or per_layer.get(layer) or {}).get(key)
    return getattr(per_layer[layer], key, None)


def attention_fields(get: ConfigGetter, head_dim: int, kv_heads: int) -> dict[str, Any]:
    """ModelSpec fields of the full-attention layers: which they are, their head width and kv heads (from
    ``per_layer_config``, else ``global_head_dim`` and, with ``attention_k_eq_v``,
    ``num_global_key_value_heads``, as transformers reads them), and whether their values are their keys."""
    types = layer_types(get)
    full = tuple(i for i, t in enumerate(types) if t == _FULL)
    k_eq_v = bool(get("attention_k_eq_v", False))
    global_kv = get("num_global_key_value_heads") if k_eq_v else None
    default = (int(get("global_head_dim") or 512), int(global_kv or kv_heads))
    dims = set()
    for i in range(len(types)):
        hd, nkv = _layer_override(get, i, "head_dim"), _layer_override(get, i, "num_key_value_heads")
        if get("per_layer_config") is None and i in full:
            hd, nkv = default
        got = (int(hd or head_dim), int(nkv or kv_heads))
        if i in full:
            dims.add(got)
        elif got != (head_dim, kv_heads):
            raise ValueError(f"sliding layer {i} has head_dim, num_key_value_heads = {got}; expected the "
                             f"config's ({head_dim}, {kv_heads})")
    if len(dims) > 1:
        raise ValueError(f"the full-attention layers {full} differ in (head_dim, num_key_value_heads): "
                         f"{sorted(dims)}")
    full_hd, full_kv = dims.pop() if dims else (0, 0)
    return dict(full_attention_layers=full, full_attention_head_dim=full_hd, full_attention_kv_heads=full_kv,
                full_attention_k_eq_v=k_eq_v and bool(full))


def refuse_unsupported(get: ConfigGetter, family: str) -> None:
    """Raise ``ValueError`` naming a Gemma 4 feature whose tensors the layout tables do not express."""
    if get("num_kv_shared_layers", 0):
        raise ValueError(f"num_kv_shared_layers={get('num_kv_shared_layers')} is not supported for {family} "
                         f"(layers without their own keys and values); expected 0")
    if get("attention_bias", False):
        raise ValueError(f"attention_bias=True is not supported for {family} (Gemma 4 has none)")


def per_layer_input_fields(get: ConfigGetter) -> dict[str, int]:
    """ModelSpec fields of the per-layer input embeddings: their width per layer and vocabulary, with
    transformers' defaults for a key the config lacks (256 and 262144, what it builds and saves); none
    where the width is 0 or ``None`` (no such tensors, as transformers and vLLM read it)."""
    width = get("hidden_size_per_layer_input", 256) or 0
    if not width:
        return {}
    return dict(hidden_size_per_layer_input=width,
                vocab_size_per_layer_input=get("vocab_size_per_layer_input", 262_144))


def read_config(get: ConfigGetter) -> dict[str, Any]:
    require(get, "head_dim", "intermediate_size")
    refuse_unsupported(get, "gemma4_text")
    fields = gqa_fields(get, qkv_bias=False, qk_norm=True)
    if get("enable_moe_block", False):
        require(get, "num_experts", "moe_intermediate_size")
        fields.update(num_experts=int(get("num_experts")),
                      moe_intermediate_size=int(get("moe_intermediate_size")))
    fields["tie_word_embeddings"] = bool(get("tie_word_embeddings", True))
    fields.update(per_layer_input_fields(get))
    fields.update(attention_fields(get, fields["head_dim"], fields["num_key_value_heads"]))
    return fields


GEMMA4_MULTIMODAL_NAMES = TextModelNames(modules=(("model.", "model.language_model."),))
"""Gemma 4's multimodal names of the text model's tensors: transformers' ``Gemma4ForConditionalGeneration``
modules only (the checkpoint's ``model.language_model.`` is read by vLLM's text class as the text model's)."""

GEMMA4 = Family(
    name="gemma4_text",
    multimodal_types=("gemma4",),
    multimodal_names=(("gemma4", GEMMA4_MULTIMODAL_NAMES),),
    architectures=("Gemma4ForCausalLM",),
    read_config=read_config,
    extra_norms=("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"),
    layer_scalar=True,
    per_layer_inputs=True,
    moe=True,
    experts_optional=True,
    dense_mlp_with_experts=True,
    experts_fused_gate_up=True,
    router_scales=True,
    moe_norms=("pre_feedforward_layernorm_2.weight", "post_feedforward_layernorm_1.weight",
               "post_feedforward_layernorm_2.weight"),
    checkpoint_renames=(
        (r"^mlp\.gate\.weight$", "router.proj.weight"),
        (r"^mlp\.gate\.(scale|per_expert_scale)$", r"router.\1"),
    ),
    checkpoint_stacked=(
        (r"mlp\.experts\.(\d+)\.gate_up_proj\.weight", "experts.gate_up_proj", False),
        (r"mlp\.experts\.(\d+)\.down_proj\.weight", "experts.down_proj", False),
    ),
    module_names="checkpoint",
    vllm_renames=(
        (r"^mlp\.gate\.weight$", "router.proj.weight"),
        (r"^mlp\.gate\.(scale|per_expert_scale)$", r"router.\1"),
        (r"^mlp\.experts\.", "experts."),
    ),
    vllm_every_stage=True,
    embedded_engine="Gemma 4's sandwich norms, sliding and full-attention layers of different head widths, "
                    "layer scalars and per-layer input embeddings are no blocks of the embedded engine",
    megatron="megatron-core 0.16.1's TransformerLayer has no norm after attention and after the MLP "
             "(Gemma 4's post_attention_layernorm and post_feedforward_layernorm) and one head width for "
             "every layer, and its GPTModel no per-layer input embeddings (hidden_size_per_layer_input)",
)
