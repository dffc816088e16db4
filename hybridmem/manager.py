"""ShardingManager: switches an actor between TRAIN and INFER on the same devices.

>>> manager = ShardingManager(model, engine, optimizer=opt, config=HybridConfig())   # doctest: +SKIP
>>> with manager.inference() as engine:                                               # doctest: +SKIP
...     outputs = engine.generate(prompts)

The manager owns no policy of its own: the steps of a switch and their order are in
:mod:`hybridmem.steps` (see [Note: step order]), the state machine in :mod:`hybridmem.machine`, the
mechanism that moves bytes in :mod:`hybridmem.offload`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

from hybridmem.accel import Accelerator, CpuAccelerator, MemoryFigures, get_accelerator
from hybridmem.architecture import check_architecture
from hybridmem.colocate import CoResident, CoResidentState
from hybridmem.config import HybridConfig
from hybridmem.engines.protocol import KV_CACHE, WEIGHTS, InferenceEngine, check_kv_utilization
from hybridmem.errors import MemoryPlanError, PhaseError, RollbackError, SwitchError, switch_error
from hybridmem.guards import TrainingGuard
from hybridmem.host_pool import HostBufferPool
from hybridmem.kinds import StateKind
from hybridmem.machine import PhaseMachine
from hybridmem.memplan import MemoryPlan, StepEstimate, plan_switch
from hybridmem.offload import Offloader, OffloadState
from hybridmem.parts import resolve_layouts, training_state_of
from hybridmem.phase import Direction, Phase
from hybridmem.report import StepReport, SwitchReport
from hybridmem.residency import ResidencyReport
from hybridmem.steps import (
    EmptyCacheStep,
    EngineReleaseStep,
    EngineResumeStep,
    OffloadStep,
    OnloadStep,
    SwitchStep,
    ToInferOrder,
    ToTrainOrder,
    WeightSyncStep,
)
from hybridmem.sync import WeightSync, default_weight_sync
from hybridmem.training_state import TrainingState
from hybridmem.txn import HeldSignals

__all__ = ["ShardingManager"]

log = logging.getLogger(__name__)

_OWNER = {
    StateKind.PARAM: "train param",
    StateKind.GRAD: "train grad",
    StateKind.OPTIMIZER: "optimizer",
}
_ENGINE_OWNER = {WEIGHTS: "engine weights", KV_CACHE: "kv cache"}


# [Note: switch transactions]
# A switch is a transaction over its steps. Before a step runs, the manager appends it to the switch's
# journal (``_Run.entered``); the step then records its own irreversible acts before doing them (an
# offloader records its slots and holds its host arenas before freeing a storage, see [Note: offload
# journal] in hybridmem.offload.base; an engine's release frees every storage of a tag whatever state it
# believes it is in). When a TRAIN->INFER step raises anything (an Exception from any torch call, a
# KeyboardInterrupt) or a held signal is pending between steps (see [Note: held signals] in
# hybridmem.txn), every entered step is undone in reverse, the failed one included, and each undo works
# from whatever part of its step was done: nothing is undone from what a step was *supposed* to have
# done. INFER->TRAIN steps are re-runnable from any partial state, so a failure there leaves FAILED and
# ``recover()`` runs them all again. The whole switch runs with SIGINT/SIGTERM held, so no undo is itself
# interrupted by one. tests/test_fault_injection.py injects a failure at every call a switch makes into
# torch, the host pool and the engine, and checks the training state after each.


@dataclass
class _Run:
    """What :meth:`ShardingManager._execute` did (see [Note: switch transactions])."""

    entered: list[SwitchStep]
    """Steps started, in order (the last one may have failed or been interrupted)."""
    reports: list[StepReport]
    failed_step: SwitchStep | None = None
    error: BaseException | None = None
    interrupted: bool = False
    """A held signal was pending between steps (TRAIN->INFER stops there and rolls back)."""
    interrupted_before: SwitchStep | None = None
    """The step not started because of it (``None`` with ``interrupted``: after the last step)."""
    tracked_peak_nbytes: int = 0


def _add_note(exc: BaseException, note: str) -> None:
    add = getattr(exc, "add_note", None)  # Python >= 3.11
    if add is not None:
        add(note)


class ShardingManager:
    """Switches one actor (training state + inference engine) between TRAIN and INFER.

    Args:
        model: The training model: a ``torch.nn.Module`` (with ``fully_shard`` applied or not; an FSDP2
            model gets :class:`~hybridmem.adapters.fsdp.FSDPTrainingState`), a list of module chunks, or
            an object implementing :class:`~hybridmem.training_state.TrainingState` (e.g. the Megatron
            adapter).
        engine: The inference engine (see :class:`~hybridmem.engines.protocol.InferenceEngine`), or
            ``None`` to only offload training state.
        optimizer: The optimizer(s) whose state to offload (plain PyTorch models only; adapters carry
            their own).
        config: Offload switches, layouts and budgets; defaults to ``HybridConfig()``.
        accel: The accelerator; defaults to ``config.device``.
        weight_sync: How training weights reach the engine; defaults to
            :func:`~hybridmem.sync.default_weight_sync`: resharding from the training layout to the
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
        if engine is not None and not isinstance(engine, InferenceEngine):
            missing = [m for m in ("load_weights", "release", "resume") if not callable(getattr(engine, m, None))]
            raise TypeError(f"engine {type(engine).__name__} does not implement InferenceEngine: missing {missing}")
        self.config = resolve_layouts(config, self.training, engine)
        """The config, its layout keys resolved from the parts (see [Note: layouts from the parts])."""
        check_kv_utilization(engine, self.config)
        self.engine = engine
        self.pool = HostBufferPool(
            self.accel, budget_nbytes=self.config.host_memory_budget_bytes, pin=self.config.pin_memory
        )
        self.offloaders: dict[StateKind, Offloader] = dict(self.training.build_offloaders(self.accel, self.pool, self.config))
        self._enabled = {
            StateKind.PARAM: self.config.offload_train_param,
            StateKind.GRAD: self.config.offload_train_grad,
            StateKind.OPTIMIZER: self.config.offload_train_optimizer,
        }
        if weight_sync is None and engine is not None:
            check_architecture(self.training, engine, model_spec=model_spec)
            weight_sync = default_weight_sync(self.training, engine, self.config, model_spec=model_spec, group=group)
        self.weight_sync = weight_sync
        self._extra_steps: dict[Direction, list[tuple[int, SwitchStep]]] = {d: [] for d in Direction}
        self._extra_owners: dict[str, tuple[Callable[[], int], tuple[Phase, ...]]] = {}
        self._machine = PhaseMachine()
        targets = getattr(self.training, "guard_targets", None)
        modules, optimizers = targets() if callable(targets) else ([], [])
        self._guard = TrainingGuard(lambda: self.phase, modules, optimizers)
        """Refuses use of the training model outside TRAIN (see [Note: misuse guards])."""
        bind = getattr(engine, "bind_phase", None)
        if callable(bind):
            bind(lambda: self.phase)
        self.coresidents: dict[str, CoResident] = {}
        """Co-resident models by name (see [Note: co-resident phases])."""
        self.last_reports: dict[Direction, SwitchReport] = {}
        """The latest report of each direction."""
        self.last_report: SwitchReport | None = None
        """The latest report of any direction."""
        self.last_rollbacks = 0
        """TRAIN->INFER attempts of the latest :meth:`inference` that failed and were rolled back."""
        if getattr(self.training, "attaches_itself", False):
            self.training.attach(self)  # FSDP2: its buffer release step and residency owner
        self._release_engine_memory()

    def _release_engine_memory(self) -> None:
        """The manager starts in TRAIN, where the engine holds no memory: an engine handed over awake (a
        ``ReferenceEngine`` is built so) has its weights and KV cache released now; they are derived
        state, rewritten by every TRAIN->INFER switch."""
        resident = getattr(self.engine, "resident_nbytes", None)
        if not callable(resident):
            return
        awake = [tag for tag in (KV_CACHE, WEIGHTS) if resident(tag)]
        if awake:
            log.info("hybridmem: releasing the engine's %s (the manager starts in TRAIN)", awake)
            self.engine.release(awake)

    # Introspection --------------------------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        """The current :class:`~hybridmem.phase.Phase`."""
        return self._machine.phase

    def register_step(self, direction: Direction, step: SwitchStep, order: int) -> None:
        """Add a step to every later switch of ``direction``, sorted by ``order`` among the built-in
        steps (:class:`~hybridmem.steps.ToInferOrder` / :class:`~hybridmem.steps.ToTrainOrder`)."""
        self._check_phase("register a step", Phase.TRAIN)
        self._extra_steps[Direction(direction)].append((int(order), step))

    def register_owner(self, name: str, resident_nbytes: Callable[[], int], *, empty_in: tuple[Phase, ...] = ()) -> None:
        """Count ``resident_nbytes()`` as owner ``name`` in residency reports; a leftover in ``empty_in``."""
        if name in self._owner_nbytes():
            raise ValueError(f"owner {name!r} is already registered")
        self._extra_owners[name] = (resident_nbytes, tuple(empty_in))

    def steps(self, direction: Direction) -> list[SwitchStep]:
        """The steps a switch in ``direction`` runs now, in order (see [Note: step order])."""
        direction = Direction(direction)
        items: list[tuple[int, SwitchStep]] = []
        offloadable = [k for k in (StateKind.OPTIMIZER, StateKind.GRAD, StateKind.PARAM) if k in self.offloaders and self._enabled[k]]
        if direction is Direction.TO_INFER:
            items += [(ToInferOrder[k.name], OffloadStep(self.offloaders[k])) for k in offloadable]
            items.append((ToInferOrder.EMPTY_CACHE, EmptyCacheStep(self.accel)))
            if self.engine is not None:
                items.append((ToInferOrder.ENGINE_WEIGHTS, EngineResumeStep(self.engine, WEIGHTS)))
                if self.weight_sync is not None:
                    items.append((ToInferOrder.WEIGHT_SYNC, WeightSyncStep(self.weight_sync)))
                items.append((ToInferOrder.KV_CACHE, EngineResumeStep(self.engine, KV_CACHE)))
        else:
            items += [(ToTrainOrder[k.name], OnloadStep(self.offloaders[k])) for k in offloadable]
            if self.engine is not None:
                items.append((ToTrainOrder.KV_CACHE, EngineReleaseStep(self.engine, KV_CACHE)))
                items.append((ToTrainOrder.ENGINE_WEIGHTS, EngineReleaseStep(self.engine, WEIGHTS)))
        items += self._extra_steps[direction]
        return [step for _, step in sorted(items, key=lambda item: item[0])]

    def _owner_nbytes(self) -> dict[str, int]:
        owners = {_OWNER.get(k, str(k)): off.resident_nbytes() for k, off in self.offloaders.items()}
        if self.engine is not None:
            for tag, name in _ENGINE_OWNER.items():
                fn = getattr(self.engine, "resident_nbytes", None)
                owners[name] = int(fn(tag)) if callable(fn) else 0
        for name, (fn, _) in self._extra_owners.items():
            owners[name] = int(fn())
        for name, co in self.coresidents.items():
            owners[name] = co.resident_nbytes()
        return owners

    def memory(self) -> MemoryFigures:
        """Device memory figures now (on CPU, "allocated" is the sum over known owners)."""
        return self.accel.memory_figures(sum(self._owner_nbytes().values()))

    def residency(self) -> ResidencyReport:
        """Device bytes by owner now; owners that should be empty in the current phase are flagged."""
        owners = self._owner_nbytes()
        figures = self.accel.memory_figures(sum(owners.values()))
        expected_empty: list[str] = []
        if self.phase is Phase.INFER:
            expected_empty += [_OWNER[k] for k in self.offloaders if self._enabled.get(k) and k in _OWNER]
        if self.phase is Phase.TRAIN:
            expected_empty += list(_ENGINE_OWNER.values())
        expected_empty += [n for n, (_, phases) in self._extra_owners.items() if self.phase in phases]
        expected_empty += [n for n, co in self.coresidents.items() if co.state is CoResidentState.OFFLOADED]
        return ResidencyReport(
            phase=self.phase,
            by_owner=owners,
            allocated_nbytes=figures.allocated_nbytes,
            reserved_nbytes=figures.reserved_nbytes,
            expected_empty=tuple(expected_empty),
            device_used_nbytes=(figures.total_nbytes - figures.free_nbytes
                                if self.accel.measures_device_memory else None),
        )

    def plan(self, direction: Direction, steps: list[SwitchStep] | None = None) -> MemoryPlan:
        """The predicted memory curve of a switch in ``direction`` from the current state."""
        direction = Direction(direction)
        steps = self.steps(direction) if steps is None else steps
        return self._plan(direction, [(s.name, s.estimate()) for s in steps])

    def _plan(self, direction: Direction, estimates: list[tuple[str, StepEstimate]]) -> MemoryPlan:
        figures = self.memory()
        if self.config.device_memory_budget_bytes is not None:
            budget, source = self.config.device_memory_budget_bytes, "device_memory_budget_bytes"
        elif isinstance(self.accel, CpuAccelerator):
            budget, source = figures.total_nbytes, "cpu capacity_nbytes"
        else:
            budget = figures.allocated_nbytes + figures.free_nbytes + figures.cached_nbytes
            source = "allocated + device free + allocator cache"
        return plan_switch(direction, figures.allocated_nbytes, estimates, budget_nbytes=budget, budget_source=source)

    # Co-resident models ---------------------------------------------------------------------------
    def add_coresident(self, name: str, model: Any) -> CoResident:
        """Register a second model sharing the devices (e.g. the reference policy) and offload it.

        It stays in host arenas except inside :meth:`onloaded` (see [Note: co-resident phases]).

        Raises:
            PhaseError: Not in TRAIN.
            ValueError: ``name`` is taken by another owner.
        """
        self._check_phase(f"add co-resident {name!r}", Phase.TRAIN)
        if name in self._owner_nbytes():
            raise ValueError(f"owner name {name!r} is already taken; taken: {sorted(self._owner_nbytes())}")
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
            raise PhaseError(f"onload co-resident {name!r}", self.phase, "it is already onloaded (nested onloaded())")
        direction = Direction.TO_INFER if self.phase is Phase.INFER else Direction.TO_TRAIN
        plan = self._plan(direction, [(f"onload {name}", StepEstimate(alloc_nbytes=co.live_nbytes()))])
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
            report = self._to_infer(held)
        if report is None:  # a held signal stopped the switch and its handler did not raise
            raise SwitchError(
                "TRAIN->INFER interrupted by a signal; rolled back, phase is TRAIN with all training state on "
                "the device", direction="to_infer", step="(between steps)", phase_after=self.phase,
            )
        return report

    def _to_infer(self, held: HeldSignals) -> SwitchReport | None:
        self._machine.fire("begin_infer", operation="switch to INFER")
        steps = self.steps(Direction.TO_INFER)
        try:
            plan = self.plan(Direction.TO_INFER, steps)
            if not plan.fits:
                raise MemoryPlanError(plan)
        except BaseException:
            self._machine.fire("begin_rollback", operation="refuse the switch")
            self._machine.fire("end_rollback", operation="refuse the switch")
            raise
        start = time.perf_counter()
        before = self.memory()
        run = self._execute(Direction.TO_INFER, steps, before, held)
        if run.error is not None or run.interrupted:
            self._rollback(run)
            return None
        self._machine.fire("end_infer", operation="finish the switch to INFER")
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
            self._machine.fire("begin_train", operation="switch to TRAIN")
            return self._finish_to_train(held, abort_trigger="abort_train")

    def recover(self) -> SwitchReport:
        """From FAILED, bring every part back to TRAIN (each step is a no-op where already done)."""
        with HeldSignals() as held:
            self._machine.fire("recover", operation="recover")
            return self._finish_to_train(held, abort_trigger="fail")

    def _finish_to_train(self, held: HeldSignals, *, abort_trigger: str) -> SwitchReport:
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
        run = self._execute(Direction.TO_TRAIN, steps, before, held)
        if run.error is not None:
            self._machine.fire("fail", operation="record a failed switch")
            self._guard.arm()
            assert run.failed_step is not None
            msg = (
                f"INFER->TRAIN step {run.failed_step.name!r} failed: {run.error!r}. Phase is FAILED; no "
                f"training state is lost (offloaded bytes stay in host arenas); call recover() once the "
                f"cause is fixed"
            )
            if not isinstance(run.error, Exception):
                raise run.error
            raise switch_error(msg, direction="to_train", step=run.failed_step.name, phase_after=self.phase, cause=run.error) from run.error
        self._machine.fire("end_train", operation="finish the switch to TRAIN")
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
                log.warning("hybridmem: TRAIN->INFER failed and was rolled back (%s); trying again (%d of %d)",
                            exc, self.last_rollbacks, retries)
        try:
            yield self.engine
        except BaseException as exc:
            try:
                self.to_train()
            except Exception as switch_exc:  # noqa: BLE001 - reported on the user's exception
                _add_note(exc, f"hybridmem: the switch back to TRAIN failed too: {switch_exc!r}; phase {self.phase.name}")
            raise
        self.to_train()

    def close(self) -> None:
        """Drop the host arenas. Only in TRAIN; co-resident models are onloaded first so nothing is lost."""
        self._check_phase("close", Phase.TRAIN)
        for co in self.coresidents.values():
            co.onload()
        self.pool.free()

    # Internals ------------------------------------------------------------------------------------
    def _check_phase(self, operation: str, *phases: Phase) -> None:
        if self.phase not in phases:
            raise PhaseError(operation, self.phase, f"it needs phase {'/'.join(p.name for p in phases)}")

    def _check_coresidents_offloaded(self, operation: str) -> None:
        onloaded = [n for n, co in self.coresidents.items() if co.state is CoResidentState.ONLOADED]
        if onloaded:
            raise PhaseError(operation, self.phase, f"co-resident {onloaded} is onloaded; leave onloaded() first")

    def _execute(self, direction: Direction, steps: list[SwitchStep], before: MemoryFigures, held: HeldSignals) -> _Run:
        """Run ``steps`` in order, journaling each before it starts (see [Note: switch transactions])."""
        self.accel.reset_peak()
        run = _Run(entered=[], reports=[], tracked_peak_nbytes=before.allocated_nbytes)
        for step in [*steps, None]:
            if held.pending and direction is Direction.TO_INFER:
                run.interrupted, run.interrupted_before = True, step
                return run
            if step is None:
                break
            run.entered.append(step)
            start = time.perf_counter()
            try:
                with record_function(f"hybridmem.{direction.value}.{step.name}"):
                    result = step.run()
            except BaseException as exc:  # noqa: BLE001 - handled by the caller (rollback or FAILED)
                run.failed_step, run.error = step, exc
                return run
            seconds = time.perf_counter() - start
            after = self.memory()
            run.tracked_peak_nbytes = max(run.tracked_peak_nbytes, after.allocated_nbytes)
            run.reports.append(
                StepReport(
                    name=step.name,
                    kind=result.kind,
                    seconds=seconds,
                    copied_nbytes=result.copied_nbytes,
                    zero_nbytes=result.zero_nbytes,
                    allocated_after_nbytes=after.allocated_nbytes,
                    extra=result.extra,
                )
            )
        return run

    def _rollback(self, run: _Run) -> None:
        """Undo every entered step in reverse, the failed one included (see [Note: switch transactions]);
        then raise, unless a held signal stopped the switch (delivered when the hold ends)."""
        cause = run.error
        what = (
            f"TRAIN->INFER step {run.failed_step.name!r} failed ({run.error!r})"
            if run.failed_step is not None
            else f"TRAIN->INFER was interrupted by a signal "
            f"{'after its last step' if run.interrupted_before is None else f'before step {run.interrupted_before.name!r}'}"
        )
        failed_name = run.failed_step.name if run.failed_step is not None else "(between steps)"
        self._machine.fire("begin_rollback", operation="roll back")
        for step in reversed(run.entered):
            try:
                step.undo()
            except BaseException as undo_exc:  # noqa: BLE001
                self._machine.fire("fail", operation="record a failed rollback")
                self._guard.arm()
                raise RollbackError(
                    f"{what} and undoing {step.name!r} failed too ({undo_exc!r}). Phase is FAILED; no training "
                    f"state is lost (offloaded bytes stay in host arenas); call recover() once the cause is fixed",
                    direction="to_infer",
                    step=failed_name,
                    phase_after=self.phase,
                ) from (cause if cause is not None else undo_exc)
        self._machine.fire("end_rollback", operation="finish the rollback")
        if cause is None:
            return
        if not isinstance(cause, Exception):
            raise cause  # KeyboardInterrupt and the like: rolled back, re-raised as is
        undone = ", ".join(s.name for s in reversed(run.entered)) or "nothing"
        raise switch_error(
            f"TRAIN->INFER step {failed_name!r} failed: {cause!r}. Rolled back ({undone}); phase is TRAIN with "
            f"all training state on the device",
            direction="to_infer",
            step=failed_name,
            phase_after=self.phase,
            cause=cause,
        ) from cause

    def _report(
        self,
        direction: Direction,
        run: _Run,
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
        return f"ShardingManager(phase={self.phase.name}, accel={self.accel}, engine={type(self.engine).__name__})"
