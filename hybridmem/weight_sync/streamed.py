"""LoadWeightsSync: the training weights streamed into the engine's ``load_weights`` as ``(name, tensor)``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from hybridmem.weight_sync.base import SyncStats, WeightSync, dtype_note, engine_dtypes, engine_unwritten

if TYPE_CHECKING:
    from hybridmem.engine_contract import InferenceEngine

__all__ = ["LoadWeightsSync"]


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

        dtypes: set[torch.dtype] = set()

        def counted() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal count, nbytes
            for name, tensor in self._weights():
                count += 1
                nbytes += tensor.numel() * tensor.element_size()
                dtypes.add(tensor.dtype)
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
            dtype_note=dtype_note(dtypes, engine_dtypes(self.engine)),
        )
