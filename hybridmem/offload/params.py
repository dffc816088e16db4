"""Offload a model's weights (and, by default, its buffers)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch

from hybridmem.accel import Accelerator
from hybridmem.contract.kinds import StateKind
from hybridmem.offload.base import Offloader
from hybridmem.offload.engine_owned import is_engine_owned
from hybridmem.offload.host_pool import HostBufferPool

__all__ = ["ParamOffloader"]


class ParamOffloader(Offloader):
    """Moves the parameters (and buffers) of one or more modules.

    Args:
        modules: The model, or its chunks (pipeline stages / virtual stages).
        include_buffers: Also move registered buffers (norm statistics, rotary caches).
        include_frozen: Move parameters that do not train (``requires_grad=False``) too (default); ``False``
            leaves them on the device (a LoRA model's base while only its adapters are synced, see [Note:
            lora base] in :mod:`hybridmem.switch.lora_base`).
        accel, pool, owner: See :class:`~hybridmem.offload.base.Offloader`.
    """

    kind: ClassVar[StateKind] = StateKind.PARAM

    def __init__(
        self,
        modules: torch.nn.Module | Iterable[torch.nn.Module],
        accel: Accelerator,
        pool: HostBufferPool,
        *,
        include_buffers: bool = True,
        include_frozen: bool = True,
        owner: str | None = None,
    ):
        super().__init__(accel, pool, owner=owner)
        self.modules = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
        self.include_buffers = include_buffers
        self.include_frozen = include_frozen

    def tensors(self) -> Iterable[torch.Tensor]:
        """The modules' parameters (the trainable ones alone without :attr:`include_frozen`) and buffers, but
        those whose memory an engine owns (a LoRA trainer's base shared with the engine,
        :mod:`hybridmem.offload.engine_owned`): they stay where they are."""
        for module in self.modules:
            yield from (p for p in module.parameters()
                        if (self.include_frozen or p.requires_grad) and not is_engine_owned(p))
            if self.include_buffers:
                yield from module.buffers()
