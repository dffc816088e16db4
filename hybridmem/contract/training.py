"""What the manager needs from the training side: its offloaders and its weights.

Plain PyTorch training (a module or list of module chunks plus a ``torch.optim`` optimizer) is served
by :class:`hybridmem.adapters.torch.TorchTrainingState`; framework adapters (``hybridmem.adapters.megatron``,
``hybridmem.adapters.fsdp``) implement the same :class:`TrainingState` protocol with offloaders that move
their contiguous buffers.

[Note: training capabilities]
What a training state offers beyond its two methods is declared, as an engine's is ([Note: engine
capabilities] in :mod:`hybridmem.contract.engine`): its ``capabilities`` attribute is a TrainingCapabilities,
and the manager, the architecture check and the weight-sync choice read training_capabilities_of(state)
instead of probing for methods. A declared capability whose method or attribute is missing is a
TypeError naming both, raised when the manager is built. A state that declares nothing (a third-party
object implementing the protocol) gets its capabilities read once from what it has.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from hybridmem.contract.capabilities import declared_capabilities
from hybridmem.contract.kinds import StateKind

if TYPE_CHECKING:  # types only: the offloaders implement this contract's side, a layer up
    import torch

    from hybridmem.accel import Accelerator
    from hybridmem.config import HybridConfig
    from hybridmem.offload import Offloader
    from hybridmem.offload.host_pool import HostBufferPool

__all__ = ["TrainingState", "TrainingCapabilities", "training_capabilities_of"]


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
    """``checkpoint_weights()`` gives what a checkpoint holds: no non-persistent buffers, a tied tensor
    once."""
    reports_layout: bool = False
    """``parallel_layout``: the TP/PP/EP its weights are laid out in (unset layout keys of the config are read
    from it)."""
    holds_module: bool = False
    """``module``: the one ``torch.nn.Module`` it trains, ``None`` when it trains several chunks (a LoRA base
    shared with the engine, and error messages, need the module itself)."""


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
    "holds_module": ("module",),
}
"""The methods (or the attributes in :data:`_ATTRIBUTES`) each capability promises."""
_ATTRIBUTES = frozenset({"hf_config", "parallel_layout", "module"})


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
    # ``source_layout()``, ``megatron_convention()``, ``checkpoint_weights()``, ``parallel_layout``,
    # ``module``.
