"""gpt-oss: grouped-query attention with q/k/v/o biases and a learned per-head attention sink, every layer a
mixture of experts with biases.

Canonically one expert is ``mlp.experts.{e}.gate_up_proj.weight`` [2I, H] with gate and up rows
interleaved (row ``2j`` gate, ``2j + 1`` up, as vLLM's ``swigluoai`` reads them), its bias, and
``down_proj`` [H, I] with its bias. The checkpoint (and transformers' modules) stack each over experts
and store the weights transposed: ``mlp.experts.gate_up_proj`` [E, H, 2I], ``gate_up_proj_bias`` [E, 2I],
``down_proj`` [E, I, H], ``down_proj_bias`` [E, H]. The router is ``mlp.router`` (weight and bias). vLLM
keeps the interleaving and splits the 2I rows into contiguous row blocks per TP rank; its loader (0.32 and
0.33 alike) puts ``w2_bias`` whole on MoE-TP rank 0 of every pipeline stage and zeros on the other TP ranks (a
row-parallel bias is added once); with expert parallelism MoE-TP is 1 and every rank holds its own experts'
biases whole. The config's
``intermediate_size`` is one expert's width; the sliding window of alternate layers changes no tensor.
"""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import gqa_fields, moe_fields
from hybridmem.models.family import ConfigGetter, Family


def read_config(get: ConfigGetter) -> dict[str, Any]:
    bias = bool(get("attention_bias", True))
    fields = gqa_fields(get, qkv_bias=bias, o_bias=bias)
    fields.update(moe_fields(get, experts_keys=("num_local_experts",), expert_width_key="intermediate_size"))
    fields["intermediate_size"] = 0  # no dense MLP
    return fields


GPT_OSS = Family(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    read_config=read_config,
    moe=True,
    attention_sinks=True,
    router_linear_bias=True,
    experts_interleaved=True,
    checkpoint_renames=((r"^mlp\.gate\.", "mlp.router."),),
    checkpoint_stacked=(
        (r"mlp\.experts\.(\d+)\.gate_up_proj\.weight", "mlp.experts.gate_up_proj", True),
        (r"mlp\.experts\.(\d+)\.gate_up_proj\.bias", "mlp.experts.gate_up_proj_bias", False),
        (r"mlp\.experts\.(\d+)\.down_proj\.weight", "mlp.experts.down_proj", True),
        (r"mlp\.experts\.(\d+)\.down_proj\.bias", "mlp.experts.down_proj_bias", False),
    ),
    module_names="checkpoint",
    vllm_renames=((r"^mlp\.gate\.", "mlp.router."), (r"^self_attn\.", "attn.")),
    vllm_embedding="model.embedding.weight",
    vllm_every_stage=True,
    megatron="hybridmem's Megatron names do not yet cover gpt-oss's attention sinks (megatron-core's "
             "softmax_type='learnable') and expert biases",
)
