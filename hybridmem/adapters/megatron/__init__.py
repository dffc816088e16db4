"""Megatron-core adapter: offload DDP's contiguous buffers and Megatron's optimizers, describe shards.

Supports megatron-core 0.16.x (tested on CPU here) and 0.19.x (attributes checked against its source,
untested here); see docs/megatron.md for the attributes relied on.
"""

from hybridmem.adapters.megatron.device import MEGATRON_CPU_HARNESS, megatron_device
from hybridmem.adapters.megatron.offload import (
    MegatronGradOffloader,
    MegatronOptimizerOffloader,
    MegatronParamOffloader,
    ddp_buffers,
    leaf_optimizers,
    main_param_tensors,
)
from hybridmem.adapters.megatron.shards import (
    MegatronSourceLayout,
    ShardSpec,
    megatron_model_spec_dict,
    megatron_named_weights,
    megatron_shard_specs,
    megatron_source_layout,
    unwrap_model,
)
from hybridmem.adapters.megatron.state import (
    WORKSPACE_OWNER,
    MegatronTrainingState,
    MegatronWorkspaces,
)

__all__ = [
    "megatron_device",
    "MEGATRON_CPU_HARNESS",
    "MegatronTrainingState",
    "MegatronWorkspaces",
    "WORKSPACE_OWNER",
    "MegatronParamOffloader",
    "MegatronGradOffloader",
    "MegatronOptimizerOffloader",
    "ddp_buffers",
    "leaf_optimizers",
    "main_param_tensors",
    "ShardSpec",
    "MegatronSourceLayout",
    "unwrap_model",
    "megatron_named_weights",
    "megatron_shard_specs",
    "megatron_source_layout",
    "megatron_model_spec_dict",
]
