"""What the manager needs from the training side: its offloaders and its weights.

Plain PyTorch training (a module or list of module chunks plus a ``torch.optim`` optimizer) is served
by :class:`TorchTrainingState`; framework adapters (``hybridmem.adapters.megatron``, ``.fsdp``) implement
the same :class:`TrainingState` protocol with offloaders that move their contiguous buffers.

[Note: training capabilities]
What a training state offers beyond its two methods is declared, as an engine's is ([Note: engine
capabilities] in hybridmem.engine_contract): its ``capabilities`` attribute is a TrainingCapabilities, and
the manager, the architecture check and the weight-sync choice read training_capabilities_of(state)
instead of probing for methods. A declared capability whose method or attribute is missing is a
TypeError naming both, raised when the manager is built. A state that declares nothing (a third-party
object implementing the protocol) gets its capabilities read once from what it has.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

import torch

from hybridmem.accel import Accelerator
from hybridmem.config import HybridConfig
from hybridmem.declared import declared_capabilities
from hybridmem.host_pool import HostBufferPool
from hybridmem.kinds import StateKind
from hybridmem.offload import GradOffloader, Offloader, OptimizerStateOffloader, ParamOffloader

__all__ = ["TrainingState", "TrainingCapabilities", "training_capabilities_of", "TorchTrainingState",
           "check_optimizer_owns"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingCapabilities:
    """What a training state declares it can do (see [Note: training capabilities])."""

    guards_misuse: bool = False
    """``guard_targets()`` gives the modules and optimizers that refuse work outside TRAIN."""
    attaches_itself: bool = False
    """``attach(manager)`` registers the state's own steps and residency owners; the manager calls it."""
    describes_model: bool = False
    """``model_spec_dict(**kwargs)`` gives the model's HF-style config, for the weight sync's spec."""
    vocab_from_engine: bool = False
    """``model_spec_dict(vocab_size=)`` wants the engine's vocab: the model's is padded, its own unknown."""
    family_from_engine: bool = False
    """``model_spec_dict(model_type=)`` takes the family the engine serves (the model does not name it)."""
    has_hf_config: bool = False
    """``hf_config``: the model's transformers config, or ``None`` when it has none."""
    shards_weights: bool = False
    """``hf_source_layout(spec, world_size, group=)`` says where each rank's shards of transformers-named
    weights come from (FSDP2); sharded weights are resharded even into an equal layout."""
    reports_source_layout: bool = False
    """``source_layout()`` gives the TP/PP/EP the state runs at (checked against ``config.train_layout``)."""
    megatron_names: bool = False
    """``megatron_convention()`` gives the naming and vocab padding of its Megatron-named weights."""
    lists_checkpoint_weights: bool = False
    """``checkpoint_weights()`` gives what a checkpoint holds: no non-persistent buffers, a tied tensor once."""
    reports_layout: bool = False
    """``parallel_layout``: the TP/PP/EP its weights are laid out in (unset layout keys of the config are read
    from it)."""


_REQUIRES = {
    "guards_misuse": ("guard_targets",),
    "attaches_itself": ("attach",),
    "describes_model": ("model_spec_dict",),
    "vocab_from_engine": ("model_spec_dict",),
    "family_from_engine": ("model_spec_dict",),
    "has_hf_config": ("hf_config",),
    "shards_weights": ("hf_source_layout",),
    "reports_source_layout": ("source_layout",),
    "megatron_names": ("megatron_convention",),
    "lists_checkpoint_weights": ("checkpoint_weights",),
    "reports_layout": ("parallel_layout",),
}
"""The methods (or the attributes in :data:`_ATTRIBUTES`) each capability promises."""
_ATTRIBUTES = frozenset({"hf_config", "parallel_layout"})


def _has(state: Any, name: str) -> bool:
    if name in _ATTRIBUTES:
        return hasattr(state, name)
    return callable(getattr(state, name, None))


def training_capabilities_of(state: Any) -> TrainingCapabilities:
    """The state's declared :class:`TrainingCapabilities`, or, when it declares none, what it offers.

    Raises:
        TypeError: The state declares a capability whose method or attribute it lacks (naming both), or
            its ``capabilities`` is not a ``TrainingCapabilities``.
    """
    declared = declared_capabilities(state, TrainingCapabilities, _REQUIRES, what="training state", has=_has,
                                     attributes=_ATTRIBUTES)
    if declared is not None:
        return declared
    found = {f.name: all(_has(state, n) for n in _REQUIRES[f.name]) for f in fields(TrainingCapabilities)}
    found["vocab_from_engine"] = found["family_from_engine"] = False  # flags, not methods: declared only
    return TrainingCapabilities(**found)


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
                f"first: shape {tuple(foreign[0].shape)}, {foreign[0].dtype}); pass the optimizer built on this "
                f"model's parameters (e.g. torch.optim.AdamW(model.parameters()))"
            )


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

    # Optional, declared in ``capabilities`` (a TrainingCapabilities, see [Note: training capabilities]):
    # ``guard_targets()``, ``attach(manager)``, ``model_spec_dict()``, ``hf_config``, ``hf_source_layout()``,
    # ``source_layout()``, ``megatron_convention()``, ``checkpoint_weights()``.


class TorchTrainingState:
    """A plain PyTorch model (or its chunks) and optimizer(s).

    Args:
        model: The module, or a list of module chunks.
        optimizer: A ``torch.optim.Optimizer`` (or anything with ``.state``), a list of them, or ``None``.
    """

    capabilities = TrainingCapabilities(guards_misuse=True, has_hf_config=True, lists_checkpoint_weights=True,
                                        reports_layout=True)
    """Misuse guards, the transformers config when there is one, checkpoint weights, its layout (a transformers
    model's; ``None`` for others)."""

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
