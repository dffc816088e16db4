"""The pieces of one streamed weight update on the trainer side: the ``update_weights`` call that waits in the
background while every rank streams, and the error a broken stream is.

``update_weights`` returns only once every worker has consumed its whole stream, so rank 0 of the engine's
ranks runs it on a thread of its own (:class:`BackgroundCall`) while it streams its own buckets; its
``watch`` raises in the streaming thread as soon as the call has failed (vLLM refused it, or the AsyncLLM
client saw the engine core die), so no rank waits out a deadline for an update that already failed (see
[Note: vllm server switch] in :mod:`hybridmem.adapters.vllm.server.engine`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import Any

from hybridmem.adapters.vllm.server.channel import ChannelError
from hybridmem.errors import EngineFault, EngineProcessError

__all__ = ["BackgroundCall", "CallState", "stream_error"]


class CallState(Enum):
    """Where a :class:`BackgroundCall` is (nothing of it is in device memory)."""

    RUNNING = "running"
    """The call waits for the engine on its thread."""
    RETURNED = "returned"
    """The engine answered: :attr:`BackgroundCall.result`."""
    FAILED = "failed"
    """It raised: :attr:`BackgroundCall.error`."""


class BackgroundCall:
    """``fn(*args)`` on a daemon thread of its own, started at construction."""

    def __init__(self, fn: Callable[..., Any], *args: Any, name: str):
        self.name = name
        self.state = CallState.RUNNING
        self.result: Any = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn, args), name=f"hybridmem-{name}",
                                        daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            self.result = fn(*args)
            self.state = CallState.RETURNED
        except BaseException as exc:
            self.error = exc
            self.state = CallState.FAILED
        finally:
            self._done.set()

    def watch(self) -> None:
        """Raise the call's error once it failed (a stream's wait calls this)."""
        if self.state is CallState.FAILED and self.error is not None:
            raise self.error

    def wait(self, timeout_s: float) -> bool:
        """Whether the call ended within ``timeout_s``."""
        return self._done.wait(max(0.0, timeout_s))


def stream_error(exc: ChannelError, *, rank: int, holding: list[int], where: str, deadline_s: float,
                 start: float, gone: Callable[[], bool]) -> EngineProcessError:
    """The :class:`EngineProcessError` for a stream that broke: a channel closed while its worker held
    buckets is its death when ``gone()`` says the engine's process is gone, a refusal otherwise; a wait past
    its deadline a stall (or the death); the worker's own error message a refusal."""
    held = (f" while holding bucket {holding[0]}" if len(holding) == 1
            else f" while holding buckets {holding}" if holding else "")
    if exc.kind == "error":
        fault, cause = EngineFault.REFUSED, exc.cause
    elif gone():
        fault, cause = EngineFault.DEAD, f"vLLM worker rank {rank} died{held} ({exc.cause})"
    elif exc.kind == "timeout":
        fault, cause = EngineFault.STALLED, f"{exc.cause}{held}"
    else:
        fault, cause = EngineFault.REFUSED, f"vLLM worker rank {rank} closed its channel{held} ({exc.cause})"
    error = EngineProcessError("update_weights", where=where, deadline_s=deadline_s,
                               elapsed_s=time.perf_counter() - start, cause=cause, fault=fault)
    error.__cause__ = exc
    return error
