"""Gemma 3 (text, ``gemma3_text``: the 1B model, and the language model of the larger ones trained alone):
q/k norms, a norm before and after the MLP besides the usual two, tied embeddings by default."""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import gqa_fields
from hybridmem.models.family import ConfigGetter, Family


def read_config(get: ConfigGetter) -> dict[str, Any]:
    fields = gqa_fields(get, qkv_bias=bool(get("attention_bias", False)), qk_norm=True)
    fields["tie_word_embeddings"] = bool(get("tie_word_embeddings", True))
    return fields


GEMMA3 = Family(
    name="gemma3_text",
    architectures=("Gemma3ForCausalLM",),
    read_config=read_config,
    extra_norms=("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"),
    vllm_every_stage=True,
    embedded_engine="Gemma 3's sandwich norms, (1 + weight) RMSNorm, scaled embeddings and sliding-window "
                    "layers are no blocks of the embedded engine",
    megatron="megatron-core 0.16.1's TransformerLayer has no norm after attention and after the MLP "
             "(Gemma 3's post_attention_layernorm and post_feedforward_layernorm)",
)
