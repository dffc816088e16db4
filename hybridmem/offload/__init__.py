"""Offloaders: move params, grads and optimizer state between device and host.

See [Note: offload by storage] in :mod:`hybridmem.offload.base` for the mechanism.
"""

from __future__ import annotations

from hybridmem.offload.base import Offloader, OffloadState, TransferStats, storage_view
from hybridmem.offload.grads import GradOffloader
from hybridmem.offload.optimizer import OptimizerStateOffloader, optimizer_state_tensors
from hybridmem.offload.params import ParamOffloader

__all__ = [
    "Offloader",
    "OffloadState",
    "TransferStats",
    "ParamOffloader",
    "GradOffloader",
    "OptimizerStateOffloader",
    "optimizer_state_tensors",
    "storage_view",
]
