"""The phases of a :class:`~hybridmem.ShardingManager` and the two switch directions."""

from __future__ import annotations

from enum import Enum

__all__ = ["Phase", "Direction"]


class Phase(Enum):
    """Where the actor is, and where its memory is."""

    TRAIN = "train"
    """Training params, grads and optimizer state are on the device; the engine holds no memory."""
    TO_INFER = "to_infer"
    """A TRAIN->INFER switch is running its steps; memory is partly moved."""
    INFER = "infer"
    """Engine weights and KV cache are on the device; offloaded training state is in host arenas."""
    TO_TRAIN = "to_train"
    """An INFER->TRAIN switch (or a recovery) is running its steps."""
    ROLLING_BACK = "rolling_back"
    """A TRAIN->INFER step failed; the steps already done are being undone in reverse."""
    FAILED = "failed"
    """A switch could not finish or be undone. Training state is safe (on the device or in host arenas);
    ``recover()`` brings everything back to TRAIN."""
    CLOSED = "closed"
    """The manager was closed: training state on the device, host arenas dropped, hooks removed; it
    switches no more, and another manager may take the model."""


class Direction(str, Enum):
    """The direction of a switch."""

    TO_INFER = "to_infer"
    """TRAIN -> INFER."""
    TO_TRAIN = "to_train"
    """INFER -> TRAIN (also a recovery from FAILED)."""

    def __str__(self) -> str:
        return self.value
