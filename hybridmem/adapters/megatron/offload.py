"""Offloaders for Megatron-core's contiguous DDP buffers and its optimizers.

[Note: Megatron buffers]
Megatron's ``DistributedDataParallel`` allocates, per dtype group, one ``_ParamAndGradBuffer`` with a
flat ``param_data`` tensor (every parameter's ``.data`` is a view into it) and a flat ``grad_data``
tensor (every ``param.main_grad`` is a view into it); expert parameters get their own buffers in
``expert_parallel_buffers``. Because :class:`~hybridmem.offload.base.Offloader` works by storage (see
[Note: offload by storage] in :mod:`hybridmem.offload.base`), handing it ``buffer.param_data`` moves the whole
buffer as one flat copy and ``resize_(0)`` on that storage releases every parameter view at once, while the
``Parameter`` objects, the optimizer's references to them and DDP's grad hooks stay valid.

Megatron allocates ``param_data`` only with ``use_distributed_optimizer=True`` (it needs the flat
buffer for its param all-gather); otherwise ``param_data`` is ``None`` and each parameter keeps its own
storage, which the param offloader then moves one by one (``grad_data`` always exists).

The optimizer offloader must not touch those buffers: the ``DistributedOptimizer``'s
``shard_fp32_groups`` (fp32 model params) and the plain fp32 optimizer's params are views into
``param_data``. It therefore moves only the optimizer's own storages: its fp32 main params
(``shard_fp32_from_float16_groups`` / ``fp32_from_float16_groups``) and the inner torch optimizer's
state (``exp_avg``, ``exp_avg_sq``, ``step``), minus any storage a DDP buffer owns.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch

from hybridmem.accel import Accelerator
from hybridmem.contract.kinds import StateKind
from hybridmem.offload.base import Offloader
from hybridmem.offload.host_pool import HostBufferPool
from hybridmem.offload.optimizer import optimizer_state_tensors

__all__ = [
    "ddp_buffers",
    "leaf_optimizers",
    "main_param_tensors",
    "MegatronParamOffloader",
    "MegatronGradOffloader",
    "MegatronOptimizerOffloader",
]

# Attributes of Megatron's mixed-precision optimizers holding fp32 main params that are *copies*
# (own storage), checked in this order. Present in 0.16.x and 0.19.x:
#   DistributedOptimizer: shard_fp32_from_float16_groups
#   Float16OptimizerWithFloat16Params: fp32_from_float16_groups
# Not listed on purpose: shard_fp32_groups / fp32_from_fp32_groups (views of, or the same tensors as,
# the model params in the DDP param buffer, see [Note: Megatron buffers]).
_MAIN_PARAM_GROUPS = ("shard_fp32_from_float16_groups", "fp32_from_float16_groups")


def ddp_buffers(model_chunks: Iterable[Any]) -> list[Any]:
    """Every ``_ParamAndGradBuffer`` of the DDP-wrapped chunks: ``buffers`` then
    ``expert_parallel_buffers`` (the latter absent in old releases).

    Raises:
        TypeError: A chunk is not wrapped in Megatron's ``DistributedDataParallel`` (no ``buffers``).
    """
    out = []
    for i, chunk in enumerate(model_chunks):
        if not hasattr(chunk, "buffers") or callable(chunk.buffers):
            raise TypeError(
                f"model chunk {i} ({type(chunk).__name__}) is not wrapped in megatron.core.distributed."
                "DistributedDataParallel: it has no contiguous 'buffers' list"
            )
        out += list(chunk.buffers) + list(getattr(chunk, "expert_parallel_buffers", None) or [])
    return out


def leaf_optimizers(optimizer: Any) -> list[Any]:
    """The Megatron optimizers inside ``optimizer``: a ``ChainedOptimizer``'s ``chained_optimizers``
    (recursively), or ``[optimizer]``."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        return [optimizer]
    return [leaf for opt in chained for leaf in leaf_optimizers(opt)]


def main_param_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """The fp32 main params a mixed-precision Megatron optimizer keeps as its own copies (and their
    ``.grad`` if set); nothing for the plain fp32 optimizer."""
    for leaf in leaf_optimizers(optimizer):
        for attr in _MAIN_PARAM_GROUPS:
            groups = getattr(leaf, attr, None)
            if groups:
                for group in groups:
                    for p in group:
                        if p is not None:
                            yield p
                break


def _inner_state_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    for leaf in leaf_optimizers(optimizer):
        inner = getattr(leaf, "optimizer", None)
        if inner is not None and hasattr(inner, "state"):
            yield from optimizer_state_tensors(inner)


def _storage_keys(tensors: Iterable[torch.Tensor | None]) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors if t is not None}


class MegatronParamOffloader(Offloader):
    """Moves every DDP buffer's ``param_data`` as one flat copy (see [Note: Megatron buffers]).

    Args:
        model_chunks: DDP-wrapped model chunks.
        accel, pool, owner: See :class:`~hybridmem.offload.base.Offloader`.
    """

    kind: ClassVar[StateKind] = StateKind.PARAM

    def __init__(self, model_chunks: Iterable[Any], accel: Accelerator, pool: HostBufferPool, *,
                 owner: str | None = None):
        super().__init__(accel, pool, owner=owner)
        self.model_chunks = list(model_chunks)
        self.buffers = ddp_buffers(self.model_chunks)

    def tensors(self) -> Iterable[torch.Tensor]:
        for buf in self.buffers:
            if buf.param_data is not None:
                yield buf.param_data
        # Parameters Megatron keeps outside the buffers (none in a standard GPTModel; kept for
        # modules with params that do not require grad) and registered buffers (rotary caches).
        owned = _storage_keys(b.param_data for b in self.buffers)
        # DDP's ``buffers`` attribute shadows ``nn.Module.buffers``: call the method through the class.
        for chunk in self.model_chunks:
            for t in [*chunk.parameters(), *torch.nn.Module.buffers(chunk)]:
                if t.untyped_storage()._cdata not in owned:
                    yield t


class MegatronGradOffloader(Offloader):
    """Moves every DDP buffer's ``grad_data`` as one flat copy; an all-zero buffer (after
    ``zero_grad_buffer()``) is released without a copy and re-zeroed on onload.

    Args:
        model_chunks: DDP-wrapped model chunks.
        optimizer: The Megatron optimizer; main params' ``.grad`` tensors it still holds are moved too.
        accel, pool, owner, skip_zero: See :class:`~hybridmem.offload.base.Offloader`.
    """

    kind: ClassVar[StateKind] = StateKind.GRAD

    def __init__(
        self,
        model_chunks: Iterable[Any],
        optimizer: Any,
        accel: Accelerator,
        pool: HostBufferPool,
        *,
        skip_zero: bool = True,
        owner: str | None = None,
    ):
        super().__init__(accel, pool, owner=owner, skip_zero=skip_zero)
        self.buffers = ddp_buffers(model_chunks)
        self.optimizer = optimizer

    def tensors(self) -> Iterable[torch.Tensor]:
        for buf in self.buffers:
            if buf.grad_data is not None:
                yield buf.grad_data
        if self.optimizer is not None:
            for p in main_param_tensors(self.optimizer):
                if p.grad is not None:
                    yield p.grad


class MegatronOptimizerOffloader(Offloader):
    """Moves a Megatron optimizer's own storages: fp32 main params and the inner optimizer's state,
    for ``DistributedOptimizer``, ``Float16OptimizerWithFloat16Params``, ``FP32Optimizer`` and
    ``ChainedOptimizer`` (never a DDP buffer's storage, see [Note: Megatron buffers]).

    Args:
        optimizer: The Megatron optimizer.
        model_chunks: The DDP-wrapped chunks whose buffers must be left to the param/grad offloaders.
        accel, pool, owner: See :class:`~hybridmem.offload.base.Offloader`.
    """

    kind: ClassVar[StateKind] = StateKind.OPTIMIZER

    def __init__(
        self, optimizer: Any, model_chunks: Iterable[Any], accel: Accelerator, pool: HostBufferPool, *,
        owner: str | None = None
    ):
        super().__init__(accel, pool, owner=owner)
        self.optimizer = optimizer
        self.buffers = ddp_buffers(model_chunks)

    def tensors(self) -> Iterable[torch.Tensor]:
        excluded = _storage_keys([*(b.param_data for b in self.buffers),
                                  *(b.grad_data for b in self.buffers)])
        for t in [*main_param_tensors(self.optimizer), *_inner_state_tensors(self.optimizer)]:
            if t.untyped_storage()._cdata not in excluded:
                yield t
