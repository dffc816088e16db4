"""IBM Granite 3 (dense, ``granite``): Llama's tensors; its embedding, residual, attention and logits
multipliers scale activations at run time and change no weight; ``attention_bias`` and ``mlp_bias`` give
the same biases as Llama's."""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import llama_bias_fields
from hybridmem.models.family import ConfigGetter, Family


def read_config(get: ConfigGetter) -> dict[str, Any]:
    return llama_bias_fields(get)


GRANITE = Family(name="granite", architectures=("GraniteForCausalLM",), read_config=read_config,
                 embedded_engine="Granite's embedding, residual, attention and logits multipliers are not "
                                 "part of the embedded engine's blocks")
