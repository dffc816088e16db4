"""The contract between hybridmem and an inference engine.

An engine is any object with the three methods of :class:`InferenceEngine`; hybridmem wraps third-party
engines (vLLM) in adapters that implement it, and ships engines of its own
(:class:`hybridmem.engines.TorchCopyEngine`, the embedded ``ReferenceEngine``).

[Note: engine memory tags]
An engine's device memory is split by tag, as vLLM's sleep mode splits it:

- ``"weights"``: the model weights in the engine's own (inference) layout. They are always derivable
  from the training weights, so ``release(["weights"])`` discards them (no host copy) and every
  TRAIN->INFER switch resumes the storage and writes fresh weights into it.
- ``"kv_cache"``: the paged KV cache. Its contents are dead once generation ends, so release discards
  and resume re-allocates without copying anything.

``resume`` must be all-or-nothing: if it fails halfway it gives back what it took and re-raises, so
the switch's rollback sees the engine exactly as before the call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch

from hybridmem.kinds import ENGINE_TAGS, KV_CACHE, WEIGHTS

__all__ = ["InferenceEngine", "WEIGHTS", "KV_CACHE", "ENGINE_TAGS"]


@runtime_checkable
class InferenceEngine(Protocol):
    """What ShardingManager needs from an inference engine.

    Optional methods, used when present:

    - ``resident_nbytes(tag) -> int``: device bytes held now under ``tag`` (residency report).
    - ``planned_nbytes(tag) -> int``: device bytes ``resume([tag])`` will allocate (memory plan).
    - ``named_parameters() -> Iterable[tuple[str, Tensor]]``: the engine's own weight tensors, so the
      resharding engine can write shards into them in place instead of calling ``load_weights``.
    """

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(name, tensor)`` pairs into the engine's weights (storage must be resumed)."""

    def release(self, tags: Sequence[str]) -> None:
        """Give back the device memory of ``tags`` (see [Note: engine memory tags])."""

    def resume(self, tags: Sequence[str]) -> None:
        """Take back the device memory of ``tags``; all-or-nothing."""
