"""FSDP2 adapter: offload the local shards of ``fully_shard`` models, reshard them into the engine.

``ShardingManager`` uses it by itself for a model with ``fully_shard`` applied; see docs/fsdp.md.
"""

from hybridmem.adapters.fsdp.offload import (
    FSDPGradOffloader,
    FSDPOptimizerOffloader,
    FSDPParamOffloader,
    local_tensor,
)
from hybridmem.adapters.fsdp.state import (
    UNSHARDED_OWNER,
    FSDPTrainingState,
    is_fsdp_model,
)

__all__ = [
    "FSDPTrainingState",
    "UNSHARDED_OWNER",
    "is_fsdp_model",
    "FSDPParamOffloader",
    "FSDPGradOffloader",
    "FSDPOptimizerOffloader",
    "local_tensor",
]
