"""Llama, and Mistral (the same tensors; sliding-window attention changes no weight)."""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import gqa_fields
from hybridmem.models.family import ConfigGetter, Family


def read_config(get: ConfigGetter) -> dict[str, Any]:
    return gqa_fields(get, qkv_bias=bool(get("attention_bias", False)))


LLAMA = Family(name="llama", aliases=("mistral",), architectures=("LlamaForCausalLM", "MistralForCausalLM"),
               read_config=read_config, embedded_engine=None)
