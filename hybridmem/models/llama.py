"""Llama, and Mistral (the same tensors; sliding-window attention changes no weight). ``attention_bias``
gives q/k/v and o a bias, ``mlp_bias`` gate/up/down (Mistral's configs have neither)."""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import llama_bias_fields
from hybridmem.models.family import ConfigGetter, Family


def read_config(get: ConfigGetter) -> dict[str, Any]:
    return llama_bias_fields(get)


LLAMA = Family(name="llama", aliases=("mistral",), architectures=("LlamaForCausalLM", "MistralForCausalLM"),
               read_config=read_config, embedded_engine=None)
