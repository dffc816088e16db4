"""A switch as a transaction: its journal, its rollback, and SIGINT/SIGTERM held while it moves memory.

[Note: held signals]
A ``KeyboardInterrupt`` raised by Python's default SIGINT handler can surface between any two bytecodes,
for instance between freeing a storage and recording that it was freed, or in the middle of an undo.
A switch therefore installs its own handlers for SIGINT and SIGTERM while it runs (only possible in the
main thread, where Python runs every signal handler). They only record the signal. The manager looks at
the record between steps: a signal pending during TRAIN->INFER stops the switch and rolls it back, one
pending during INFER->TRAIN lets it finish (TRAIN is where the training state is whole). Once the switch
has ended, in TRAIN or INFER or FAILED, the previous handlers are put back and each held signal is
delivered to them: the default SIGINT handler raises ``KeyboardInterrupt`` there, a ``SIG_DFL`` SIGTERM
ends the process through the OS, a ``SIG_IGN`` one is dropped. Before that, one line on standard error
says what became of the switch and of the training state (the manager's ``on_signal``: "hybridmem: Ctrl-C
(SIGINT) during the switch to INFER: it was rolled back; phase TRAIN, the training state is intact on the
device"), so that it is the first thing the reader sees above the traceback.

Outside the main thread nothing is installed: Python delivers signals to the main thread only, so a
switch running in another thread is never interrupted by one; the main thread gets the
``KeyboardInterrupt`` while the switch finishes (or rolls back) on its own. Synchronous exceptions
raised by the code a step calls (a torch call, an engine, the host pool) are not signals: they fail the
step and are undone as in [Note: switch transactions].

[Note: switch transactions]
A switch is a transaction over its steps. Before a step runs, the manager appends it to the switch's
journal (``SwitchRun.entered``); the step then records its own irreversible acts before doing them (an
offloader records its slots and holds its host arenas before freeing a storage, see [Note: offload
journal] in :mod:`hybridmem.offload.base`; an engine's release frees every storage of a tag whatever state it
believes it is in). When a TRAIN->INFER step raises anything (an Exception from any torch call, a
KeyboardInterrupt) or a held signal is pending between steps (see [Note: held signals] above),
every entered step is undone in reverse, the failed one included, and each undo works
from whatever part of its step was done: nothing is undone from what a step was *supposed* to have
done. INFER->TRAIN steps are re-runnable from any partial state, so a failure there leaves FAILED and
``recover()`` runs them all again. The whole switch runs with SIGINT/SIGTERM held, so no undo is itself
interrupted by one. tests/test_fault_injection.py injects a failure at every call a switch makes into
torch, the host pool and the engine, and checks the training state after each.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from torch.profiler import record_function

from hybridmem.accel import Accelerator, MemoryFigures
from hybridmem.errors import RollbackError, switch_error
from hybridmem.switch.guards import TrainingGuard
from hybridmem.switch.machine import PhaseMachine, Trigger
from hybridmem.switch.phase import Direction
from hybridmem.switch.report import StepReport
from hybridmem.switch.steps import SwitchStep

__all__ = ["HeldSignals", "HELD_SIGNALS", "SwitchRun", "run_steps", "roll_back"]


HELD_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
"""The asynchronous signals a switch holds (see [Note: held signals])."""


class HeldSignals:
    """Context manager that records :data:`HELD_SIGNALS` instead of acting on them, and delivers them to
    the previous handlers on exit (see [Note: held signals]).

    Re-entrant by nesting: an inner hold's previous handler is the outer hold's recorder, so a signal
    held by the inner one is handed to the outer one.
    """

    def __init__(self) -> None:
        self.pending: list[int] = []
        """Signals received while held, in order (each signal number at most once)."""
        self.on_signal: Callable[[], str] | None = None
        """What became of the switch, in words, printed on standard error before a held signal is
        delivered (see [Note: held signals]); ``None``: nothing printed."""
        self._previous: dict[int, Any] = {}

    @property
    def active(self) -> bool:
        """Whether handlers are installed (only in the main thread)."""
        return bool(self._previous)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if signum not in self.pending:
            self.pending.append(signum)

    def __enter__(self) -> HeldSignals:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in HELD_SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:  # an ignored signal stays ignored
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        pending, self.pending = self.pending, []
        outer = any(_is_recorder(previous.get(signum)) for signum in pending)
        if pending and self.on_signal is not None and not outer:  # an outer hold says it once, at its end
            names = " and ".join(SIGNAL_NAMES.get(signum, f"signal {signum}") for signum in pending)
            sys.stderr.write(f"hybridmem: {names} during {self.on_signal()}\n")
            sys.stderr.flush()
        for signum in pending:
            self._deliver(signum, previous.get(signum))

    @staticmethod
    def _deliver(signum: int, handler: Any) -> None:
        if callable(handler):
            handler(signum, None)  # the default SIGINT handler raises KeyboardInterrupt here
        elif handler == signal.SIG_DFL:
            signal.raise_signal(signum)
        # SIG_IGN, or a handler installed from C (None): the signal was meant to be ignored here.


SIGNAL_NAMES: dict[int, str] = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}
"""How the line printed for a held signal names it (see [Note: held signals])."""


def _is_recorder(handler: Any) -> bool:
    """Whether ``handler`` is another hold's recorder (nested holds)."""
    return isinstance(getattr(handler, "__self__", None), HeldSignals)


@dataclass
class SwitchRun:
    """What :func:`run_steps` did (see [Note: switch transactions])."""

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


def run_steps(direction: Direction, steps: list[SwitchStep], *, before: MemoryFigures, held: HeldSignals,
              accel: Accelerator, memory: Callable[[], MemoryFigures],
              touched: Callable[[], None] | None = None) -> SwitchRun:
    """Run ``steps`` in order, journaling each before it starts (see [Note: switch transactions]).

    Stops at the first step that raises (``failed_step``, ``error``), or, for TRAIN->INFER, where a held
    signal is pending between steps (``interrupted``). ``memory()`` gives the figures after each step;
    ``touched()`` runs before it after a step that may change the training tensors' storages
    (:attr:`~hybridmem.switch.steps.SwitchStep.touches_training_tensors`).
    """
    accel.reset_peak()
    run = SwitchRun(entered=[], reports=[], tracked_peak_nbytes=before.allocated_nbytes)
    committed = False  # a step that commits ran: a held signal waits for the end of the switch
    for step in [*steps, None]:
        if held.pending and direction is Direction.TO_INFER and not committed:
            run.interrupted, run.interrupted_before = True, step
            return run
        if step is None:
            break
        run.entered.append(step)
        start = time.perf_counter()
        try:
            with record_function(f"hybridmem.{direction.value}.{step.name}"):
                result = step.run()
        except BaseException as exc:  # handled by the caller (rollback or FAILED)
            run.failed_step, run.error = step, exc
            return run
        seconds = time.perf_counter() - start
        committed = committed or step.commits
        if touched is not None and step.touches_training_tensors:
            touched()
        after = memory()
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

def roll_back(run: SwitchRun, *, machine: PhaseMachine, guard: TrainingGuard) -> None:
    """Undo every entered step of a TRAIN->INFER ``run`` in reverse, the failed one included (see [Note:
    switch transactions]), moving ``machine`` through the rollback; then raise, unless a held signal
    stopped the switch (delivered when the hold ends).

    Raises:
        RollbackError: An undo failed; ``machine`` is in FAILED and ``guard`` armed.
        SwitchError: The rolled-back step's error, as :func:`~hybridmem.errors.switch_error` wraps it.
        BaseException: A step's ``KeyboardInterrupt`` and the like, re-raised as is.
    """
    cause = run.error
    what = (
        f"TRAIN->INFER step {run.failed_step.name!r} failed ({run.error!r})"
        if run.failed_step is not None
        else "TRAIN->INFER was interrupted by a signal "
        + ("after its last step" if run.interrupted_before is None
           else f"before step {run.interrupted_before.name!r}")
    )
    failed_name = run.failed_step.name if run.failed_step is not None else "(between steps)"
    machine.fire(Trigger.BEGIN_ROLLBACK, operation="roll back")
    for step in reversed(run.entered):
        try:
            step.undo()
        except BaseException as undo_exc:
            machine.fire(Trigger.FAIL, operation="record a failed rollback")
            guard.arm()
            raise RollbackError(
                f"{what} and undoing {step.name!r} failed too ({undo_exc!r}). Phase is FAILED; no training "
                "state is lost (offloaded bytes stay in host arenas); call recover() once the cause is "
                "fixed",
                direction="to_infer",
                step=failed_name,
                phase_after=machine.phase,
            ) from (cause if cause is not None else undo_exc)
    machine.fire(Trigger.END_ROLLBACK, operation="finish the rollback")
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
        phase_after=machine.phase,
        cause=cause,
    ) from cause
