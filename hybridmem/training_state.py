"""What the manager needs from the training side: its offloaders and its weights.

Plain PyTorch training (a module or list of module chunks plus a ``torch.optim`` optimizer) is served
by :class:`TorchTrainingState`; framework adapters (``hybridmem.adapters.megatron``) implement the same
:class:`TrainingState` protocol with offloaders that move their contiguous buffers.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from hybridmem.accel import Accelerator
from hybridmem.config import HybridConfig
from hybridmem.host_pool import HostBufferPool
from hybridmem.kinds import StateKind
from hybridmem.offload import GradOffloader, Offloader, OptimizerStateOffloader, ParamOffloader

__all__ = ["TrainingState", "TorchTrainingState"]


@runtime_checkable
class TrainingState(Protocol):
    """The training side of an actor, as the manager sees it."""

    def build_offloaders(
        self, accel: Accelerator, pool: HostBufferPool, config: HybridConfig
    ) -> dict[StateKind, Offloader]:
        """One offloader per kind the training side has (``PARAM``, ``GRAD``, ``OPTIMIZER``).

        All kinds are built even when the config does not offload them, so the residency report can
        count their bytes; the manager schedules only the ones the config enables.
        """

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """This rank's training weights by name, as the weight sync reads them."""

    # Optional: ``guard_targets() -> (modules, optimizers)``: what refuses forward, backward, ``step`` and
    # ``zero_grad`` outside TRAIN (see [Note: misuse guards] in hybridmem.guards).


class TorchTrainingState:
    """A plain PyTorch model (or its chunks) and optimizer(s).

    Args:
        model: The module, or a list of module chunks.
        optimizer: A ``torch.optim.Optimizer`` (or anything with ``.state``), a list of them, or ``None``.
    """

    def __init__(self, model: torch.nn.Module | Iterable[torch.nn.Module], optimizer: Any = None):
        self.modules = [model] if isinstance(model, torch.nn.Module) else list(model)
        if not self.modules or not all(isinstance(m, torch.nn.Module) for m in self.modules):
            raise TypeError(f"model must be a torch.nn.Module or a list of them, got {type(model).__name__}")
        self.optimizer = optimizer

    def build_offloaders(
        self, accel: Accelerator, pool: HostBufferPool, config: HybridConfig
    ) -> dict[StateKind, Offloader]:
        params = [p for m in self.modules for p in m.parameters()]
        offloaders: dict[StateKind, Offloader] = {
            StateKind.PARAM: ParamOffloader(self.modules, accel, pool),
            StateKind.GRAD: GradOffloader(params, accel, pool, skip_zero=config.skip_zero_grads),
        }
        if self.optimizer is not None:
            offloaders[StateKind.OPTIMIZER] = OptimizerStateOffloader(self.optimizer, accel, pool)
        return offloaders

    def guard_targets(self) -> tuple[list[torch.nn.Module], list[Any]]:
        """The modules and optimizers that refuse work outside TRAIN (see [Note: misuse guards])."""
        opts = self.optimizer if isinstance(self.optimizer, (list, tuple)) else [self.optimizer]
        return list(self.modules), [o for o in opts if o is not None]

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Parameters and buffers (non-persistent ones too: an engine copy needs every tensor), by name;
        with several chunks, names are prefixed with the chunk index."""
        return self._weights(non_persistent=True)

    def checkpoint_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """What a checkpoint of the model holds, as :meth:`named_weights` names it: parameters (a tied one
        once) and persistent buffers, without non-persistent buffers such as RoPE's ``inv_freq``, which no
        engine loads."""
        return self._weights(non_persistent=False)

    def _weights(self, *, non_persistent: bool) -> Iterable[tuple[str, torch.Tensor]]:
        for i, m in enumerate(self.modules):
            prefix = "" if len(self.modules) == 1 else f"{i}."
            keep = None if non_persistent else set(m.state_dict(keep_vars=True))
            for name, t in m.named_parameters():
                yield prefix + name, t
            for name, t in m.named_buffers():
                if keep is None or name in keep:
                    yield prefix + name, t

    @property
    def hf_config(self) -> Any:
        """The transformers config of the model (``model.config``, looking through DDP's ``.module``), or
        ``None`` when it is not a transformers model."""
        module = self.modules[0]
        module = getattr(module, "module", module) if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module
        config = getattr(module, "config", None)
        return config if callable(getattr(config, "to_dict", None)) else None

    @property
    def parallel_layout(self) -> dict[str, int] | None:
        """A transformers model is whole on every rank (tp = pp = ep = 1); other models do not say (see
        [Note: layouts from the parts] in :mod:`hybridmem.parts`)."""
        return {"tp": 1, "pp": 1, "ep": 1} if self.hf_config is not None else None
