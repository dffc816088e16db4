"""Baidu's Ernie 4.5 dense models (``ernie4_5``, ERNIE-4.5-0.3B): Llama's tensors and names. Its RoPE rotates
interleaved pairs of each head's dimensions, which transformers and vLLM (whose ``Ernie4_5ForCausalLM`` is its
Llama with non-NeoX rotary) apply to the stored rows as they are: no tensor is reordered. ``use_bias`` (biases
on every projection in transformers) is refused: vLLM's model builds none."""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import gqa_fields
from hybridmem.models.family import ConfigGetter, Family


def read_config(get: ConfigGetter) -> dict[str, Any]:
    if get("use_bias", False):
        raise ValueError(f"use_bias={get('use_bias')!r} is not supported for ernie4_5 (vLLM's "
                         "Ernie4_5ForCausalLM builds no projection biases, so the checkpoint's would have "
                         "nowhere to go)")
    return gqa_fields(get, qkv_bias=False)


ERNIE4_5 = Family(name="ernie4_5", architectures=("Ernie4_5ForCausalLM",), read_config=read_config,
                  embedded_engine="Ernie 4.5 rotates interleaved pairs, the embedded engine's blocks rotate "
                                  "halves")
