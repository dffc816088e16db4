"""Offload optimizer state: every tensor in ``optimizer.state``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from hybridmem.accel import Accelerator
from hybridmem.contract.kinds import StateKind
from hybridmem.offload.base import Offloader
from hybridmem.offload.host_pool import HostBufferPool

__all__ = ["OptimizerStateOffloader", "optimizer_state_tensors"]


def _walk(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _walk(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _walk(v)


def optimizer_state_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``optimizer.state``: Adam/AdamW ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``,
    ``step`` (when on the device, e.g. ``capturable=True``), SGD ``momentum_buffer``, and any tensor a
    custom optimizer keeps there, nested in dicts, lists or tuples.
    """
    yield from _walk(list(optimizer.state.values()))


class OptimizerStateOffloader(Offloader):
    """Moves the state of one or more ``torch.optim.Optimizer``-like objects.

    State is created lazily by most optimizers (on their first ``step``); an offload before that moves
    nothing, and the host arena grows once the state exists.

    Args:
        optimizers: An optimizer (anything with a ``state`` mapping) or several.
        accel, pool, owner: See :class:`~hybridmem.offload.base.Offloader`.
    """

    kind: ClassVar[StateKind] = StateKind.OPTIMIZER

    def __init__(self, optimizers: Any, accel: Accelerator, pool: HostBufferPool, *,
                 owner: str | None = None):
        super().__init__(accel, pool, owner=owner)
        self.optimizers = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]

    def tensors(self) -> Iterable[torch.Tensor]:
        for opt in self.optimizers:
            yield from optimizer_state_tensors(opt)
