"""The weight-sync interface: :class:`WeightSync`, what one sync did (:class:`SyncStats`), and the plain
:class:`LoadWeightsSync`.

This module sits below :mod:`hybridmem.reshard` (whose ``ReshardSync`` implements the interface) and
below :mod:`hybridmem.sync` (which picks a sync for ShardingManager), so the dependencies run one way:
``hybridmem.sync -> hybridmem.reshard -> hybridmem.weight_sync``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hybridmem.engines.protocol import InferenceEngine

__all__ = ["SyncStats", "WeightSync", "LoadWeightsSync", "engine_unwritten"]


@dataclass(frozen=True, slots=True)
class SyncStats:
    """What one weight sync did on this rank."""

    num_tensors: int = 0
    """Tensors written into the engine."""
    sent_nbytes: int = 0
    """Bytes this rank sent to other ranks."""
    received_nbytes: int = 0
    """Bytes this rank received from other ranks (or copied locally, for a single-process sync)."""
    min_received_nbytes: int = 0
    """The fewest bytes this rank could have received (what it did not already hold)."""
    temp_peak_nbytes: int = 0
    """Peak temporary device bytes."""
    seconds: float = 0.0
    unwritten: tuple[str, ...] = ()
    """Engine tensors of this rank not entirely written (see [Note: weight coverage] in hybridmem.sync)."""
    coverage_checked: bool = False
    """Whether ``unwritten`` is a proof (False: the engine cannot report what it received)."""


class WeightSync(ABC):
    """Writes training weights into the engine; the TRAIN->INFER weight-sync step calls it."""

    def temp_nbytes(self) -> int:
        """Peak temporary device bytes one :meth:`sync` needs (for the memory plan)."""
        return 0

    @abstractmethod
    def sync(self) -> SyncStats:
        """Write the weights; the engine's weight storage is resumed before this is called."""


class LoadWeightsSync(WeightSync):
    """Feeds ``weights()`` into ``engine.load_weights``.

    Args:
        weights: Returns the ``(name, tensor)`` pairs to load (called on every sync, so it sees the
            weights as training left them).
        engine: The engine.
    """

    def __init__(self, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]], engine: InferenceEngine):
        self._weights = weights
        self.engine = engine

    def sync(self) -> SyncStats:
        start = time.perf_counter()
        count = 0
        nbytes = 0

        def counted() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal count, nbytes
            for name, tensor in self._weights():
                count += 1
                nbytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        with torch.no_grad():
            self.engine.load_weights(counted())
        unwritten, checked = engine_unwritten(self.engine)
        return SyncStats(
            num_tensors=count,
            received_nbytes=nbytes,
            min_received_nbytes=nbytes,
            seconds=time.perf_counter() - start,
            unwritten=unwritten,
            coverage_checked=checked,
        )


def engine_unwritten(engine: Any) -> tuple[tuple[str, ...], bool]:
    """``(engine tensors not entirely written by load_weights, whether the engine could tell)``."""
    fn = getattr(engine, "unwritten_weights", None)
    if not callable(fn):
        return (), False
    return tuple(fn()), True
