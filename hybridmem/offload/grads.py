"""Offload gradients, skipping those that carry nothing."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch

from hybridmem.accel import Accelerator
from hybridmem.contract.kinds import StateKind
from hybridmem.offload.base import Offloader
from hybridmem.offload.host_pool import HostBufferPool

__all__ = ["GradOffloader"]


class GradOffloader(Offloader):
    """Moves ``param.grad`` (and Megatron-style ``param.main_grad``) of the given parameters.

    Grads that are ``None`` are skipped; with ``skip_zero`` (the default) a grad storage whose bytes
    are all zero, as after ``zero_grad(set_to_none=False)``, is freed without a copy and re-zeroed on
    onload.

    Args:
        params: The parameters, or a module whose parameters to use.
        accel, pool, owner, skip_zero: See :class:`~hybridmem.offload.base.Offloader`.
    """

    kind: ClassVar[StateKind] = StateKind.GRAD

    def __init__(
        self,
        params: torch.nn.Module | Iterable[torch.nn.Parameter],
        accel: Accelerator,
        pool: HostBufferPool,
        *,
        skip_zero: bool = True,
        owner: str | None = None,
    ):
        super().__init__(accel, pool, owner=owner, skip_zero=skip_zero)
        self.params = list(params.parameters() if isinstance(params, torch.nn.Module) else params)

    def tensors(self) -> Iterable[torch.Tensor]:
        for p in self.params:
            if p.grad is not None:
                yield p.grad
            main_grad = getattr(p, "main_grad", None)
            if isinstance(main_grad, torch.Tensor):
                yield main_grad
