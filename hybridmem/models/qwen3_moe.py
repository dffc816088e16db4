"""Qwen3-MoE: every layer MoE, no shared expert, q/k norms; embedding, norm and head on every vLLM stage."""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import gqa_fields, moe_fields
from hybridmem.models.family import ConfigGetter, Family


def read_config(get: ConfigGetter) -> dict[str, Any]:
    # transformers >= 5.20 writes the expert count as num_local_experts (num_experts is an attribute alias
    # of its config class, so a config object answers to both).
    return {**gqa_fields(get, qkv_bias=bool(get("attention_bias", False)), qk_norm=True),
            **moe_fields(get, experts_keys=("num_experts", "num_local_experts"))}


QWEN3_MOE = Family(name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), read_config=read_config,
                   moe=True, vllm_every_stage=True)
