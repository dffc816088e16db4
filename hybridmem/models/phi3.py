"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's blocks, stored fused: ``self_attn.qkv_proj.weight`` = [q; k; v]
and ``mlp.gate_up_proj.weight`` = [gate; up], in the checkpoint and in transformers' modules alike."""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import gqa_fields
from hybridmem.models.family import ConfigGetter, Family


def read_config(get: ConfigGetter) -> dict[str, Any]:
    return gqa_fields(get, qkv_bias=False)


PHI3 = Family(
    embedded_engine=None,
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    read_config=read_config,
    checkpoint_fused=(
        (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         "self_attn.qkv_proj.weight"),
        (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "mlp.gate_up_proj.weight"),
    ),
    module_names="checkpoint",
)
