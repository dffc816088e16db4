"""Qwen3 (dense): per-head RMSNorm on q and k, no q/k/v bias."""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import gqa_fields
from hybridmem.models.family import ConfigGetter, Family


def read_config(get: ConfigGetter) -> dict[str, Any]:
    return gqa_fields(get, qkv_bias=bool(get("attention_bias", False)), qk_norm=True)


QWEN3 = Family(name="qwen3", architectures=("Qwen3ForCausalLM",), read_config=read_config)
