"""The TRAIN <-> INFER state machine. The only module that imports ``transitions``.

Legal transitions (trigger: source -> destination)::

    begin_infer:    TRAIN        -> TO_INFER       a TRAIN->INFER switch starts
    end_infer:      TO_INFER     -> INFER          every step ran
    begin_rollback: TO_INFER     -> ROLLING_BACK   a step failed (or the memory plan refused the switch)
    end_rollback:   ROLLING_BACK -> TRAIN          the done steps were undone in reverse
    begin_train:    INFER        -> TO_TRAIN       an INFER->TRAIN switch starts
    end_train:      TO_TRAIN     -> TRAIN          every step ran
    abort_train:    TO_TRAIN     -> INFER          refused by the memory plan before any step ran
    fail:           TO_INFER | TO_TRAIN | ROLLING_BACK -> FAILED
    recover:        FAILED       -> TO_TRAIN       re-run the INFER->TRAIN steps (each idempotent)
    close:          TRAIN        -> CLOSED         the manager let its model go (no way back)

The machine only records the phase and refuses illegal transitions; the steps themselves run in
:class:`hybridmem.manager.ShardingManager` between a ``begin_*`` and an ``end_*`` trigger. No callback
does fallible work after a state change, because ``transitions`` has no rollback of its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from transitions import Machine, MachineError

from hybridmem.errors import PhaseError
from hybridmem.switch.phase import Phase

__all__ = ["PhaseMachine", "TRANSITIONS", "Trigger", "wrong_phase"]


class Trigger(str, Enum):
    """The machine's triggers; the value is the name ``transitions`` knows it by."""

    BEGIN_INFER = "begin_infer"
    END_INFER = "end_infer"
    BEGIN_ROLLBACK = "begin_rollback"
    END_ROLLBACK = "end_rollback"
    BEGIN_TRAIN = "begin_train"
    END_TRAIN = "end_train"
    ABORT_TRAIN = "abort_train"
    FAIL = "fail"
    RECOVER = "recover"
    CLOSE = "close"


TRANSITIONS: tuple[tuple[Trigger, tuple[Phase, ...], Phase], ...] = (
    (Trigger.BEGIN_INFER, (Phase.TRAIN,), Phase.TO_INFER),
    (Trigger.END_INFER, (Phase.TO_INFER,), Phase.INFER),
    (Trigger.BEGIN_ROLLBACK, (Phase.TO_INFER,), Phase.ROLLING_BACK),
    (Trigger.END_ROLLBACK, (Phase.ROLLING_BACK,), Phase.TRAIN),
    (Trigger.BEGIN_TRAIN, (Phase.INFER,), Phase.TO_TRAIN),
    (Trigger.END_TRAIN, (Phase.TO_TRAIN,), Phase.TRAIN),
    (Trigger.ABORT_TRAIN, (Phase.TO_TRAIN,), Phase.INFER),
    (Trigger.FAIL, (Phase.TO_INFER, Phase.TO_TRAIN, Phase.ROLLING_BACK), Phase.FAILED),
    (Trigger.RECOVER, (Phase.FAILED,), Phase.TO_TRAIN),
    (Trigger.CLOSE, (Phase.TRAIN,), Phase.CLOSED),
)
"""(trigger, sources, destination) for every legal transition."""


class PhaseMachine:
    """Holds the current :class:`Phase` and allows only the transitions in :data:`TRANSITIONS`."""

    def __init__(self, initial: Phase = Phase.TRAIN):
        self.state: Phase = initial
        self._machine = Machine(
            model=self,
            states=Phase,
            initial=initial,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            transitions=[{"trigger": t.value, "source": list(src), "dest": dst}
                         for t, src, dst in TRANSITIONS],
        )

    @property
    def phase(self) -> Phase:
        """The current phase."""
        return self.state

    def fire(self, trigger: Trigger, *, operation: str) -> None:
        """Take the transition ``trigger``.

        Raises:
            TypeError: ``trigger`` is not a :class:`Trigger`.
            PhaseError: ``trigger`` is not allowed from the current phase; names the phase and ``operation``.
        """
        if not isinstance(trigger, Trigger):
            raise TypeError(f"trigger={trigger!r} is not a Trigger; known: {[t.name for t in Trigger]}")
        allowed = [src for t, src, _ in TRANSITIONS if t is trigger]
        try:
            self.trigger(trigger.value)
        except MachineError:
            raise wrong_phase(operation, self.state, allowed[0]) from None


def wrong_phase(operation: str, phase: Phase, needed: Iterable[Phase]) -> PhaseError:
    """The error for ``operation`` tried in ``phase`` while it needs one of ``needed``."""
    if phase is Phase.CLOSED:
        return PhaseError(operation, phase, "the manager was closed; build a new ShardingManager")
    return PhaseError(operation, phase, f"it needs phase {'/'.join(p.name for p in needed)}")
