"""A pool of worker processes joined in one ``torch.distributed`` group, reused across tests.

Spawning a process and importing torch costs 2-6 s on a small CPU machine, so distributed tests share
one pool per session. The pool is created once with ``max_world_size`` processes; at start every worker
also creates the subgroups made of the first ``k`` ranks for each ``k``, so a task can run on any world
size up to the maximum without collective group creation per task.

A task is a picklable (module-level) function ``fn(ctx, *args, **kwargs)``; it runs on ranks
``0..world_size-1`` with ``ctx`` a :class:`WorkerContext`, and :meth:`WorkerPool.run` returns the list
of per-rank results. If any rank raises, the pool is torn down (the other ranks may be stuck in a
collective) and :class:`WorkerError` carries every rank's traceback; the next task starts a fresh pool.

[Note: workers die with their parent]
No worker outlives the process that started it, however that process ends. A normal exit or a
``KeyboardInterrupt`` runs :meth:`WorkerPool.close` (the ``with`` block or the fixture's teardown), and
a pool nobody closed is closed by a ``weakref.finalize`` (at garbage collection or interpreter exit).
A parent that dies without running Python code (SIGTERM's and SIGKILL's default action, ``os._exit``,
a crash; a SIGTERM to a pytest-xdist worker, for one) cannot close anything: each worker asks the kernel for
SIGKILL when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``) and also watches its parent pid from
a thread (other platforms, and a pool started from a thread other than the main one, whose end
``PR_SET_PDEATHSIG`` would take for the parent's death). Workers ignore SIGINT: a Ctrl-C in a
terminal reaches the whole process group, and the parent, not each worker, decides how the pool ends
(its ``close`` stops them, killing a worker still busy after a few seconds).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["WorkerContext", "WorkerError", "WorkerPool"]


@dataclass(frozen=True)
class WorkerContext:
    """What a task sees in a worker.

    Attributes:
        rank: This process's rank in ``group``.
        world_size: The task's world size.
        group: The process group of ranks ``0..world_size-1`` (``None`` means the default group).
        backend: ``"gloo"`` or ``"nccl"``.
    """

    rank: int
    world_size: int
    group: Any
    backend: str


class WorkerError(RuntimeError):
    """A task raised on one or more ranks, or a rank died.

    Attributes:
        results: The results of the ranks that returned, by rank.
    """

    def __init__(self, message: str, results: dict[int, Any] | None = None):
        super().__init__(message)
        self.results = dict(results or {})


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal the kernel sends this process when its parent dies (linux/prctl.h)."""

CLOSE_WAIT_S = 5.0
"""How long :meth:`WorkerPool.close` lets the workers finish their current task before killing them."""

PARENT_POLL_S = 0.5
"""How often a worker's watch thread compares its parent pid with the one that started it."""


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    os._exit(1)  # the parent is gone: nobody will read a result or close the pool


def _die_with_parent(parent_pid: int, *, deathsig: bool) -> None:
    """Exit when the process ``parent_pid`` ends (see [Note: workers die with their parent])."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if deathsig and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # it died before the request above was in place
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="watch-parent", daemon=True).start()


def _worker_main(rank: int, world: int, port: int, backend: str, tasks: Any, results: Any, timeout_s: float,
                 parent_pid: int, deathsig: bool):
    _die_with_parent(parent_pid, deathsig=deathsig)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    # Every rank takes part in creating every subgroup, in the same order (a collective).
    groups = {k: (None if k == world else dist.new_group(list(range(k)))) for k in range(1, world + 1)}
    results.put(("ready", rank, None))
    while True:
        item = tasks.get()
        if item is None:
            break
        task_id, world_size, fn, args, kwargs = item
        if rank >= world_size:
            results.put((task_id, rank, ("skip", None)))
            continue
        ctx = WorkerContext(rank=rank, world_size=world_size, group=groups[world_size], backend=backend)
        try:
            results.put((task_id, rank, ("ok", fn(ctx, *args, **kwargs))))
        except BaseException:  # report every failure to the parent, then keep serving
            results.put((task_id, rank, ("error", traceback.format_exc())))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _kill(procs: list[Any]) -> None:
    """SIGKILL every started worker still alive and reap it (a pool's finalizer: holds no pool reference)."""
    for p in procs:
        with contextlib.suppress(Exception):
            if p.is_alive():
                p.kill()
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(timeout=5)


class WorkerPool:
    """``max_world_size`` processes in one process group, serving tasks until :meth:`close`.

    Args:
        max_world_size: Number of processes.
        backend: ``"gloo"`` (CPU) or ``"nccl"``.
        timeout_s: Collective timeout inside workers and result timeout in the parent.
    """

    def __init__(self, max_world_size: int, *, backend: str = "gloo", timeout_s: float = 120.0):
        if max_world_size < 1:
            raise ValueError(f"max_world_size={max_world_size} must be >= 1")
        self.max_world_size = max_world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self._procs: list[Any] = []
        self._task_queues: list[Any] = []
        self._results: Any = None
        self._next_id = 0
        self._finalizer: weakref.finalize | None = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._results = ctx.Queue()
        self._task_queues = [ctx.Queue() for _ in range(self.max_world_size)]
        # PR_SET_PDEATHSIG fires when the thread that started the child ends: only the main thread lives
        # as long as the process (see [Note: workers die with their parent]).
        deathsig = threading.current_thread() is threading.main_thread()
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(r, self.max_world_size, port, self.backend, self._task_queues[r], self._results,
                      self.timeout_s, os.getpid(), deathsig),
                daemon=True,
            )
            for r in range(self.max_world_size)
        ]
        self._finalizer = weakref.finalize(self, _kill, list(self._procs))
        for p in self._procs:
            p.start()
        ready = 0
        while ready < self.max_world_size:
            try:
                tag, _, _ = self._results.get(timeout=self.timeout_s)
            except queue.Empty:
                self.close()
                raise WorkerError(f"worker pool of {self.max_world_size} did not start in "
                                  f"{self.timeout_s} s") from None
            ready += tag == "ready"

    def run(self, fn: Callable[..., Any], *args: Any, world_size: int | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on ranks ``0..world_size-1`` and return their results by rank.

        Raises:
            ValueError: ``world_size`` exceeds the pool.
            WorkerError: A rank raised or timed out (the pool is restarted on the next call).
        """
        world_size = self.max_world_size if world_size is None else world_size
        if not 1 <= world_size <= self.max_world_size:
            raise ValueError(f"world_size={world_size} must be in [1, {self.max_world_size}]")
        if not self._procs:
            self._start()
        task_id = self._next_id
        self._next_id += 1
        for q in self._task_queues:
            q.put((task_id, world_size, fn, args, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        waiting = set(range(self.max_world_size))
        give_up = time.monotonic() + self.timeout_s
        while waiting:
            try:
                tid, rank, (status, value) = self._results.get(timeout=1.0)
            except queue.Empty:
                for r in sorted(waiting):  # a worker that died (SIGKILL, abort) never reports
                    if not self._procs[r].is_alive():
                        errors[r] = f"rank {r} died (exit code {self._procs[r].exitcode})"
                        waiting.discard(r)
                if waiting and time.monotonic() > give_up:
                    errors[-1] = f"no result within {self.timeout_s} s (ranks done: {sorted(out)})"
                    break
                continue
            if tid != task_id:
                continue
            waiting.discard(rank)
            if status == "ok":
                out[rank] = value
            elif status == "error":
                errors[rank] = value
        if errors:
            self.close()
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise WorkerError(f"task {getattr(fn, '__name__', fn)} failed on world_size={world_size}:\n"
                              f"{detail}",
                              {r: v for r, v in out.items() if r < world_size})
        return [out[r] for r in range(world_size)]

    def close(self) -> None:
        """Stop every worker (safe to call twice)."""
        for q in self._task_queues:
            with contextlib.suppress(Exception):
                q.put(None)
        give_up = time.monotonic() + CLOSE_WAIT_S
        for p in self._procs:
            p.join(timeout=max(0.0, give_up - time.monotonic()))
        if self._finalizer is not None:
            self._finalizer()  # kills whichever worker is still busy
            self._finalizer = None
        self._procs = []
        self._task_queues = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
