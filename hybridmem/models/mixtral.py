"""Mixtral: Mistral's attention, every layer a mixture of experts (no shared expert).

Its checkpoints name the MoE block ``block_sparse_moe`` and an expert's projections ``w1`` (gate), ``w3``
(up) and ``w2`` (down), and vLLM keeps ``block_sparse_moe``; transformers 5's modules call the block
``mlp`` with fused experts, the canonical names. The config's ``intermediate_size`` is one expert's width.
"""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import gqa_fields, moe_fields
from hybridmem.models.family import ConfigGetter, Family


def read_config(get: ConfigGetter) -> dict[str, Any]:
    fields = gqa_fields(get, qkv_bias=False)
    fields.update(moe_fields(get, experts_keys=("num_local_experts",), expert_width_key="intermediate_size"))
    fields["intermediate_size"] = 0  # no dense MLP
    return fields


MIXTRAL = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    read_config=read_config,
    moe=True,
    checkpoint_renames=(
        (r"^mlp\.gate\.", "block_sparse_moe.gate."),
        (r"^mlp\.experts\.(\d+)\.gate_proj\.", r"block_sparse_moe.experts.\1.w1."),
        (r"^mlp\.experts\.(\d+)\.up_proj\.", r"block_sparse_moe.experts.\1.w3."),
        (r"^mlp\.experts\.(\d+)\.down_proj\.", r"block_sparse_moe.experts.\1.w2."),
    ),
    vllm_renames=((r"^mlp\.(gate|experts)\.", r"block_sparse_moe.\1."),),
    vllm_every_stage=True,
)
