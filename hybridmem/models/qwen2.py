"""Qwen2 / Qwen2.5: Llama's tensors plus q/k/v biases."""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import gqa_fields
from hybridmem.models.family import ConfigGetter, Family


def qwen2_bias(get: ConfigGetter) -> bool:
    """Qwen2's attention always builds q/k/v with ``bias=True`` (transformers' ``Qwen2Attention``; vLLM too);
    Qwen2-MoE's config says it with ``qkv_bias`` (default True)."""
    return bool(get("qkv_bias")) if get("qkv_bias") is not None else True


def read_config(get: ConfigGetter) -> dict[str, Any]:
    return gqa_fields(get, qkv_bias=qwen2_bias(get))


QWEN2 = Family(name="qwen2", architectures=("Qwen2ForCausalLM",), read_config=read_config,
               embedded_engine=None)
