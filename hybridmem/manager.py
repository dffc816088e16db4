"""ShardingManager: switches an actor between TRAIN and INFER on the same devices.

>>> manager = ShardingManager(model, engine, optimizer=opt, config=HybridConfig())   # doctest: +SKIP
>>> with manager.inference() as engine:                                               # doctest: +SKIP
...     outputs = engine.generate(prompts)

The manager is a facade over modules with one job each: the parts built from what the user passed
(:mod:`hybridmem.parts`), the steps of a switch and their order (:mod:`hybridmem.switch.steps`, [Note: step
order] in :mod:`hybridmem.switch.steps`), the transaction that runs them, its journal and rollback with
signals held (:mod:`hybridmem.switch.transaction`, [Note: switch transactions] in
:mod:`hybridmem.switch.transaction`), who holds device memory and the memory plan's budget
(:mod:`hybridmem.switch.owners`), co-resident models (:mod:`hybridmem.switch.colocate`), the state machine
(:mod:`hybridmem.switch.machine`) and the mechanism that moves bytes (:mod:`hybridmem.offload`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hybridmem.accel import Accelerator, MemoryFigures, get_accelerator
from hybridmem.config import HybridConfig, LoraBase
from hybridmem.contract.engine import (
    InferenceEngine,
    capabilities_of,
    check_kv_utilization,
)
from hybridmem.contract.kinds import KV_CACHE, WEIGHTS, StateKind
from hybridmem.contract.training import TrainingState, training_capabilities_of
from hybridmem.errors import (
    MemoryPlanError,
    PhaseError,
    SwitchError,
    add_note,
    switch_error,
)
from hybridmem.offload import Offloader, OffloadState
from hybridmem.offload.host_pool import HostBufferPool
from hybridmem.parts import resolve_layouts, training_state_of
from hybridmem.switch.agreement import AgreeStep, SwitchAgreement, is_collective_loss
from hybridmem.switch.architecture import check_architecture
from hybridmem.switch.claims import Claims
from hybridmem.switch.colocate import CoResident, CoResidentState
from hybridmem.switch.guards import TrainingGuard
from hybridmem.switch.lora_base import (
    engine_tags_stay,
    hold_engine_weights,
    keep_frozen_on_device,
    lora_base_of,
    share_with_engine,
)
from hybridmem.switch.machine import PhaseMachine, Trigger, wrong_phase
from hybridmem.switch.memplan import MemoryPlan, StepEstimate
from hybridmem.switch.owners import DeviceOwners
from hybridmem.switch.phase import Direction, Phase
from hybridmem.switch.prewarm import ArenaPrewarmer
from hybridmem.switch.report import SwitchReport
from hybridmem.switch.residency import ResidencyReport
from hybridmem.switch.steps import SwitchStep, WeightSyncStep, switch_steps
from hybridmem.switch.transaction import HeldSignals, SwitchRun, roll_back, run_steps
from hybridmem.weight_sync import WeightSync, default_weight_sync

__all__ = ["ShardingManager"]

log = logging.getLogger(__name__)

def _weak_phase(manager: ShardingManager) -> Callable[[], Phase]:
    """``manager.phase`` without keeping the manager alive: an engine outlives the managers built on it
    ([Note: one manager per model] in :mod:`hybridmem.switch.claims`); ``CLOSED`` once the manager is gone."""
    ref = weakref.ref(manager)

    def phase() -> Phase:
        me = ref()
        return Phase.CLOSED if me is None else me.phase

    return phase


def _release_frames(error: BaseException | None) -> None:
    """Drop the locals of the finished frames ``error`` (and its causes) carry: a failed weight sync's posted
    works and staging buffers would otherwise live until the cycle collector runs, and a process group
    re-created after the error could meet them in its first exchange. The traceback's lines stay."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _caller() -> str:
    """``file:line`` of the innermost frame outside hybridmem."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


class ShardingManager:
    """Switches one actor (training state + inference engine) between TRAIN and INFER.

    Args:
        model: The training model: a ``torch.nn.Module`` (with ``fully_shard`` applied or not; an FSDP2
            model gets :class:`~hybridmem.adapters.fsdp.FSDPTrainingState`), a list of module chunks, or
            an object implementing :class:`~hybridmem.contract.training.TrainingState` (e.g. the Megatron
            adapter).
        engine: The inference engine (see :class:`~hybridmem.contract.engine.InferenceEngine`), or
            ``None`` to only offload training state.
        optimizer: The optimizer(s) whose state to offload (plain PyTorch models only; adapters carry
            their own).
        config: Offload switches, layouts and budgets; defaults to ``HybridConfig()``.
        accel: The accelerator; defaults to ``config.device``.
        weight_sync: How training weights reach the engine; defaults to
            :func:`~hybridmem.weight_sync.default_weight_sync`: resharding from the training layout to the
            engine's when the model's spec is known (``model_spec``, a transformers model's ``config``, or
            the training state's ``model_spec_dict()``), else streaming what a checkpoint of the model
            holds into ``engine.load_weights`` (layouts must then be equal).
        model_spec: The model's :class:`~hybridmem.reshard.ModelSpec` or HF-style config, for resharding.
        group: The process group spanning both layouts (``None``: the default group).

    Raises:
        ConfigError: ``config.gpu_memory_utilization`` is set and the engine's KV pool was sized for
            another share (:func:`~hybridmem.engines.check_kv_utilization`).

    Call order: construct in TRAIN (training state on the device; an engine still holding memory has it
    released here); then alternate :meth:`to_infer` / :meth:`to_train`, or use :meth:`inference` as a
    context manager.
    """

    def __init__(
        self,
        model: Any,
        engine: InferenceEngine | None = None,
        *,
        optimizer: Any = None,
        config: HybridConfig | None = None,
        accel: Accelerator | str | None = None,
        weight_sync: WeightSync | None = None,
        model_spec: Any = None,
        group: Any = None,
    ):
        config = HybridConfig() if config is None else config
        if not isinstance(config, HybridConfig):
            raise TypeError(f"config must be a HybridConfig, got {type(config).__name__}")
        self.accel = get_accelerator(config.device if accel is None else accel)
        self.training: TrainingState = training_state_of(model, optimizer)
        self.training_capabilities = training_capabilities_of(self.training)
        """What the training state declares it offers ([Note: training capabilities] in
        :mod:`hybridmem.contract.training`); checked here."""
        if engine is not None and not isinstance(engine, InferenceEngine):
            missing = [m for m in ("load_weights", "release", "resume")
                       if not callable(getattr(engine, m, None))]
            raise TypeError(f"engine {type(engine).__name__} does not implement InferenceEngine: missing "
                            f"{missing}")
        self._machine = PhaseMachine()
        self.created_at = _caller()
        """``file:line`` of the user's code that built this manager (named when another manager is
        refused)."""
        self._claims: Claims | None = None
        """What this manager holds alone ([Note: one manager per model] in :mod:`hybridmem.switch.claims`)."""
        try:
            self._build(config, engine, weight_sync=weight_sync, model_spec=model_spec, group=group)
        except BaseException:
            if self._claims is not None:
                self._claims.release()  # a manager that was never built holds nothing
            raise

    def _claimed(self, engine: InferenceEngine | None) -> list[tuple[str, Any]]:
        """The objects this manager moves or drives, each named for an error ([Note: one manager per model] in
        :mod:`hybridmem.switch.claims`)."""
        named: list[tuple[str, Any]] = [(f"training state {type(self.training).__name__}", self.training)]
        if self.training_capabilities.guards_misuse:
            modules, optimizers = self.training.guard_targets()
            for i, module in enumerate(modules):
                where = type(module).__name__ if len(modules) == 1 else f"{type(module).__name__} (chunk {i})"
                named.append((f"model {where}", module))
                named += [(f"parameter {name!r} of {where}", p) for name, p in module.named_parameters()]
            named += [(f"optimizer {type(o).__name__}", o) for o in optimizers]
        if engine is not None:
            named.append((f"engine {type(engine).__name__}", engine))
        return named

    def _build(self, config: HybridConfig, engine: InferenceEngine | None, *, weight_sync: WeightSync | None,
               model_spec: Any, group: Any) -> None:
        self.config = resolve_layouts(config, self.training, engine)
        """The config, its layout keys resolved from the parts (see [Note: layouts from the parts] in
        :mod:`hybridmem.parts`)."""
        check_kv_utilization(engine, self.config)
        self.engine = engine
        self.engine_capabilities = capabilities_of(engine) if engine is not None else None
        """What the engine declares it can do ([Note: engine capabilities] in
        :mod:`hybridmem.contract.engine`); checked against its methods here."""
        self.pool = HostBufferPool(
            self.accel, budget_nbytes=self.config.host_memory_budget_bytes, pin=self.config.pin_memory
        )
        self.offloaders: dict[StateKind, Offloader] = dict(
            self.training.build_offloaders(self.accel, self.pool, self.config))
        self._enabled = {
            StateKind.PARAM: self.config.offload_train_param,
            StateKind.GRAD: self.config.offload_train_grad,
            StateKind.OPTIMIZER: self.config.offload_train_optimizer,
        }
        if weight_sync is None and engine is not None:
            check_architecture(self.training, engine, model_spec=model_spec)
            weight_sync = default_weight_sync(self.training, engine, self.config,
                                              model_spec=model_spec, group=group)
        self.weight_sync = weight_sync
        self.lora_base = lora_base_of(weight_sync, self.config)
        """Where a LoRA model's base stays when only its adapters are synced; ``None`` otherwise ([Note: lora
        base] in :mod:`hybridmem.switch.lora_base`)."""
        self.engine_tags_stay = engine_tags_stay(self.lora_base, engine)
        """The engine's tags that stay on the device through TRAIN ([Note: lora base] in
        :mod:`hybridmem.switch.lora_base`)."""
        if self.lora_base is not None:
            keep_frozen_on_device(self.offloaders)
        collective = weight_sync.collective() if weight_sync is not None else None
        self.agreement = (SwitchAgreement(collective[0], deadline_s=collective[1], device=self.accel.device)
                          if collective is not None else None)
        """The ranks' vote ending each multi-rank TRAIN->INFER switch ([Note: switch agreement] in
        :mod:`hybridmem.switch.agreement`)."""
        self._extra_steps: dict[Direction, list[tuple[int, SwitchStep]]] = {d: [] for d in Direction}
        # Everything above only checks and reads; from here on the parts are changed (hooks, the engine's
        # memory), so they must be this manager's alone ([Note: one manager per model] in
        # :mod:`hybridmem.switch.claims`).
        self._claims = Claims(self, self._claimed(engine))
        guards = self.training_capabilities.guards_misuse
        modules, optimizers = self.training.guard_targets() if guards else ([], [])
        self.shared_base = None
        """What ``lora_base="shared"`` made views of the engine's weights
        (:func:`~hybridmem.weight_sync.shared_base.share_base`)."""
        hold_engine_weights(engine, self.engine_tags_stay)
        if self.lora_base is LoraBase.SHARED:
            self.shared_base = share_with_engine(self.training, engine, weight_sync)
        self._guard = TrainingGuard(_weak_phase(self), modules, optimizers, owner=self)
        """Refuses use of the training model outside TRAIN (see [Note: misuse guards] in
        :mod:`hybridmem.switch.guards`)."""
        if self.engine_capabilities is not None and self.engine_capabilities.binds_phase:
            engine.bind_phase(_weak_phase(self))
        self.coresidents: dict[str, CoResident] = {}
        """Co-resident models by name (see [Note: co-resident phases] in :mod:`hybridmem.switch.colocate`)."""
        self.owners = DeviceOwners(self.accel, self.offloaders, self._enabled, engine, self.coresidents,
                                   self.config.device_memory_budget_bytes,
                                   engine_tags_stay=self.engine_tags_stay)
        """Device bytes by owner, residency and the memory plan's budget (:mod:`hybridmem.switch.owners`)."""
        self.last_reports: dict[Direction, SwitchReport] = {}
        """The latest report of each direction."""
        self.last_report: SwitchReport | None = None
        """The latest report of any direction."""
        self.last_rollbacks = 0
        """TRAIN->INFER attempts of the latest :meth:`inference` that failed and were rolled back."""
        if self.training_capabilities.attaches_itself:
            self.training.attach(self)  # FSDP2: its buffer release step and residency owner
        self._release_engine_memory()
        self.prewarmer = (ArenaPrewarmer(self.pool, self.offloaders, self._enabled, optimizers)
                          if self.config.prewarm_host_buffers else None)
        """Allocates the host arenas in the background ([Note: prewarmed arenas] in
        :mod:`hybridmem.offload.host_pool`)."""

    def _release_engine_memory(self) -> None:
        """The manager starts in TRAIN, where the engine holds no memory: an engine handed over awake (a
        ``ReferenceEngine`` is built so) has its weights and KV cache released now; they are derived
        state, rewritten by every TRAIN->INFER switch."""
        if self.engine_capabilities is None or not self.engine_capabilities.reports_residency:
            return
        awake = [tag for tag in (KV_CACHE, WEIGHTS) if self.engine.resident_nbytes(tag)
                 and tag not in self.engine_tags_stay]
        if awake:
            log.info("hybridmem: releasing the engine's %s (the manager starts in TRAIN)", awake)
            self.engine.release(awake)

    # Introspection --------------------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        """The current :class:`~hybridmem.switch.phase.Phase`."""
        return self._machine.phase

    def register_step(self, direction: Direction, step: SwitchStep, order: int) -> None:
        """Add a step to every later switch of ``direction``, sorted by ``order`` among the built-in
        steps (:class:`~hybridmem.switch.steps.ToInferOrder` /
        :class:`~hybridmem.switch.steps.ToTrainOrder`)."""
        self._check_phase("register a step", Phase.TRAIN)
        self._extra_steps[Direction(direction)].append((int(order), step))

    def register_owner(self, name: str, resident_nbytes: Callable[[], int], *,
                       empty_in: tuple[Phase, ...] = ()) -> None:
        """Count ``resident_nbytes()`` as owner ``name`` in residency reports; a leftover in ``empty_in``."""
        self.owners.register(name, resident_nbytes, empty_in=empty_in)

    def steps(self, direction: Direction) -> list[SwitchStep]:
        """The steps a switch in ``direction`` runs now, in order (see [Note: step order] in
        :mod:`hybridmem.switch.steps`)."""
        direction = Direction(direction)
        agree = AgreeStep(self.agreement) if self.agreement is not None else None
        return switch_steps(direction, offloaders=self.offloaders, enabled=self._enabled, accel=self.accel,
                            engine=self.engine, weight_sync=self.weight_sync,
                            extra=self._extra_steps[direction],
                            agree=agree, engine_tags_stay=self.engine_tags_stay)

    def memory(self) -> MemoryFigures:
        """Device memory figures now (on CPU, "allocated" is the sum over known owners)."""
        return self.owners.memory()

    def residency(self) -> ResidencyReport:
        """Device bytes by owner now; owners that should be empty in the current phase are flagged."""
        return self.owners.residency(self.phase)

    def plan(self, direction: Direction, steps: list[SwitchStep] | None = None) -> MemoryPlan:
        """The predicted memory curve of a switch in ``direction`` from the current state."""
        direction = Direction(direction)
        steps = self.steps(direction) if steps is None else steps
        return self.owners.plan(direction, [(s.name, s.estimate()) for s in steps])

    # Co-resident models ---------------------------------------------------------------------------
    def add_coresident(self, name: str, model: Any) -> CoResident:
        """Register a second model sharing the devices (e.g. the reference policy) and offload it.

        It stays in host arenas except inside :meth:`onloaded` (see [Note: co-resident phases] in
        :mod:`hybridmem.switch.colocate`).

        Raises:
            PhaseError: Not in TRAIN.
            ValueError: ``name`` is taken by another owner.
        """
        self._check_phase(f"add co-resident {name!r}", Phase.TRAIN)
        taken = self.owners.nbytes()
        if name in taken:
            raise ValueError(f"owner name {name!r} is already taken; taken: {sorted(taken)}")
        co = CoResident(name, model, self.accel, self.pool)
        co.offload()
        self.coresidents[name] = co
        return co

    @contextlib.contextmanager
    def onloaded(self, name: str) -> Iterator[torch.nn.Module]:
        """Onload co-resident ``name`` for the body, offload it after (also on an exception).

        Yields:
            The model (its first chunk when there are several).

        Raises:
            KeyError: No co-resident of that name.
            PhaseError: Not in TRAIN or INFER, or ``name`` is already onloaded.
            MemoryPlanError: Its weights do not fit beside what is resident now; nothing was moved.
        """
        if name not in self.coresidents:
            raise KeyError(f"no co-resident named {name!r}; registered: {sorted(self.coresidents)}")
        co = self.coresidents[name]
        self._check_phase(f"onload co-resident {name!r}", Phase.TRAIN, Phase.INFER)
        if co.state is CoResidentState.ONLOADED:
            raise PhaseError(f"onload co-resident {name!r}", self.phase,
                             "it is already onloaded (nested onloaded())")
        direction = Direction.TO_INFER if self.phase is Phase.INFER else Direction.TO_TRAIN
        plan = self.owners.plan(direction, [(f"onload {name}", StepEstimate(alloc_nbytes=co.live_nbytes()))])
        if not plan.fits:
            raise MemoryPlanError(plan)
        co.onload()
        try:
            yield co.module
        finally:
            co.offload()

    # Switches -------------------------------------------------------------------------------------
    def to_infer(self) -> SwitchReport:
        """Switch TRAIN -> INFER.

        Returns:
            The switch's report (also in :attr:`last_report`).

        Raises:
            PhaseError: Not in TRAIN.
            MemoryPlanError: The predicted peak exceeds the device budget; nothing was done.
            SwitchError: A step raised; the done steps were undone and the manager is in TRAIN. A
                :class:`~hybridmem.errors.HostMemoryBudgetError`, ``WeightSyncError`` or ``KVResumeError``
                of a step is raised as a ``SwitchError`` that is also of that class (see
                :func:`~hybridmem.errors.switch_error`).
            RollbackError: Undoing failed too; the manager is in FAILED (call :meth:`recover`).
        """
        self._check_coresidents_offloaded("switch to INFER")
        with HeldSignals() as held:
            held.on_signal = lambda: self._signal_outcome(Direction.TO_INFER)
            with self._discovery_held():
                report = self._to_infer(held)
        if report is None:  # a held signal stopped the switch and its handler did not raise
            raise SwitchError(
                "TRAIN->INFER interrupted by a signal; rolled back, phase is TRAIN with all training state "
                "on the device", direction="to_infer", step="(between steps)", phase_after=self.phase,
            )
        return report

    @contextlib.contextmanager
    def _discovery_held(self) -> Iterator[None]:
        """Within one switch, each offloader finds its storages once per state ([Note: discovery within a
        switch] in :mod:`hybridmem.offload.base`)."""
        with contextlib.ExitStack() as stack:
            for offloader in self.offloaders.values():
                stack.enter_context(offloader.discovery_held())
            yield

    def _forget_discovery(self) -> None:
        for offloader in self.offloaders.values():
            offloader.forget_discovery()

    def _to_infer(self, held: HeldSignals) -> SwitchReport | None:
        self._machine.fire(Trigger.BEGIN_INFER, operation="switch to INFER")
        steps = self.steps(Direction.TO_INFER)
        try:
            plan = self.plan(Direction.TO_INFER, steps)
            if not plan.fits:
                raise MemoryPlanError(plan)
        except BaseException:
            self._machine.fire(Trigger.BEGIN_ROLLBACK, operation="refuse the switch")
            self._machine.fire(Trigger.END_ROLLBACK, operation="refuse the switch")
            raise
        start = time.perf_counter()
        before = self.memory()
        run = run_steps(Direction.TO_INFER, steps, before=before, held=held,
                        accel=self.accel, memory=self.memory,
                        touched=self._forget_discovery)
        if run.error is not None or run.interrupted:
            self._vote_no(run)
            _release_frames(run.error)
            roll_back(run, machine=self._machine, guard=self._guard)
            return None
        self._machine.fire(Trigger.END_INFER, operation="finish the switch to INFER")
        self._guard.arm()
        report = self._report(Direction.TO_INFER, run, before, start, plan, residency=self.residency())
        if report.residency is not None and report.residency.leftovers:
            log.warning("hybridmem: training state still resident in INFER: %s", report.residency.leftovers)
        return report

    def to_train(self) -> SwitchReport:
        """Switch INFER -> TRAIN.

        Raises:
            PhaseError: Not in INFER.
            MemoryPlanError: The predicted peak exceeds the device budget; nothing was done and the
                manager stays in INFER.
            SwitchError: A step raised; the manager is in FAILED with the training state safe in host
                arenas; call :meth:`recover` once the cause is fixed.
        """
        self._check_coresidents_offloaded("switch to TRAIN")
        with HeldSignals() as held:
            held.on_signal = lambda: self._signal_outcome(Direction.TO_TRAIN)
            self._machine.fire(Trigger.BEGIN_TRAIN, operation="switch to TRAIN")
            with self._discovery_held():
                return self._finish_to_train(held, abort_trigger=Trigger.ABORT_TRAIN)

    def recover(self) -> SwitchReport:
        """From FAILED, bring every part back to TRAIN (each step is a no-op where already done)."""
        with HeldSignals() as held:
            held.on_signal = lambda: self._signal_outcome(Direction.TO_TRAIN)
            self._machine.fire(Trigger.RECOVER, operation="recover")
            with self._discovery_held():
                return self._finish_to_train(held, abort_trigger=Trigger.FAIL)

    def _finish_to_train(self, held: HeldSignals, *, abort_trigger: Trigger) -> SwitchReport:
        steps = self.steps(Direction.TO_TRAIN)
        try:
            plan = self.plan(Direction.TO_TRAIN, steps)
            if not plan.fits:
                raise MemoryPlanError(plan)
        except BaseException:
            self._machine.fire(abort_trigger, operation="refuse the switch to TRAIN")
            raise
        start = time.perf_counter()
        before = self.memory()
        run = run_steps(Direction.TO_TRAIN, steps, before=before, held=held,
                        accel=self.accel, memory=self.memory,
                        touched=self._forget_discovery)
        if run.error is not None:
            self._machine.fire(Trigger.FAIL, operation="record a failed switch")
            self._guard.arm()
            assert run.failed_step is not None
            msg = (
                f"INFER->TRAIN step {run.failed_step.name!r} failed: {run.error!r}. Phase is FAILED; no "
                f"training state is lost (offloaded bytes stay in host arenas); call recover() once the "
                f"cause is fixed"
            )
            if not isinstance(run.error, Exception):
                raise run.error
            raise switch_error(msg, direction="to_train", step=run.failed_step.name,
                               phase_after=self.phase, cause=run.error) from run.error
        self._machine.fire(Trigger.END_TRAIN, operation="finish the switch to TRAIN")
        self._guard.disarm()
        return self._report(Direction.TO_TRAIN, run, before, start, plan)

    @contextlib.contextmanager
    def inference(self, *, retries: int = 0) -> Iterator[InferenceEngine | None]:
        """Context manager: TRAIN -> INFER on entry, INFER -> TRAIN on exit (also on an exception).

        An exception raised by the body propagates unchanged after the switch back; if the switch back
        fails too, a note saying so is attached to the body's exception.

        Args:
            retries: How many more times to try TRAIN -> INFER after it failed and was rolled back (phase
                TRAIN, nothing lost), e.g. an engine that failed to wake once. A failure that leaves
                FAILED is raised at once. :attr:`last_rollbacks` counts the attempts rolled back.

        Yields:
            The engine.
        """
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries={retries!r} must be an int >= 0")
        self.last_rollbacks = 0
        while True:
            try:
                self.to_infer()
                break
            except SwitchError as exc:
                if self.phase is not Phase.TRAIN or self.last_rollbacks >= retries:
                    raise
                self.last_rollbacks += 1
                log.warning("hybridmem: TRAIN->INFER failed and was rolled back (%s); "
                            "trying again (%d of %d)", exc, self.last_rollbacks, retries)
        try:
            yield self.engine
        except BaseException as exc:
            try:
                self.to_train()
            except Exception as switch_exc:  # reported on the user's exception
                add_note(exc, f"hybridmem: the switch back to TRAIN failed too: {switch_exc!r}; "
                              f"phase {self.phase.name}")
            raise
        self.to_train()

    def close(self) -> None:
        """Let the model, optimizer and engine go: the phase becomes CLOSED, the host arenas are dropped,
        hooks removed, and another manager may be built on them ([Note: one manager per model] in
        :mod:`hybridmem.switch.claims`). Only in TRAIN (CLOSED: a no-op); co-resident models are onloaded
        first so nothing is lost."""
        if self.phase is Phase.CLOSED:
            return
        self._check_phase("close", Phase.TRAIN)
        for co in self.coresidents.values():
            co.onload()
        if self.prewarmer is not None:
            self.prewarmer.close()
        self.pool.free()
        self._guard.disarm()
        self._machine.fire(Trigger.CLOSE, operation="close")
        if self._claims is not None:
            self._claims.release()

    # Internals ------------------------------------------------------------------------------------
    def _signal_outcome(self, direction: Direction) -> str:
        """What became of a switch a held signal interrupted, and where the training state is, for the line
        printed before the signal is delivered ([Note: held signals] in
        :mod:`hybridmem.switch.transaction`)."""
        where = "INFER" if direction is Direction.TO_INFER else "TRAIN"
        if self.phase is Phase.TRAIN:
            did = "it was rolled back" if direction is Direction.TO_INFER else "it finished first"
            return f"the switch to {where}: {did}; phase TRAIN, the training state is intact on the device"
        if self.phase is Phase.INFER:
            return (f"the switch to {where}: it finished first (its ranks had agreed on it); phase INFER, "
                    "the training state is intact in host memory and the switch to TRAIN brings it back")
        return (f"the switch to {where}: it failed; phase {self.phase.name}, no training state is lost (it "
                "is in host memory): call recover()")

    def _vote_no(self, run: SwitchRun) -> None:
        """Tell the peers this rank rolls back, where they wait for its vote: its weight sync completed and
        its group is usable ([Note: switch agreement] in :mod:`hybridmem.switch.agreement`)."""
        if self.agreement is None or isinstance(run.failed_step, AgreeStep) or is_collective_loss(run.error):
            return
        synced = [s for s in run.entered if isinstance(s, WeightSyncStep) and s is not run.failed_step]
        if synced:
            failed = "a held signal" if run.failed_step is None else f"step {run.failed_step.name!r}"
            self.agreement.vote_no(f"{failed} failed")

    def _check_phase(self, operation: str, *phases: Phase) -> None:
        if self.phase not in phases:
            raise wrong_phase(operation, self.phase, phases)

    def _check_coresidents_offloaded(self, operation: str) -> None:
        onloaded = [n for n, co in self.coresidents.items() if co.state is CoResidentState.ONLOADED]
        if onloaded:
            raise PhaseError(operation, self.phase,
                             f"co-resident {onloaded} is onloaded; leave onloaded() first")

    def _report(
        self,
        direction: Direction,
        run: SwitchRun,
        before: MemoryFigures,
        start: float,
        plan: MemoryPlan,
        residency: ResidencyReport | None = None,
    ) -> SwitchReport:
        after = self.memory()
        allocator_peak = self.accel.peak_allocated_nbytes()
        report = SwitchReport(
            direction=direction,
            steps=tuple(run.reports),
            seconds=time.perf_counter() - start,
            device_before_nbytes=before.allocated_nbytes,
            device_after_nbytes=after.allocated_nbytes,
            device_peak_nbytes=run.tracked_peak_nbytes if allocator_peak is None else allocator_peak,
            peak_source="tracked" if allocator_peak is None else "allocator",
            host_nbytes=self.pool.held_nbytes(),
            device_backend=str(self.accel.device),
            plan=plan,
            residency=residency,
        )
        self.last_reports[direction] = report
        self.last_report = report
        return report

    def offload_states(self) -> dict[str, OffloadState]:
        """Each offloader's state, by owner."""
        return {off.owner: off.state for off in self.offloaders.values()}

    def __repr__(self) -> str:
        return (f"ShardingManager(phase={self.phase.name}, accel={self.accel}, "
                f"engine={type(self.engine).__name__})")
