"""The contract between hybridmem and an inference engine.

An engine is any object with the three methods of :class:`InferenceEngine`; hybridmem wraps third-party
engines (vLLM) in adapters that implement it, and ships engines of its own
(:class:`hybridmem.engines.TorchCopyEngine`, the embedded ``ReferenceEngine``).

[Note: engine memory tags]
An engine's device memory is split by tag, as vLLM's sleep mode splits it:

- ``"weights"``: the model weights in the engine's own (inference) layout. They are always derivable
  from the training weights, so ``release(["weights"])`` discards them (no host copy) and every
  TRAIN->INFER switch resumes the storage and writes fresh weights into it.
- ``"kv_cache"``: the paged KV cache. Its contents are dead once generation ends, so release discards
  and resume re-allocates without copying anything.

``resume`` must be all-or-nothing: if it fails halfway it gives back what it took and re-raises, so
the switch's rollback sees the engine exactly as before the call. ``release`` must free every storage
of a tag whatever state the engine believes the tag is in: a rollback calls it after a resume that was
interrupted at any point (see [Note: switch transactions] in :mod:`hybridmem.switch.transaction`).

[Note: engine capabilities]
What an engine can do beyond the three methods is declared, not probed: an engine's ``capabilities``
attribute is an EngineCapabilities, and every caller (the steps, the weight syncs, the residency
report) reads capabilities_of(engine). A declared capability whose method is missing is a TypeError
naming both, raised when the manager is built. An engine that declares nothing (a third-party object
implementing the protocol) gets its capabilities read once from the methods it has.

Three of them decide how a resharding sync (``hybridmem.weight_sync.ReshardSync``) hands the engine its
weights, in this order: ``writes_in_place`` (into the engine's own tensors), ``streams_layout`` (complete
tensors of the engine's own layout, one at a time, into ``load_layout_weights``), else full HF-named
tensors of its pipeline stage into ``load_weights``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from hybridmem.contract.capabilities import declared_capabilities
from hybridmem.contract.kinds import ENGINE_TAGS
from hybridmem.errors import ConfigError

__all__ = ["InferenceEngine", "EngineCapabilities", "capabilities_of", "check_kv_utilization", "check_tags"]


@runtime_checkable
class InferenceEngine(Protocol):
    """What ShardingManager needs from an inference engine.

    Everything else an engine offers (its residency, in-place weights, weight coverage, the model it
    serves, its layout, how its KV pool was sized, ...) is declared by an :class:`EngineCapabilities` on
    its ``capabilities`` attribute, each flag naming the members it promises (see [Note: engine
    capabilities]).
    """

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(name, tensor)`` pairs into the engine's weights (storage must be resumed)."""

    def release(self, tags: Sequence[str]) -> None:
        """Give back the device memory of ``tags`` (see [Note: engine memory tags])."""

    def resume(self, tags: Sequence[str]) -> None:
        """Take back the device memory of ``tags``; all-or-nothing."""


_METHODS = {
    "writes_in_place": ("named_parameters",),
    "streams_layout": ("load_layout_weights",),
    "offers_layout_targets": ("layout_target",),
    "reports_weight_coverage": ("unwritten_weights",),
    "reports_residency": ("resident_nbytes", "planned_nbytes"),
    "binds_phase": ("bind_phase",),
    "stages_weights": ("commit_weights",),
    "checks_weights": ("check_weights",),
    "describes_decoder": ("spec",),
    "describes_weights": ("vocab_size", "dtype"),
    "reports_model_type": ("model_type",),
    "reports_quantization": ("quantization_config",),
    "reports_layout": ("parallel_layout",),
    "sizes_kv_by_share": ("gpu_memory_utilization",),
    "holds_buffers": ("buffer_nbytes",),
}
"""The members each capability promises (methods, or the attributes in :data:`_ATTRIBUTES`)."""
_ATTRIBUTES = frozenset({"spec", "vocab_size", "dtype", "model_type", "quantization_config",
                         "parallel_layout", "gpu_memory_utilization"})


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineCapabilities:
    """What an engine declares it can do (see [Note: engine capabilities])."""

    frees_memory: bool = True
    """``release`` gives device memory back (False: vLLM's CPU backend, which has no sleep mode)."""
    memory_note: str = ""
    """What ``release`` does to device memory, in words, when it frees none (for switch reports)."""
    writes_in_place: bool = False
    """``named_parameters()`` gives the engine's own weight tensors, which a resharding sync may write."""
    streams_layout: bool = False
    """``load_layout_weights(weights)`` takes this rank's tensors of the engine's own layout (the vLLM layout
    its ``parallel_layout`` describes: per-rank TP shards, fused ``qkv_proj``/``gate_up_proj``, vLLM names) as
    a stream of ``(name, tensor)``, each complete and yielded once; a tensor is valid only until the next one
    is requested (the engine copies it out). A resharding sync then holds only the tensors in flight, never a
    copy of the whole model ([Note: layout streams] in :mod:`hybridmem.reshard.execute`)."""
    offers_layout_targets: bool = False
    """With ``streams_layout``: while ``load_layout_weights`` reads its stream, ``layout_target(name, shape,
    dtype)`` gives the engine's memory to build the stream's next tensor in (the part of a transfer bucket it
    will be sent from), or ``None``; a tensor built there is handed over without a copy. The engine only reads
    the stream's tensors, so a tensor that lies whole in one training tensor is handed over as that tensor."""
    reports_weight_coverage: bool = False
    """``unwritten_weights()`` lists weights ``load_weights`` has not written since they were resumed."""
    reports_residency: bool = False
    """``resident_nbytes(tag)`` / ``planned_nbytes(tag)`` give its device bytes per tag."""
    releases_kv_alone: bool = False
    """``release(["kv_cache"])`` leaves the weights resident, in place and with their values (False: vLLM's
    sleep mode, which unmaps every pool at once); a LoRA base kept on the device needs it to free the KV cache
    in TRAIN ([Note: lora base] in :mod:`hybridmem.switch.lora_base`)."""
    keeps_addresses: bool = False
    """Weight tensors keep their device addresses across ``release``/``resume`` (CuMemAllocator re-maps)."""
    loads_training_names: bool = False
    """``load_weights`` takes the training model's own names and layout (a copy of the module)."""
    binds_phase: bool = False
    """``bind_phase(phase)`` takes the manager's phase, named when the engine refuses work."""
    stages_weights: bool = False
    """What a weight sync writes is staged, and ``commit_weights()`` hands it to the engine (an engine in its
    own process); the weight-sync step calls it after the sync."""
    checks_weights: bool = False
    """``check_weights(expected, what=)`` refuses, before any move, a layout its own weights do not match (the
    resharding sync hands it the tensors it will write)."""
    describes_decoder: bool = False
    """``spec``: the :class:`~hybridmem.reshard.ModelSpec` it serves, checked against the training
    model's config when the manager is built (:mod:`hybridmem.switch.architecture`)."""
    describes_weights: bool = False
    """``vocab_size`` and ``dtype``: its vocabulary (a padded training vocab is cut to it) and weight dtype
    (named when the wire dtype differs)."""
    reports_model_type: bool = False
    """``model_type``: the HF family it serves (a training state that takes the engine's family reads it)."""
    reports_quantization: bool = False
    """``quantization_config``: how it holds its weights, as an HF config's ``quantization_config`` (a
    dict; ``None``: unquantized, in ``dtype``). A resharding sync into an engine that reports FP8 with
    128x128 blocks hands it quantized weights with their scales ([Note: fp8 sync] in
    :mod:`hybridmem.weight_sync.fp8`); any other quantization is refused when the manager is built."""
    reports_layout: bool = False
    """``parallel_layout``: the TP/PP/EP it runs at (unset layout keys of the config are read from it)."""
    sizes_kv_by_share: bool = False
    """``gpu_memory_utilization``: the share of device memory its KV pool was sized for (``None``: sized by a
    block count), checked against the config's (:func:`check_kv_utilization`)."""
    holds_buffers: bool = False
    """``buffer_nbytes()``: bytes of the trainer's device (host RAM on CPU) the engine holds in the trainer's
    process in both phases (an engine in its own process: its transfer buckets); the residency report and
    the memory plan count them as the owner ``"engine buckets"``."""


def capabilities_of(engine: Any) -> EngineCapabilities:
    """The engine's declared :class:`EngineCapabilities`, or, when it declares none, what its methods offer.

    Raises:
        TypeError: The engine declares a capability whose method it lacks (naming both).
    """
    declared = declared_capabilities(engine, EngineCapabilities, _METHODS, what="engine", has=_has_member,
                                     attributes=_ATTRIBUTES)
    if declared is not None:
        return declared
    has = {c: all(_has_member(engine, m) for m in ms) for c, ms in _METHODS.items()}
    frees = bool(getattr(engine, "frees_memory", True))
    return EngineCapabilities(frees_memory=frees, memory_note=str(getattr(engine, "memory_note", "") or ""),
                              loads_training_names=bool(getattr(engine,
                                                                "loads_training_names", False)), **has)


def _has_member(engine: Any, name: str) -> bool:
    if name in _ATTRIBUTES:
        return hasattr(engine, name)
    return callable(getattr(engine, name, None))


def check_kv_utilization(engine: Any, config: Any) -> None:
    """Refuse an engine whose KV pool was not sized by ``config.gpu_memory_utilization``.

    The KV pool is sized where the engine is built (vLLM measures free memory then; the
    ``ReferenceEngine`` with ``kv_utilization=``), so the config's value takes effect there and this
    check makes sure both agree. Nothing is checked when the key is ``None`` or the engine does not say
    how its pool was sized (``sizes_kv_by_share`` not declared, e.g. ``TorchCopyEngine``).

    Raises:
        ConfigError: The engine's pool was sized for another share, or by a block count.
    """
    want = getattr(config, "gpu_memory_utilization", None)
    if want is None or engine is None or not capabilities_of(engine).sizes_kv_by_share:
        return
    have = engine.gpu_memory_utilization
    if have is None:
        raise ConfigError(
            "gpu_memory_utilization", want,
            f"null (unset), because the {type(engine).__name__} sized its KV pool by a block count; or build "
            f"it with the same share (ReferenceEngine(..., kv_utilization={want}))",
        )
    if abs(float(have) - float(want)) > 1e-9:
        raise ConfigError(
            "gpu_memory_utilization", want,
            f"{have}, the share the {type(engine).__name__} was built with (build the engine with {want}, or "
            f"set the key to {have} or null)",
        )


def check_tags(tags: Sequence[str]) -> list[str]:
    """Validate engine memory tags; raises ``ValueError`` naming a bad one."""
    if isinstance(tags, str):
        raise TypeError(f"tags must be a sequence of tags, got the string {tags!r}; use [{tags!r}]")
    for tag in tags:
        if tag not in ENGINE_TAGS:
            raise ValueError(f"unknown engine memory tag {tag!r}; expected one of {ENGINE_TAGS}")
    return list(tags)
