"""LoadWeightsSync: the training weights streamed into the engine's ``load_weights`` as ``(name, tensor)``.

[Note: loaders write what they are given]
An engine's ``load_weights`` may write into the tensors it is handed: vLLM's gpt-oss loader zeroes the
expert down-projection bias it is given on every tensor-parallel rank but the first (``weight.zero_()``),
before copying it. Streamed as they are, the training model's own parameters would be changed by the
rollout engine, silently. So a stream into a loader hybridmem does not own hands each tensor over as a
copy (one tensor at a time: the copy of the largest weight is the sync's transient memory); only an
engine that is a copy of the training module (``loads_training_names``: ``TorchCopyEngine``, whose
loader copies) is handed the tensors themselves. The resharding sync always hands freshly assembled
tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from hybridmem.weight_sync.base import (
    SyncStats,
    WeightSync,
    dtype_note,
    engine_dtypes,
    engine_unwritten,
)

if TYPE_CHECKING:
    from hybridmem.contract.engine import InferenceEngine

__all__ = ["LoadWeightsSync"]


class LoadWeightsSync(WeightSync):
    """Feeds ``weights()`` into ``engine.load_weights``.

    Args:
        weights: Returns the ``(name, tensor)`` pairs to load (called on every sync, so it sees the
            weights as training left them).
        engine: The engine.
        copies: Hand the engine a copy of each tensor, never the training tensor itself (see [Note: loaders
            write what they are given]).
    """

    def __init__(self, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]], engine: InferenceEngine, *,
                 copies: bool = True):
        self._weights = weights
        self.engine = engine
        self.copies = copies

    def temp_nbytes(self) -> int:
        """The largest weight's copy, when the sync copies (see [Note: loaders write what they are given])."""
        if not self.copies:
            return 0
        return max((t.numel() * t.element_size() for _, t in self._weights()), default=0)

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
                yield name, (tensor.detach().clone() if self.copies else tensor)

        with torch.no_grad():
            self.engine.load_weights(counted())
        unwritten, checked = engine_unwritten(self.engine)
        return SyncStats(
            num_tensors=count,
            received_nbytes=nbytes,
            min_received_nbytes=nbytes,
            engine_nbytes=nbytes,
            seconds=time.perf_counter() - start,
            unwritten=unwritten,
            coverage_checked=checked,
            dtype_note=dtype_note(dtypes, engine_dtypes(self.engine)),
        )
