"""What a byte of device memory is for: the categories reports and plans count bytes by."""

from __future__ import annotations

from enum import Enum

__all__ = ["StateKind"]


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
