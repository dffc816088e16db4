"""Packing one trainer rank's stream of vLLM-layout tensors into its buckets, for its worker.

[Note: vllm packing]
The trainer side of a switch hands :class:`BucketWriter` this rank's tensors in the engine's own layout,
one complete tensor at a time (:meth:`~hybridmem.adapters.vllm.server.VLLMServerEngine.load_layout_weights`).
Each goes into the current bucket as byte ranges at :data:`~hybridmem.adapters.vllm.server.buckets.ALIGN`-ed
offsets; a tensor larger than what is left is split at element boundaries and goes on in the next bucket.
A full bucket is handed to the worker ([Note: vllm channel] in
:mod:`hybridmem.adapters.vllm.server.channel`) and the writer goes on in the other one; it waits only when
both are with the worker, for the acknowledgement the worker sends once it copied a bucket's bytes out.
So the trainer holds at most two buckets and the tensors in flight, whatever the model's size. On a CPU the
stream runs on one torch thread (:func:`~hybridmem.adapters.vllm.server.buckets.one_thread`, in
:meth:`~hybridmem.adapters.vllm.server.VLLMServerEngine.load_layout_weights`): the worker copies out of the
other bucket meanwhile on its own, and a trainer copying on every core would take the worker's.

A tensor is checked against the worker's load-time layout (name, shape) before any byte of it is written,
and cast to the layout's dtype where the stream's differs (never to or from e4m3: refused,
[Note: vllm fp8 server] in :mod:`hybridmem.adapters.vllm.server.engine`). The stream may build a tensor in
its bucket right away (:meth:`BucketWriter.reserve`: the next tensor's bytes, whole, in one bucket); its
:meth:`BucketWriter.put` then records it where it lies, with no copy. A tensor larger than a bucket, or
of another dtype, is never reserved. With ``verify``, its figures (the one checksum,
:func:`hybridmem.reshard.checksum.tensor_checksum`) are taken on the trainer's device from the tensor as it
is packed, and sent with the bucket that completes it: while it is copied into its buckets
(:func:`~hybridmem.reshard.checksum.copy_checksum`, one pass on a CPU: [Note: fused figures] in
:mod:`hybridmem.reshard.fused_checksum`), or by one read of a tensor built in its bucket. On CUDA the
copies into a bucket are complete (an event the host waits for) before the bucket's message leaves.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridmem.adapters.vllm.server.buckets import (
    ALIGN,
    Buckets,
    BucketState,
    aligned,
    dtype_name,
    one_thread,
)
from hybridmem.adapters.vllm.server.channel import ChannelError, Connection
from hybridmem.reshard.checksum import copy_checksum, tensor_checksum

__all__ = ["BucketWriter", "StreamStats"]


@dataclass(frozen=True, slots=True)
class StreamStats:
    """What one rank's stream moved."""

    num_tensors: int
    nbytes: int
    """Tensor bytes written into buckets (alignment gaps not counted)."""
    num_handed: int
    """Buckets handed to the worker."""
    seconds: float
    checksum_s: float = 0.0
    """Of :attr:`seconds`, reading figures apart from a copy on the trainer's side (tensors built in their
    bucket; the others' are taken while they are copied)."""
    worker_checksum_s: float = 0.0
    """The worker's time reading figures apart from its copies (its own clock; overlaps the trainer's
    packing)."""
    worker_copy_s: float = 0.0
    """The worker's time copying out of the buckets, the figures taken on the way (its own clock)."""
    num_in_place: int = 0
    """Of :attr:`num_tensors`, those the stream built in their bucket (no copy into it)."""


class BucketWriter:
    """One switch's packing on one trainer rank (see [Note: vllm packing]).

    Args:
        buckets: The rank's buckets (every one free).
        conn: The connection to this rank's worker.
        layout: The worker's load-time layout: name -> (shape, dtype).
        run: The engine's run id (in every message).
        verify: Send each tensor's figures (taken while it is copied into its buckets).
        ack_timeout_s: The longest wait for one acknowledgement (or the final answer).
        watch: Runs while waiting and raises once the update is known to have failed elsewhere.
    """

    def __init__(self, buckets: Buckets, conn: Connection,
                 layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]], *, run: str,
                 verify: bool, ack_timeout_s: float,
                 watch: Callable[[], None] | None = None):
        if any(s is not BucketState.FREE for s in buckets.states):
            raise RuntimeError(f"buckets {buckets.states} are not all free at the start of a switch "
                               f"(internal error: the previous switch did not wait for its worker)")
        self.buckets = buckets
        self.conn = conn
        self.layout = layout
        self.run = run
        self.verify = verify
        self.ack_timeout_s = float(ack_timeout_s)
        self.watch = watch
        self.written: list[str] = []
        """Names of the tensors packed so far, in order."""
        self.nbytes = 0
        self.checksum_s = 0.0
        """Seconds spent reading figures apart from a copy so far (a tensor built in its bucket)."""
        self._start = time.perf_counter()
        self._current = 0
        self._fill = 0
        self._entries: list[dict[str, Any]] = []
        self._figures: dict[str, list[float]] = {}
        self._seq = 0
        self._handed = 0
        self._pending: list[tuple[int, int]] = []  # (bucket, seq) with the worker, in order
        self._reserved: tuple[str, torch.Tensor] | None = None
        self.num_in_place = 0
        """Tensors built in their bucket by the stream (:meth:`reserve`), so put without a copy."""

    def reserve(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The bucket bytes the next :meth:`put`, of ``name``, will take, as a tensor to build it in; ``None``
        where it would not lie whole in one bucket in the layout's dtype and shape (then build it elsewhere).

        Hands the current bucket over first where what is left of it is too small.

        Raises:
            ChannelError: As :meth:`put` (waiting for a bucket to come back).
        """
        want = self.layout.get(name)
        if want is None or tuple(want[0]) != tuple(shape) or want[1] != dtype or name in self.written:
            return None
        nbytes = dtype.itemsize * math.prod(shape)
        if not 0 < nbytes <= self.buckets.bucket_nbytes:
            return None
        if aligned(self._fill) + nbytes > self.buckets.bucket_nbytes:
            self._hand_over()
        offset = aligned(self._fill)
        view = self.buckets.views[self._current][offset:offset + nbytes].view(dtype).view(shape)
        self._reserved = (name, view)
        return view

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Pack one complete tensor of the layout.

        Raises:
            ValueError: ``name`` is not in the layout, was packed already, or has another shape.
            ChannelError: The worker closed the channel, refused, or did not acknowledge in time.
        """
        want = self.layout.get(name)
        if want is None:
            raise ValueError(f"{name!r} is not a tensor of the vLLM worker's layout (e.g. "
                             f"{sorted(self.layout)[:3]})")
        shape, dtype = want
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{name}: the stream gives shape {tuple(tensor.shape)}, the worker's layout "
                             f"{tuple(shape)}")
        if name in self._figures or name in self.written:
            raise ValueError(f"{name} was given twice in one switch")
        reserved, self._reserved = self._reserved, None
        if reserved is not None and reserved[0] != name:
            raise RuntimeError(f"the stream reserved bucket bytes for {reserved[0]} and then gave {name} "
                               f"(internal error: a reserved tensor is given next)")
        if tensor.dtype != dtype and torch.float8_e4m3fn in (tensor.dtype, dtype):
            raise ValueError(f"{name}: the stream gives {tensor.dtype}, the worker's layout holds {dtype}; "
                             f"an FP8 tensor is never cast (a cast would quantize without scales)")
        flat = tensor.detach().to(dtype).reshape(-1)
        in_place = reserved is not None and flat.data_ptr() == reserved[1].data_ptr() and \
            flat.numel() == reserved[1].numel()
        figures = None
        if self.verify and in_place:  # no copy to take them in: one read
            start = time.perf_counter()
            with one_thread(flat.device):
                figures = tensor_checksum(flat.view(shape))
            self.checksum_s += time.perf_counter() - start
        elif self.verify:
            figures = (0.0, 0.0)
        size = flat.element_size()
        numel, done = flat.numel(), 0
        while True:
            offset = aligned(self._fill)
            room = (self.buckets.bucket_nbytes - offset) // size if offset < self.buckets.bucket_nbytes else 0
            if room <= 0 and (numel > done or not numel):
                self._hand_over()
                continue
            count = min(room, numel - done)
            if in_place and (count != numel or offset != reserved[1].data_ptr() - self.buckets.views[
                    self._current].data_ptr()):
                raise RuntimeError(f"{name}: its reserved bucket bytes moved (internal error)")
            if not in_place:
                view = self.buckets.views[self._current][offset:offset + count * size].view(dtype)
                if figures is None:
                    view.copy_(flat[done:done + count])
                else:
                    with one_thread(flat.device):
                        part = copy_checksum(view, flat[done:done + count], done, shape)
                    figures = (figures[0] + part[0], figures[1] + part[1])
            self._entries.append({"name": name, "dtype": dtype_name(dtype), "shape": list(shape),
                                  "start": done * size, "end": (done + count) * size, "offset": offset})
            self._fill = offset + count * size
            done += count
            if done >= numel:
                break
        if figures is not None:
            self._figures[name] = [float(figures[0]), float(figures[1])]
        self.num_in_place += in_place
        self.written.append(name)
        self.nbytes += numel * size
        if aligned(self._fill) >= self.buckets.bucket_nbytes:
            self._hand_over()

    def _hand_over(self) -> None:
        """Send the current bucket's message, then go on in the next bucket once the worker freed it."""
        i = self._current
        if self._entries:
            if self.buckets.device.type == "cuda":  # the bytes are in the bucket before the worker reads them
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.buckets.device))
                done.synchronize()
            self.conn.send({"bucket": i, "seq": self._seq, "run": self.run, "entries": self._entries,
                            "figures": self._figures})
            self.buckets.states[i] = BucketState.WITH_WORKER
            self._pending.append((i, self._seq))
            self._seq += 1
            self._handed += 1
            self._entries, self._figures = [], {}
        self._current = (i + 1) % self.buckets.num_buckets
        self._fill = 0
        while self.buckets.states[self._current] is not BucketState.FREE:
            self._acknowledged()

    def _acknowledged(self) -> None:
        """Wait for the worker's next acknowledgement and free that bucket."""
        i, seq = self._pending[0]
        message = self.conn.receive(timeout_s=self.ack_timeout_s, watch=self.watch)
        if message.get("done") != i or message.get("seq") != seq:
            raise ChannelError("error", f"the worker acknowledged {message}, expected bucket {i} (message "
                               f"{seq})")
        self._pending.pop(0)
        self.buckets.states[i] = BucketState.FREE

    def finish(self) -> StreamStats:
        """Hand over the last bucket, say how many tensors were sent, and wait for the worker to say it wrote
        and processed all of them (every bucket is free again then).

        Raises:
            ChannelError: As :meth:`put`; or the worker counted other tensors.
        """
        if self._entries:
            self._hand_over()
        self.conn.send({"end": True, "tensors": len(self.written), "run": self.run})
        while self._pending:
            self._acknowledged()
        message = self.conn.receive(timeout_s=self.ack_timeout_s, watch=self.watch)
        if message.get("end") is not True or message.get("tensors") != len(self.written):
            raise ChannelError("error", f"the worker answered the end of the stream with {message}, expected "
                               f"{{'end': True, 'tensors': {len(self.written)}}}")
        return StreamStats(num_tensors=len(self.written), nbytes=self.nbytes, num_handed=self._handed,
                           seconds=time.perf_counter() - self._start, checksum_s=self.checksum_s,
                           num_in_place=self.num_in_place, worker_checksum_s=_seconds(message, "checksum_s"),
                           worker_copy_s=_seconds(message, "copy_s"))

    def holding(self) -> list[int]:
        """The buckets with the worker now, in the order it took them."""
        return [i for i, _ in self._pending]

    def abandon(self) -> None:
        """Give up this switch: close the connection (the worker then fails its update at once) and count
        every bucket free (the worker's copies out of them end with its update)."""
        self.conn.close()
        self._reserved = None
        self.buckets.states = [BucketState.FREE] * self.buckets.num_buckets


def _seconds(message: dict[str, Any], field: str) -> float:
    """A time the worker's answer gives (0 where it gives none)."""
    value = message.get(field, 0.0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


assert ALIGN % 16 == 0, "a range's offset must suit every dtype's element"
