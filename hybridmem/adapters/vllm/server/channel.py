"""The channel between one trainer rank and its vLLM worker rank: a Unix socket, JSON lines.

[Note: vllm channel]
Each trainer rank listens on ``channel-rank<r>.sock`` in the engine's shared directory (one host: the
directory is RAM both processes see) for the whole life of its engine; its worker connects at the start of
every ``update_weights`` and the two speak JSON lines (the worker's side: :class:`WorkerChannel`):

- worker -> trainer, first: ``{"hello": rank, "run": id, "generation": g}``;
- trainer -> worker, per full bucket: ``{"bucket": i, "seq": k, "run": id, "entries": [{"name", "dtype",
  "shape", "start", "end", "offset"}], "figures": {name: [sum, weighted]}}``: the byte range ``[start,
  end)`` of tensor ``name`` lies at ``offset`` in bucket ``i``; ``figures`` are those of the tensors this
  bucket completes; then ``{"end": true, "tensors": n, "run": id}``;
- worker -> trainer: ``{"done": i, "seq": k}`` once bucket ``i``'s bytes are copied out (before any
  processing), ``{"end": true, "tensors": n}`` once every tensor is written and processed, or
  ``{"error": "..."}`` (then it closes the connection).

A thread of the trainer rank (:class:`Listener`) accepts connections all along and hands on only the one
whose hello names the run and the update the rank waits for. A worker may connect before its trainer rank
got there (rank 0 started the update while this rank was still offloading): a hello of this run for a later
update than any this rank waited for is kept until the rank asks for that update. Any other (another run,
or an update the trainer gave up on: a worker that reached a late ``update_weights``) is answered with an
error and closed, so that late update fails at once instead of holding the engine. Rank 0 of the engine's
ranks can also tell another rank, through the same socket, that the update failed before its worker could
connect
(``{"abort": generation, "cause": ...}``, :func:`send_abort`), so it does not wait out its deadline.

A closed connection is the other side's death or refusal: every wait is bounded by a deadline and by a
``watch`` callable that raises once the update is known to have failed elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ChannelError", "Listener", "Connection", "WorkerChannel", "send_abort", "channel_path",
           "MAX_PATH_CHARS"]

MAX_PATH_CHARS = 107
"""The longest Unix socket path Linux takes (``sun_path`` is 108 bytes with the terminating zero)."""
POLL_S = 0.05
"""How often a wait looks at its ``watch``."""
_LINE_LIMIT = 64 << 20


def channel_path(directory: str, rank: int) -> str:
    """Where trainer rank ``rank`` listens."""
    return os.path.join(directory, f"channel-rank{rank}.sock")


class ChannelError(Exception):
    """The other side of a channel closed it, said it failed, or did not answer in time.

    Attributes:
        kind: ``"closed"``, ``"error"`` (the other side's message is the cause), ``"timeout"`` or
            ``"abort"``.
        cause: What happened, in words.
    """

    def __init__(self, kind: str, cause: str):
        super().__init__(cause)
        self.kind = kind
        self.cause = cause


def _deadline_left(deadline: float) -> float:
    return deadline - time.monotonic()


class Connection:
    """One connected channel: JSON lines both ways, every read bounded."""

    def __init__(self, sock: socket.socket, *, what: str):
        self.sock = sock
        self.what = what
        self._buffer = b""

    def send(self, message: dict[str, Any]) -> None:
        """Send one message.

        Raises:
            ChannelError: The other side closed the connection.
        """
        try:
            self.sock.sendall(json.dumps(message, separators=(",", ":")).encode() + b"\n")
        except OSError as exc:
            raise ChannelError("closed", f"{self.what} closed the channel ({exc.strerror or exc})") from exc

    def receive(self, *, timeout_s: float | None, watch: Callable[[], None] | None = None) -> dict[str, Any]:
        """The next message, within ``timeout_s`` (``None``: no deadline); ``watch()`` runs every
        :data:`POLL_S` while waiting and may raise.

        Raises:
            ChannelError: Closed, past the deadline, or the other side's ``{"error"}`` (kind ``"error"``).
        """
        deadline = float("inf") if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = _deadline_left(deadline)
            if left <= 0:
                raise ChannelError("timeout", f"{self.what} sent nothing within {timeout_s:.1f} s")
            ready, _, _ = select.select([self.sock], [], [], min(POLL_S, left))
            if watch is not None:
                watch()
            if not ready:
                continue
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError as exc:
                raise ChannelError("closed",
                                   f"{self.what} closed the channel ({exc.strerror or exc})") from exc
            if not chunk:
                raise ChannelError("closed", f"{self.what} closed the channel")
            self._buffer += chunk
            if len(self._buffer) > _LINE_LIMIT:
                raise ChannelError("error", f"{self.what} sent a line over {_LINE_LIMIT} bytes")
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            message = json.loads(line)
        except ValueError as exc:
            raise ChannelError("error", f"{self.what} sent a line that is not JSON: {line[:200]!r}") from exc
        if not isinstance(message, dict):
            raise ChannelError("error", f"{self.what} sent {message!r}, not a JSON object")
        if "error" in message:
            raise ChannelError("error", str(message["error"]))
        return message

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class Listener:
    """Trainer rank ``rank``'s end of [Note: vllm channel] for the engine's ``run``: listens on ``path`` from
    construction to :meth:`close`; :meth:`expect` says which hello a switch waits for, :meth:`accept` waits
    for it.

    Raises:
        ValueError: ``path`` is longer than a Unix socket path may be (:data:`MAX_PATH_CHARS`).
    """

    def __init__(self, path: str, rank: int, *, run: str):
        if len(os.fsencode(path)) > MAX_PATH_CHARS:
            raise ValueError(f"the channel path {path} has {len(os.fsencode(path))} bytes, more than a Unix "
                             f"socket path may ({MAX_PATH_CHARS}); pass a shorter staging_dir")
        self.path = path
        self.rank = rank
        self.run = run
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(8)
        self._lock = threading.Lock()
        self._wanted: tuple[str, int] | None = None
        self._last = 0  # the latest update this rank waited for
        self._early: dict[tuple[str, int], Connection] = {}  # hellos ahead of this rank
        self._aborted: dict[int, str] = {}
        self._arrived: queue.Queue[Connection | ChannelError] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=f"hybridmem-channel-rank{rank}", daemon=True)
        self._thread.start()

    def expect(self, run: str | None, generation: int | None = None) -> None:
        """Hand on the connection whose hello names ``run`` and ``generation`` (``None``: none; every
        connection is then refused). Clears what a previous switch left unclaimed."""
        with self._lock:
            self._wanted = None if run is None else (run, int(generation or 0))
            while True:
                try:
                    stale = self._arrived.get_nowait()
                except queue.Empty:
                    break
                if isinstance(stale, Connection):
                    _refuse(stale, "the trainer no longer waits for this update")
            if self._wanted is not None:
                self._last = max(self._last, self._wanted[1])
                early = self._early.pop(self._wanted, None)
                for key in [k for k in self._early if k[1] <= self._last]:
                    _refuse(self._early.pop(key), f"trainer rank {self.rank} gave up on update {key[1]}")
                if early is not None:
                    self._arrived.put(early)
                    self._wanted = None
                    return
            if self._wanted is not None and self._wanted[1] in self._aborted:  # rank 0 was first
                self._arrived.put(ChannelError("abort", self._aborted.pop(self._wanted[1])))
                self._wanted = None

    def accept(self, *, timeout_s: float, watch: Callable[[], None] | None = None) -> Connection:
        """The worker's connection for the update :meth:`expect` named, within ``timeout_s``.

        Raises:
            ChannelError: No connection in time (``"timeout"``), or rank 0 said the update failed
                (``"abort"``).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            left = _deadline_left(deadline)
            if left <= 0:
                raise ChannelError("timeout", f"vLLM worker rank {self.rank} did not connect to {self.path} "
                                   f"within {timeout_s:.1f} s")
            try:
                got = self._arrived.get(timeout=min(POLL_S, left))
            except queue.Empty:
                if watch is not None:
                    watch()
                continue
            if isinstance(got, ChannelError):
                raise got
            return got

    def _serve(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._hello, args=(sock,), daemon=True,
                             name=f"hybridmem-channel-hello-rank{self.rank}").start()

    def _hello(self, sock: socket.socket) -> None:
        conn = Connection(sock, what=f"vLLM worker rank {self.rank}")
        try:
            hello = conn.receive(timeout_s=30.0)
        except ChannelError:
            conn.close()
            return
        with self._lock:
            wanted = self._wanted
            if "abort" in hello:
                conn.close()
                cause = str(hello.get("cause", "rank 0 gave up"))
                if wanted is not None and int(hello["abort"]) == wanted[1]:
                    self._arrived.put(ChannelError("abort", cause))
                    self._wanted = None
                else:  # this rank has not got there yet
                    self._aborted = {int(hello["abort"]): cause}
                return
            key = (hello.get("run"), hello.get("generation"))
            if wanted is None and isinstance(key[1], int) and key[1] > self._last and key[0] == self.run:
                self._early[key] = conn  # handed on when this rank asks for it
                return
            if wanted is None or key != wanted:
                _refuse(conn, f"this update (run {key[0]}, update {key[1]}) is not the one trainer rank "
                        f"{self.rank} waits for ({'none' if wanted is None else wanted}): it gave up on it")
                return
            self._wanted = None  # one connection per update
            self._arrived.put(conn)

    def close(self) -> None:
        """Stop listening and remove the socket file."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.expect(None)
        with self._lock:
            for conn in self._early.values():
                _refuse(conn, f"trainer rank {self.rank} closed its engine")
            self._early.clear()


def _refuse(conn: Connection, cause: str) -> None:
    with contextlib.suppress(ChannelError):
        conn.send({"error": cause})
    conn.close()


def send_abort(path: str, generation: int, cause: str) -> None:
    """Tell the trainer rank listening on ``path`` that update ``generation`` failed before its worker
    connected (best effort: a rank already streaming finds out from its worker)."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5.0)
        sock.connect(path)
        sock.sendall(json.dumps({"abort": int(generation), "cause": cause}).encode() + b"\n")


class WorkerChannel(Connection):
    """A worker's end of [Note: vllm channel]: connects and says hello.

    Raises:
        ChannelError: Nobody listens at ``path`` (the trainer rank is gone).
    """

    def __init__(self, path: str, *, rank: int, run: str, generation: int):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            raise ChannelError("closed", f"vLLM worker rank {rank}: no trainer rank listens on {path} "
                               f"({exc.strerror or exc})") from exc
        super().__init__(sock, what=f"trainer rank {rank}")
        self.send({"hello": rank, "run": run, "generation": int(generation)})
