"""IBM Granite 3 (dense, ``granite``): Llama's tensors; its embedding, residual, attention and logits
multipliers scale activations at run time and change no weight."""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import gqa_fields
from hybridmem.models.family import ConfigGetter, Family


def read_config(get: ConfigGetter) -> dict[str, Any]:
    return gqa_fields(get, qkv_bias=bool(get("attention_bias", False)))


GRANITE = Family(name="granite", architectures=("GraniteForCausalLM",), read_config=read_config,
                 embedded_engine="Granite's embedding, residual, attention and logits multipliers are not "
                                 "part of the embedded engine's blocks")
