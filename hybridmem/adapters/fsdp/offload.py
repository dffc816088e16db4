"""Offloaders for FSDP2 (``fully_shard``) models: they move the local shards of DTensors.

A DTensor is a wrapper without storage of its own; what a rank holds of it is its local tensor, a
view of FSDP2's padded shard storage (see [Note: FSDP2 shards] in :mod:`hybridmem.reshard.hf_source`).
These offloaders hand the local tensors to the shared mechanism (see [Note: offload by storage] in
:mod:`hybridmem.offload.base`), which moves each storage whole, padding included, and frees it with
``resize_(0)``: the DTensor objects, the optimizer's references to them and FSDP2's own views stay
valid, and the bytes come back bitwise. The DTensors themselves refuse reads while their shards are on the
host, as the local tensors do (``held_by_user``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hybridmem.offload import GradOffloader, OptimizerStateOffloader, ParamOffloader

__all__ = ["local_tensor", "FSDPParamOffloader", "FSDPGradOffloader", "FSDPOptimizerOffloader"]


def local_tensor(t: Any) -> Any:
    """This rank's part of ``t``: the local tensor of a DTensor, ``t`` itself otherwise (``None`` too)."""
    return t._local_tensor if isinstance(t, DTensor) else t  # the storage owner itself


def _locals(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    for t in tensors:
        yield local_tensor(t)


def _with_wrappers(freed: list[torch.Tensor], held: Iterable[Any]) -> list[torch.Tensor]:
    """``freed`` and the DTensors of ``held`` whose local tensor is one of them: what the user reads is the
    DTensor, whose ops reach the local tensor below ``__torch_function__``, so both must refuse reads (see
    [Note: offloaded tensors refuse reads] in :mod:`hybridmem.offload.guard`)."""
    keys = {id(t) for t in freed}
    return [*freed, *(t for t in held if isinstance(t, DTensor) and id(t._local_tensor) in keys)]


class FSDPParamOffloader(ParamOffloader):
    """:class:`~hybridmem.offload.ParamOffloader` over the local shards of DTensor parameters."""

    def tensors(self) -> Iterable[torch.Tensor]:
        return _locals(super().tensors())

    def held_by_user(self, freed: list[torch.Tensor]) -> list[torch.Tensor]:
        """The local shards and their DTensor parameters."""
        return _with_wrappers(freed, super().tensors())


class FSDPGradOffloader(GradOffloader):
    """:class:`~hybridmem.offload.GradOffloader` over the local shards of DTensor gradients (FSDP2's
    reduce-scatter outputs; the grads of one parameter group share one storage, moved once).

    The parameters are looked up on every offload, not once: while a module is unsharded (after a
    forward without backward) FSDP2 registers other parameter objects on it, and the grads live on the
    sharded ones.

    Args:
        modules: The model or its chunks.
        accel, pool, owner, skip_zero: See :class:`~hybridmem.offload.base.Offloader`.
    """

    def __init__(self, modules: torch.nn.Module | Iterable[torch.nn.Module], accel: Any, pool: Any, *,
                 skip_zero: bool = True, owner: str | None = None):
        super().__init__([], accel, pool, skip_zero=skip_zero, owner=owner)
        self.modules = [modules] if isinstance(modules, torch.nn.Module) else list(modules)

    def tensors(self) -> Iterable[torch.Tensor]:
        return _locals(self._grads())

    def _grads(self) -> Iterator[torch.Tensor]:
        for module in self.modules:
            for p in module.parameters():
                if p.grad is not None:
                    yield p.grad

    def held_by_user(self, freed: list[torch.Tensor]) -> list[torch.Tensor]:
        """The local shards and their DTensor gradients."""
        return _with_wrappers(freed, self._grads())


class FSDPOptimizerOffloader(OptimizerStateOffloader):
    """:class:`~hybridmem.offload.OptimizerStateOffloader` over the local shards of DTensor state
    (AdamW's ``exp_avg``/``exp_avg_sq`` are DTensors like their parameters; ``step`` is a plain tensor)."""

    def tensors(self) -> Iterable[torch.Tensor]:
        return _locals(super().tensors())

    def held_by_user(self, freed: list[torch.Tensor]) -> list[torch.Tensor]:
        """The local shards and their DTensor state."""
        return _with_wrappers(freed, super().tensors())
