"""Training tensors whose memory an inference engine owns, which no offloader moves.

A LoRA trainer can hold its frozen base as views of the engine's weights ([Note: shared base] in
:mod:`hybridmem.weight_sync.shared_base`): offloading such a tensor would free the engine's storage under it.
:func:`mark_engine_owned` records a tensor; :class:`~hybridmem.offload.params.ParamOffloader` leaves every
recorded one where it is.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["mark_engine_owned", "is_engine_owned"]

_OWNED: dict[int, weakref.ref] = {}
"""Every live tensor marked, by ``id`` (tensors compare elementwise, so no weak set can hold them)."""


def mark_engine_owned(tensor: torch.Tensor) -> None:
    """Record that ``tensor``'s memory is an engine's (for as long as ``tensor`` lives)."""
    key = id(tensor)
    _OWNED[key] = weakref.ref(tensor, lambda _ref, key=key: _OWNED.pop(key, None))


def is_engine_owned(tensor: torch.Tensor) -> bool:
    """Whether :func:`mark_engine_owned` recorded ``tensor``."""
    ref = _OWNED.get(id(tensor))
    return ref is not None and ref() is tensor
