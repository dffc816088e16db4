"""What a byte of device memory is for: the categories reports and plans count bytes by, and the tags an
inference engine's memory is split by (see [Note: engine memory tags] in :mod:`hybridmem.contract.engine`).

A bottom module (no hybridmem imports), so the KV allocators and the engines both take the tags from here.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["StateKind", "WEIGHTS", "KV_CACHE", "ENGINE_TAGS"]

WEIGHTS = "weights"
"""Engine tag of the model weights in the engine's own layout."""
KV_CACHE = "kv_cache"
"""Engine tag of the paged KV cache."""
ENGINE_TAGS = (WEIGHTS, KV_CACHE)
"""Every engine memory tag."""


class StateKind(str, Enum):
    """A category of device memory that switches move or release."""

    PARAM = "param"
    """Training weights (and buffers) of a model."""
    GRAD = "grad"
    """Training gradients."""
    OPTIMIZER = "optimizer"
    """Optimizer state: moments, momentum, fp32 master weights, step counters."""
    ENGINE_WEIGHTS = "engine_weights"
    """The inference engine's weights, in its own layout."""
    KV_CACHE = "kv_cache"
    """The inference engine's KV cache."""
    TEMP = "temp"
    """Transient buffers of a step (resharding buckets)."""

    def __str__(self) -> str:
        return self.value
