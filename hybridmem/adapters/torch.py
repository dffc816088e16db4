"""Plain PyTorch training (a module or its chunks, and ``torch.optim`` optimizers) as a
:class:`~hybridmem.contract.training.TrainingState`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from hybridmem.accel import Accelerator
from hybridmem.config import HybridConfig
from hybridmem.contract.kinds import StateKind
from hybridmem.contract.training import TrainingCapabilities
from hybridmem.offload import (
    GradOffloader,
    Offloader,
    OptimizerStateOffloader,
    ParamOffloader,
)
from hybridmem.offload.host_pool import HostBufferPool

__all__ = ["TorchTrainingState", "check_optimizer_owns"]


def check_optimizer_owns(modules: Iterable[torch.nn.Module], optimizer: Any, *,
                         also: Iterable[torch.Tensor] = ()) -> None:
    """Refuse an optimizer (or one of a list) holding parameters that are not the model's (its modules'
    parameters, and ``also``: FSDP2's sharded ones while a module shows its unsharded ones).

    Its state would be offloaded as the training optimizer's while the model's own optimizer state stayed
    on the device, and the other model's steps would be refused outside TRAIN. An optimizer holding a part
    of the model's parameters (frozen layers, LoRA adapters) is fine.

    Raises:
        ValueError: Names the optimizer, how many of its parameters are foreign, and the first one's shape.
    """
    modules = list(modules)
    own = {id(p) for m in modules for p in m.parameters()} | {id(p) for p in also}
    opts = optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]
    for i, opt in enumerate(opts):
        groups = getattr(opt, "param_groups", None)
        if not isinstance(opt, torch.optim.Optimizer) or not groups:
            continue
        held = [p for g in groups for p in g["params"]]
        foreign = [p for p in held if id(p) not in own]
        if foreign:
            which = f"optimizer {type(opt).__name__}" + (f" (#{i} of the list)" if len(opts) > 1 else "")
            model = "/".join(type(m).__name__ for m in modules)
            raise ValueError(
                f"{which} holds {len(foreign)} of its {len(held)} parameters outside the model {model} (the "
                f"first: shape {tuple(foreign[0].shape)}, {foreign[0].dtype}); pass the optimizer built on "
                "this model's parameters (e.g. torch.optim.AdamW(model.parameters()))"
            )



class TorchTrainingState:
    """A plain PyTorch model (or its chunks) and optimizer(s).

    Args:
        model: The module, or a list of module chunks.
        optimizer: A ``torch.optim.Optimizer`` (or anything with ``.state``), a list of them, or ``None``.
    """

    capabilities = TrainingCapabilities(guards_misuse=True, has_hf_config=True, lists_checkpoint_weights=True,
                                        reports_layout=True, holds_module=True)
    """Misuse guards, the transformers config when there is one, checkpoint weights, its layout (a
    transformers model's; ``None`` for others), its module."""

    def __init__(self, model: torch.nn.Module | Iterable[torch.nn.Module], optimizer: Any = None):
        self.modules = [model] if isinstance(model, torch.nn.Module) else list(model)
        if not self.modules or not all(isinstance(m, torch.nn.Module) for m in self.modules):
            raise TypeError(f"model must be a torch.nn.Module or a list of them, got {type(model).__name__}")
        check_optimizer_owns(self.modules, optimizer)
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
        """The modules and optimizers that refuse work outside TRAIN (see [Note: misuse guards] in
        :mod:`hybridmem.switch.guards`)."""
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
    def module(self) -> torch.nn.Module | None:
        """The model when it is one module, ``None`` when it is several chunks."""
        return self.modules[0] if len(self.modules) == 1 else None

    @property
    def hf_config(self) -> Any:
        """The transformers config of the model (``model.config``, looking through DDP's ``.module``), or
        ``None`` when it is not a transformers model."""
        module = self.modules[0]
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            module = getattr(module, "module", module)
        config = getattr(module, "config", None)
        return config if callable(getattr(config, "to_dict", None)) else None

    @property
    def parallel_layout(self) -> dict[str, int] | None:
        """A transformers model is whole on every rank (tp = pp = ep = 1); other models do not say (see
        [Note: layouts from the parts] in :mod:`hybridmem.parts`)."""
        return {"tp": 1, "pp": 1, "ep": 1} if self.hf_config is not None else None
