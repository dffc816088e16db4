"""hybridmem: switch an RL actor between training and inference on the same accelerators.

>>> from hybridmem import ShardingManager, HybridConfig                        # doctest: +SKIP
>>> manager = ShardingManager(model, engine, optimizer=opt, config=HybridConfig())
>>> with manager.inference() as engine:
...     engine.generate(...)
"""

from __future__ import annotations

from hybridmem.config import HybridConfig, ParallelLayout
from hybridmem.errors import (
    CollectiveTimeoutError,
    ConfigError,
    HostMemoryBudgetError,
    HostMemoryPlanError,
    HybridMemError,
    MemoryPlanError,
    PeerAbortError,
    PhaseError,
    RollbackError,
    SwitchError,
    WeightCoverageError,
    WeightSyncError,
)
from hybridmem.manager import ShardingManager
from hybridmem.switch.memplan import MemoryPlan
from hybridmem.switch.phase import Direction, Phase
from hybridmem.switch.report import StepReport, SwitchReport
from hybridmem.switch.residency import ResidencyReport

__all__ = [
    "ShardingManager",
    "HybridConfig",
    "ParallelLayout",
    "Phase",
    "Direction",
    "SwitchReport",
    "StepReport",
    "MemoryPlan",
    "ResidencyReport",
    "HybridMemError",
    "ConfigError",
    "PhaseError",
    "SwitchError",
    "RollbackError",
    "MemoryPlanError",
    "HostMemoryBudgetError",
    "HostMemoryPlanError",
    "WeightCoverageError",
    "WeightSyncError",
    "CollectiveTimeoutError",
    "PeerAbortError",
]

__version__ = "0.1.0"
