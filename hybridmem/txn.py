"""Holding SIGINT/SIGTERM while a switch moves memory.

[Note: held signals]
A ``KeyboardInterrupt`` raised by Python's default SIGINT handler can surface between any two bytecodes,
for instance between freeing a storage and recording that it was freed, or in the middle of an undo.
A switch therefore installs its own handlers for SIGINT and SIGTERM while it runs (only possible in the
main thread, where Python runs every signal handler). They only record the signal. The manager looks at
the record between steps: a signal pending during TRAIN->INFER stops the switch and rolls it back, one
pending during INFER->TRAIN lets it finish (TRAIN is where the training state is whole). Once the switch
has ended, in TRAIN or INFER or FAILED, the previous handlers are put back and each held signal is
delivered to them: the default SIGINT handler raises ``KeyboardInterrupt`` there, a ``SIG_DFL`` SIGTERM
ends the process through the OS, a ``SIG_IGN`` one is dropped.

Outside the main thread nothing is installed: Python delivers signals to the main thread only, so a
switch running in another thread is never interrupted by one; the main thread gets the
``KeyboardInterrupt`` while the switch finishes (or rolls back) on its own. Synchronous exceptions
raised by the code a step calls (a torch call, an engine, the host pool) are not signals: they fail the
step and are undone as in [Note: switch transactions] in :mod:`hybridmem.manager`.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

__all__ = ["HeldSignals", "HELD_SIGNALS"]

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

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        pending, self.pending = self.pending, []
        for signum in pending:
            self._deliver(signum, previous.get(signum))

    @staticmethod
    def _deliver(signum: int, handler: Any) -> None:
        if callable(handler):
            handler(signum, None)  # the default SIGINT handler raises KeyboardInterrupt here
        elif handler == signal.SIG_DFL:
            signal.raise_signal(signum)
        # SIG_IGN, or a handler installed from C (None): the signal was meant to be ignored here.
