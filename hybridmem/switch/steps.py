"""The steps a switch runs, and the order they run in.

[Note: step order]
TRAIN->INFER runs, in this order (only the steps that apply):

1. offload optimizer state  - the largest training state (12 bytes/param for fp32 Adam + master),
2. offload grads            - dead until the next backward; all-zero ones cost no copy,
3. resume engine weights    - allocate the engine's weight storage,
4. weight sync              - write the current training weights into it (needs training params
                              on the device, so it must come before step 5),
5. offload training params,
   then return the allocator's cached blocks to the device (``empty_cache``), so engines with their
   own allocator (vLLM's ``CuMemAllocator``) and other processes see the freed bytes,
6. resume KV cache          - last, so it can take everything the steps above freed,
7. agree                    - the ranks' vote, where the weight sync spans several ranks.

A training framework's transient buffers are dropped by a :class:`ReleaseBuffersStep` its adapter
registers where a :class:`BufferRelease` places it: FSDP2's before step 1 (:data:`FSDP_BUFFERS`),
Megatron's workspaces just before ``empty_cache`` (:data:`MEGATRON_WORKSPACES`).

The peak is therefore reached at step 4 (training params + engine weights + sync buffers, with the
optimizer state and grads already gone) or at step 6.

INFER->TRAIN releases first and onloads after:

1. release KV cache, 2. release engine weights (discarded, they are derived), 3. onload params,
4. onload grads, 5. onload optimizer state.

Every TRAIN->INFER step has an ``undo`` (offload <-> onload, resume <-> release, sync: nothing), so a
failure at step k undoes steps k..1 in reverse, step k included, from whatever part of it was done
(see [Note: switch transactions] in :mod:`hybridmem.switch.transaction`). INFER->TRAIN steps need no undo: if
one fails, the manager moves to FAILED and ``recover()`` re-runs the INFER->TRAIN steps, each of which is a
no-op when already done and finishes what an interrupted run left.
"""

from __future__ import annotations

import logging
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

from hybridmem.accel import Accelerator
from hybridmem.contract.engine import InferenceEngine, capabilities_of
from hybridmem.contract.kinds import KV_CACHE, WEIGHTS, StateKind
from hybridmem.errors import WeightCoverageError
from hybridmem.offload import Offloader, OffloadState
from hybridmem.switch.memplan import StepEstimate
from hybridmem.switch.phase import Direction
from hybridmem.weight_sync import WeightSync

__all__ = [
    "ToInferOrder",
    "ToTrainOrder",
    "StepResult",
    "SwitchStep",
    "OffloadStep",
    "OnloadStep",
    "EngineResumeStep",
    "EngineReleaseStep",
    "WeightSyncStep",
    "EmptyCacheStep",
    "ReleaseBuffersStep",
    "TransientBuffers",
    "BufferRelease",
    "FSDP_BUFFERS",
    "MEGATRON_WORKSPACES",
    "switch_steps",
]


log = logging.getLogger(__name__)

_WARNED_CASTS: weakref.WeakSet = weakref.WeakSet()
"""Weight syncs whose dtype cast was logged (once per sync, reported on every switch)."""


class ToInferOrder(IntEnum):
    """Sort keys of the TRAIN->INFER steps (see [Note: step order]); extensions pick values between."""

    OPTIMIZER = 10
    GRAD = 20
    ENGINE_WEIGHTS = 30
    WEIGHT_SYNC = 40
    PARAM = 50
    EMPTY_CACHE = 55
    KV_CACHE = 60
    AGREE = 100
    """The ranks' vote on the outcome, always last ([Note: switch agreement] in
    :mod:`hybridmem.switch.agreement`)."""


@dataclass(frozen=True, slots=True)
class BufferRelease:
    """Where a training framework's release of its transient device buffers runs in TRAIN->INFER."""

    name: str
    """The step's name in plans and reports."""
    order: int
    """Its sort key among the TRAIN->INFER steps (:class:`ToInferOrder`)."""


FSDP_BUFFERS = BufferRelease(name="release fsdp buffers", order=ToInferOrder.OPTIMIZER - 5)
"""FSDP2's unsharded parameters and communication buffers: first, so the weight sync reads the sharded
parameters ([Note: FSDP2 buffers in INFER] in :mod:`hybridmem.adapters.fsdp.state`)."""
MEGATRON_WORKSPACES = BufferRelease(name="release megatron workspaces", order=ToInferOrder.EMPTY_CACHE - 1)
"""Megatron's global memory buffer and cuBLAS workspaces: re-created lazily, so released last before the
allocator's cache is emptied."""


class ToTrainOrder(IntEnum):
    """Sort keys of the INFER->TRAIN steps (see [Note: step order])."""

    KV_CACHE = 10
    ENGINE_WEIGHTS = 20
    PARAM = 30
    GRAD = 40
    OPTIMIZER = 50


@dataclass(frozen=True, slots=True)
class StepResult:
    """What a step did, as the switch report shows it."""

    kind: StateKind | None = None
    copied_nbytes: int = 0
    """Bytes copied between host and device (or across ranks, for a weight sync)."""
    zero_nbytes: int = 0
    """Bytes released or re-created without a copy (all-zero grads)."""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)
    """Step-specific figures (e.g. a sync's bytes sent and received)."""


class SwitchStep(ABC):
    """One step of a switch.

    Attributes:
        name: Shown in plans and reports.
        kind: The memory kind the step moves.
    """

    name: str
    kind: StateKind | None
    commits: bool = False
    """Once this step ran, the switch is decided: a held signal no longer rolls it back (the ranks' vote,
    [Note: switch agreement] in :mod:`hybridmem.switch.agreement`)."""
    touches_training_tensors: bool = True
    """Whether the step may change which storages the training state's tensors hold (other than by an
    offloader's own offload or onload): after it, the offloaders find their storages anew ([Note:
    discovery within a switch] in :mod:`hybridmem.offload.base`). ``True`` unless a step says otherwise,
    so a step registered from outside is never trusted to leave them alone."""

    @abstractmethod
    def estimate(self) -> StepEstimate:
        """Device bytes the step will allocate, free and need transiently (for the memory plan)."""

    @abstractmethod
    def run(self) -> StepResult:
        """Do the step, recording each irreversible act before doing it (see [Note: switch
        transactions] in :mod:`hybridmem.switch.transaction`)."""

    def undo(self) -> None:  # noqa: B027 - optional: INFER->TRAIN steps have nothing to undo
        """Reverse :meth:`run` (rollback of TRAIN->INFER), whether it completed or was stopped at any
        point: the manager undoes the failed step too. Idempotent."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class OffloadStep(SwitchStep):
    """Offload an :class:`~hybridmem.offload.Offloader`; undo onloads."""

    touches_training_tensors = False

    def __init__(self, offloader: Offloader):
        self.offloader = offloader
        self.name = f"offload {offloader.owner}"
        self.kind = offloader.kind

    def estimate(self) -> StepEstimate:
        return StepEstimate(free_nbytes=self.offloader.live_nbytes(),
                            transient_nbytes=self.offloader.rehome_nbytes(),
                            host_alloc_nbytes=self.offloader.arena_growth_nbytes())

    def run(self) -> StepResult:
        s = self.offloader.offload()
        return StepResult(kind=self.kind, copied_nbytes=s.copied_nbytes,
                          zero_nbytes=s.zero_nbytes, seconds=s.seconds,
                          extra={"copy_s": s.copy_s, "free_s": s.device_memory_s})

    def undo(self) -> None:
        self.offloader.onload()


class OnloadStep(SwitchStep):
    """Onload an :class:`~hybridmem.offload.Offloader`; undo offloads."""

    touches_training_tensors = False

    def __init__(self, offloader: Offloader):
        self.offloader = offloader
        self.name = f"onload {offloader.owner}"
        self.kind = offloader.kind

    def estimate(self) -> StepEstimate:
        on_host = self.offloader.state is OffloadState.ON_HOST
        return StepEstimate(alloc_nbytes=self.offloader.live_nbytes() if on_host else 0)

    def run(self) -> StepResult:
        s = self.offloader.onload()
        return StepResult(kind=self.kind, copied_nbytes=s.copied_nbytes,
                          zero_nbytes=s.zero_nbytes, seconds=s.seconds,
                          extra={"copy_s": s.copy_s, "allocate_s": s.device_memory_s})

    def undo(self) -> None:
        self.offloader.offload()


def _engine_nbytes(engine: InferenceEngine, method: str, tag: str) -> int:
    return int(getattr(engine, method)(tag)) if capabilities_of(engine).reports_residency else 0


def _memory_extra(engine: InferenceEngine) -> dict:
    """Report extras of an engine whose release frees no memory (``frees_memory = False``, e.g. vLLM's
    CPU backend, which has no sleep mode), so a report never claims freed bytes it did not free."""
    caps = capabilities_of(engine)
    if caps.frees_memory:
        return {}
    return {"frees_memory": False, "note": caps.memory_note or "the engine frees no memory"}


_TAG_KIND = {WEIGHTS: StateKind.ENGINE_WEIGHTS, KV_CACHE: StateKind.KV_CACHE}


class EngineResumeStep(SwitchStep):
    """``engine.resume([tag])``; undo releases."""

    touches_training_tensors = False

    def __init__(self, engine: InferenceEngine, tag: str):
        self.engine = engine
        self.tag = tag
        self.name = f"resume engine {tag}"
        self.kind = _TAG_KIND[tag]

    def estimate(self) -> StepEstimate:
        return StepEstimate(alloc_nbytes=_engine_nbytes(self.engine, "planned_nbytes", self.tag))

    def run(self) -> StepResult:
        start = time.perf_counter()
        self.engine.resume([self.tag])
        return StepResult(kind=self.kind, seconds=time.perf_counter() - start,
                          extra=_memory_extra(self.engine))

    def undo(self) -> None:
        self.engine.release([self.tag])


class EngineReleaseStep(SwitchStep):
    """``engine.release([tag])``: the memory is discarded, not copied (see [Note: engine memory tags] in
    :mod:`hybridmem.contract.engine`)."""

    touches_training_tensors = False

    def __init__(self, engine: InferenceEngine, tag: str):
        self.engine = engine
        self.tag = tag
        self.name = f"release engine {tag}"
        self.kind = _TAG_KIND[tag]

    def estimate(self) -> StepEstimate:
        return StepEstimate(free_nbytes=_engine_nbytes(self.engine, "resident_nbytes", self.tag))

    def run(self) -> StepResult:
        start = time.perf_counter()
        freed = _engine_nbytes(self.engine, "resident_nbytes", self.tag)
        self.engine.release([self.tag])
        return StepResult(kind=self.kind, zero_nbytes=freed, seconds=time.perf_counter() - start,
                          extra=_memory_extra(self.engine))

    def undo(self) -> None:
        self.engine.resume([self.tag])


class WeightSyncStep(SwitchStep):
    """Run a :class:`~hybridmem.weight_sync.WeightSync` and fail with ``WeightCoverageError`` when it left
    engine tensors unwritten ([Note: weight coverage] in :mod:`hybridmem.weight_sync`); nothing to undo (the
    engine weights are released by the undo of the engine-weights resume)."""

    touches_training_tensors = False

    name = "weight sync"
    kind = StateKind.ENGINE_WEIGHTS

    def __init__(self, sync: WeightSync, engine: InferenceEngine | None = None):
        self.sync = sync
        self.engine = engine

    def estimate(self) -> StepEstimate:
        return StepEstimate(transient_nbytes=self.sync.temp_nbytes())

    def run(self) -> StepResult:
        s = self.sync.sync()
        if s.unwritten:  # [Note: weight coverage] in :mod:`hybridmem.weight_sync`
            raise WeightCoverageError(list(s.unwritten))
        committed: dict = {}
        if self.engine is not None and capabilities_of(self.engine).stages_weights:
            # an engine in its own process takes the staged
            committed = dict(self.engine.commit_weights() or {})
        # [Note: no silent dtype change] in :mod:`hybridmem.weight_sync.base`
        if s.dtype_note and self.sync not in _WARNED_CASTS:
            log.warning("hybridmem: %s; the engine's weights differ from the trainer's by that rounding "
                        "(build the engine in the trainer's dtype to get them bit for bit)", s.dtype_note)
            _WARNED_CASTS.add(self.sync)
        return StepResult(
            kind=self.kind,
            copied_nbytes=s.received_nbytes,
            seconds=s.seconds,
            extra={
                "num_tensors": s.num_tensors,
                "sent_nbytes": s.sent_nbytes,
                "received_nbytes": s.received_nbytes,
                "min_received_nbytes": s.min_received_nbytes,
                "engine_nbytes": s.engine_nbytes,
                "temp_peak_nbytes": s.temp_peak_nbytes,
                "coverage_checked": s.coverage_checked,
                **({"route": s.route} if s.route else {}),
                **({"note": "; ".join(n for n in (s.route, s.dtype_note) if n)}
                   if s.route or s.dtype_note else {}),
                **committed,
            },
        )


class EmptyCacheStep(SwitchStep):
    """Return the caching allocator's free blocks to the device; nothing to undo."""

    touches_training_tensors = False

    name = "empty cache"
    kind = None

    def __init__(self, accel: Accelerator):
        self.accel = accel

    def estimate(self) -> StepEstimate:
        return StepEstimate()

    def run(self) -> StepResult:
        start = time.perf_counter()
        self.accel.empty_cache()
        return StepResult(seconds=time.perf_counter() - start)


def switch_steps(direction: Direction, *, offloaders: Mapping[StateKind, Offloader],
                 enabled: Mapping[StateKind, bool],
                 accel: Accelerator, engine: InferenceEngine | None, weight_sync: WeightSync | None,
                 extra: Iterable[tuple[int, SwitchStep]] = (), agree: SwitchStep | None = None,
                 engine_tags_stay: frozenset[str] = frozenset()) -> list[SwitchStep]:
    """The steps of a switch in ``direction``, in order (see [Note: step order]): offloading (onloading)
    the enabled kinds, emptying the allocator cache, the engine's tags and the weight sync, the
    ``(order, step)`` pairs registered by adapters, sorted by :class:`ToInferOrder` / :class:`ToTrainOrder`,
    and, last in TRAIN->INFER, ``agree``: the ranks' vote of a multi-rank switch ([Note: switch agreement]
    in :mod:`hybridmem.switch.agreement`). The engine's ``engine_tags_stay`` are neither released nor resumed
    (they stay resident through TRAIN: [Note: lora base] in :mod:`hybridmem.switch.lora_base`)."""
    items: list[tuple[int, SwitchStep]] = []
    kinds = [k for k in (StateKind.OPTIMIZER, StateKind.GRAD, StateKind.PARAM)
             if k in offloaders and enabled.get(k)]
    if direction is Direction.TO_INFER:
        items += [(ToInferOrder[k.name], OffloadStep(offloaders[k])) for k in kinds]
        items.append((ToInferOrder.EMPTY_CACHE, EmptyCacheStep(accel)))
        if engine is not None:
            if WEIGHTS not in engine_tags_stay:
                items.append((ToInferOrder.ENGINE_WEIGHTS, EngineResumeStep(engine, WEIGHTS)))
            if weight_sync is not None:
                items.append((ToInferOrder.WEIGHT_SYNC, WeightSyncStep(weight_sync, engine)))
            if KV_CACHE not in engine_tags_stay:
                items.append((ToInferOrder.KV_CACHE, EngineResumeStep(engine, KV_CACHE)))
        if agree is not None:
            items.append((ToInferOrder.AGREE, agree))
    else:
        items += [(ToTrainOrder[k.name], OnloadStep(offloaders[k])) for k in kinds]
        if engine is not None:
            if KV_CACHE not in engine_tags_stay:
                items.append((ToTrainOrder.KV_CACHE, EngineReleaseStep(engine, KV_CACHE)))
            if WEIGHTS not in engine_tags_stay:
                items.append((ToTrainOrder.ENGINE_WEIGHTS, EngineReleaseStep(engine, WEIGHTS)))
    items += list(extra)
    return [step for _, step in sorted(items, key=lambda item: item[0])]


class TransientBuffers(Protocol):
    """Device buffers a training framework re-creates on its own (see :class:`ReleaseBuffersStep`)."""

    def nbytes(self) -> int:
        """Device bytes they hold now."""

    def release(self) -> int:
        """Drop them; returns the device bytes they held."""


class ReleaseBuffersStep(SwitchStep):
    """TRAIN->INFER step dropping a training framework's transient buffers; no undo, since the framework
    re-creates them when it needs them (the placements: :data:`FSDP_BUFFERS`, :data:`MEGATRON_WORKSPACES`)."""

    def __init__(self, buffers: TransientBuffers, placement: BufferRelease):
        self.buffers = buffers
        self.placement = placement
        self.name = placement.name
        self.kind = None

    def estimate(self) -> StepEstimate:
        return StepEstimate(free_nbytes=self.buffers.nbytes())

    def run(self) -> StepResult:
        start = time.perf_counter()
        nbytes = self.buffers.release()
        return StepResult(zero_nbytes=nbytes, seconds=time.perf_counter() - start,
                          extra={"released_nbytes": nbytes})
