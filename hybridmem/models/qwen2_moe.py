"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): every layer MoE, a gated shared expert, q/k/v biases.

Every layer is MoE as the default ``decoder_sparse_step=1`` and empty ``mlp_only_layers`` make it; vLLM
builds the embedding, final norm and head on every pipeline stage.
"""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import gqa_fields, moe_fields
from hybridmem.models.family import ConfigGetter, Family
from hybridmem.models.qwen2 import qwen2_bias


def read_config(get: ConfigGetter) -> dict[str, Any]:
    return {**gqa_fields(get, qkv_bias=qwen2_bias(get)),
            **moe_fields(get, experts_keys=("num_experts",),
                         shared_width=get("shared_expert_intermediate_size", 0) or 0)}


QWEN2_MOE = Family(name="qwen2_moe", architectures=("Qwen2MoeForCausalLM",), read_config=read_config,
                   moe=True, shared_expert="shared_expert", shared_expert_gate=True, vllm_every_stage=True)
