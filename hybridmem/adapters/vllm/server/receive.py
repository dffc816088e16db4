"""The receiving end of one rank's bucket stream, without vLLM: check each message, copy its ranges out of the
opened buckets into their tensors (taking their figures on the way: one pass over the bytes on a CPU,
[Note: fused figures] in :mod:`hybridmem.reshard.fused_checksum`), acknowledge, check the figures, and take
the end of the stream.

[Note: vllm receive]
This module imports no vLLM, and nothing that does: it is the part of the worker side of [Note: vllm
transfer backend] in :mod:`hybridmem.adapters.vllm.server.transfer` that any destination shares. vLLM's
backend subclasses :class:`StreamUpdate` with its model's tensors (a module with a quantization method put
into load-time form, and processed again once complete); ``benchmarks/bucket_transport.py`` runs the same
:func:`receive_stream` and :class:`StreamUpdate` in a stand-in worker process with plain tensors, on a
GPU machine without vLLM. So the stand-in measures and checks the very code vLLM's workers run; a
module-level vLLM import here would take that away (``bucket_transport.py``'s worker refuses to run with
``vllm`` in ``sys.modules``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hybridmem.accel.huge_pages import advise_huge_pages
from hybridmem.adapters.vllm.server.buckets import dtype_name, dtype_of, one_thread
from hybridmem.adapters.vllm.server.channel import ChannelError, Connection
from hybridmem.reshard.checksum import copy_checksum, tensor_checksum

__all__ = ["StreamUpdate", "receive_stream", "check_bucket_message", "check_fields"]

_Layout = Mapping[str, tuple[tuple[int, ...], torch.dtype]]

_ENTRY_TYPES: dict[str, tuple[type, ...]] = {"name": (str,), "dtype": (str,), "shape": (list,),
                                             "start": (int,), "end": (int,), "offset": (int,)}


def check_fields(what: str, data: Any, types: dict[str, tuple[type, ...]], required: tuple[str, ...]) -> None:
    """Refuse ``data`` unless it is a dict of the fields in ``types`` (``required`` among them), each of its
    type; the error names the field.

    Raises:
        ValueError: Not a dict, an unknown or missing field, or a field of another type.
    """
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(types))
    if unknown:
        raise ValueError(f"{what}: unknown field {unknown[0]!r} (expected {sorted(types)})")
    for name in required:
        if name not in data:
            raise ValueError(f"{what}: missing field {name!r}")
    for name, value in data.items():
        if isinstance(value, bool) and bool not in types[name] or not isinstance(value, types[name]):
            raise ValueError(f"{what}: field {name!r} is {type(value).__name__} {value!r:.80}, expected "
                             f"{' or '.join(t.__name__ for t in types[name])}")


def check_bucket_message(message: Any, *, run: str, num_buckets: int, bucket_nbytes: int, layout: _Layout,
                         received: dict[str, int]) -> list[dict[str, Any]]:
    """The entries of one bucket message of [Note: vllm channel] in
    :mod:`hybridmem.adapters.vllm.server.channel`, checked before any byte is copied (step 1 of [Note: vllm
    transfer backend] in :mod:`hybridmem.adapters.vllm.server.transfer`); ``received``: bytes of each tensor
    received so far in this update.

    Raises:
        ValueError: A field is missing, of another type, or out of bounds; names it.
    """
    check_fields("bucket message", message, {"bucket": (int,), "seq": (int,), "run": (str,),
                                             "entries": (list,), "figures": (dict,)},
                 ("bucket", "seq", "run", "entries", "figures"))
    if message["run"] != run:
        raise ValueError(f"bucket message: field 'run' is {message['run']!r}, a previous run's (this worker "
                         f"was initialised for run {run!r}); refused")
    if not 0 <= message["bucket"] < num_buckets:
        raise ValueError(f"bucket message: field 'bucket' is {message['bucket']}, expected "
                         f"0..{num_buckets - 1}")
    seen = dict(received)
    ends: dict[str, int] = {}
    for i, entry in enumerate(message["entries"]):
        check_fields(f"bucket message entry {i}", entry, _ENTRY_TYPES, tuple(_ENTRY_TYPES))
        name = entry["name"]
        if name not in layout:
            raise ValueError(f"bucket message entry {i}: field 'name' is {name!r}, not a tensor of this "
                             f"worker's layout")
        shape, dtype = layout[name]
        if tuple(entry["shape"]) != shape or entry["dtype"] != dtype_name(dtype):
            raise ValueError(f"bucket message entry {i}: {name} is {entry['shape']} {entry['dtype']}, the "
                             f"model's load-time {list(shape)} {dtype_name(dtype)}")
        nbytes = math.prod(shape) * dtype.itemsize
        start, end, offset = entry["start"], entry["end"], entry["offset"]
        if start != seen.get(name, 0) or not start <= end <= nbytes:
            raise ValueError(f"bucket message entry {i}: {name} bytes [{start}, {end}) do not follow the "
                             f"{seen.get(name, 0)} received of its {nbytes}")
        if start % dtype.itemsize or end % dtype.itemsize or offset % dtype.itemsize:
            raise ValueError(f"bucket message entry {i}: {name} range [{start}, {end}) at {offset} is not "
                             f"whole {dtype_name(dtype)} elements")
        if offset < 0 or offset + end - start > bucket_nbytes:
            raise ValueError(f"bucket message entry {i}: field 'offset' {offset} puts {end - start} bytes "
                             f"outside the {bucket_nbytes}-byte bucket")
        seen[name] = end
        ends[name] = nbytes
    for name, value in message["figures"].items():
        if name not in ends or seen[name] != ends[name]:
            raise ValueError(f"bucket message: field 'figures' names {name!r}, which this bucket does not "
                             f"complete")
        if (not isinstance(value, list) or len(value) != 2
                or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)):
            raise ValueError(f"bucket message: field 'figures' of {name} is {value!r:.80}, expected [sum, "
                             f"weighted]")
    return message["entries"]


class StreamUpdate:
    """One update on one worker: steps 2 to 4 of [Note: vllm transfer backend] in
    :mod:`hybridmem.adapters.vllm.server.transfer`, for any destination (see [Note: vllm receive]).

    A subclass says where a tensor's bytes go (:meth:`target`), where its figures are read
    (:meth:`held`), what follows a tensor's completion (:meth:`on_complete`) and how a failed update is
    put back (:meth:`abandon`); this class writes into the tensors ``tensors`` maps.

    Args:
        layout: The tensors a complete update writes: name -> (load-time shape, dtype).
        run: The run every message must name.
        verify: Check each complete tensor against the figures the trainer sent.
        who: The worker, as errors name it (``"vLLM worker rank 0"``).
        tensors: Destination tensors by name (for this class's :meth:`target`).
    """

    def __init__(self, layout: _Layout, *, run: str, verify: bool, who: str,
                 tensors: Mapping[str, torch.Tensor] | None = None):
        self.layout = layout
        self.run = run
        self.verify = verify
        self.who = who
        self.tensors = tensors or {}
        self.received: dict[str, int] = {}
        """Bytes of each tensor received so far."""
        self.complete: list[str] = []
        """Tensors received whole (and checked), in order."""
        self.touched = False
        """Whether a byte of the destination was written (a failure then leaves it partly updated)."""
        self.checksum_s = 0.0
        """Seconds spent reading the figures of complete tensors apart from their copies (see
        :meth:`copy`)."""
        self.copy_s = 0.0
        """Seconds spent copying ranges out of buckets, their figures taken on the way."""
        self._figures: dict[str, tuple[float, float]] = {}
        """Figures of each tensor's ranges, taken while they were copied."""
        self._copied_into: dict[str, int] = {}
        """The address each tensor's ranges were copied into."""

    def target(self, name: str) -> torch.Tensor:
        """The tensor ``name``'s bytes go into."""
        return self.tensors[name]

    def held(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as the worker holds it once complete (its figures are read from it)."""
        return self.target(name).data

    def on_complete(self, name: str) -> None:
        """``name`` arrived whole and passed its check."""

    def abandon(self) -> None:
        """The update failed: put what it opened back (nothing here)."""

    def copy(self, bucket: torch.Tensor, entries: list[dict[str, Any]]) -> None:
        """Step 2: the ranges of one bucket into their tensors (the bucket is free once this returns); with
        ``verify``, each range's figures taken as it is copied
        (:func:`~hybridmem.reshard.checksum.copy_checksum`). Before a tensor's first range its memory is
        asked for huge pages on a CPU ([Note: huge pages for fresh tensors] in
        :mod:`hybridmem.accel.huge_pages`: vLLM's reload gives fresh tensors every update)."""
        start = time.perf_counter()
        for entry in entries:
            name = entry["name"]
            dtype = dtype_of(entry["dtype"])
            size = dtype.itemsize
            target = self.target(name).data.view(-1)
            source = bucket[entry["offset"]:entry["offset"] + entry["end"] - entry["start"]].view(dtype)
            self.touched = True
            if entry["start"] == 0:  # its first range: pages nobody touched yet come as huge ones
                advise_huge_pages(target)
            into = target[entry["start"] // size:entry["end"] // size]
            if self.verify:
                with one_thread(into.device):
                    part = copy_checksum(into, source, entry["start"] // size, self.layout[name][0])
                before = self._figures.get(name, (0.0, 0.0))
                self._figures[name] = (before[0] + part[0], before[1] + part[1])
                self._copied_into[name] = target.data_ptr()
            else:
                with one_thread(into.device):
                    into.copy_(source)
            self.received[name] = entry["end"]
        self.copy_s += time.perf_counter() - start
        if bucket.device.type == "cuda":  # copied out before the trainer may write the bucket again
            torch.cuda.current_stream(bucket.device).synchronize()

    def completed(self, entries: list[dict[str, Any]], figures: dict[str, list[float]]) -> None:
        """Step 3 for the tensors this bucket completed.

        Raises:
            ValueError: A complete tensor's figures differ from the trainer's, or none came with it.
        """
        for entry in entries:
            name = entry["name"]
            shape, dtype = self.layout[name]
            if self.received[name] != math.prod(shape) * dtype.itemsize or name in self.complete:
                continue
            if self.verify:
                if name not in figures:
                    raise ValueError(f"{self.who}: the bucket completing {name} carries no figures")
                held = self.held(name).view(shape)
                got = self._figures.get(name)
                if got is None or held.data_ptr() != self._copied_into.get(name):
                    # the module holds other memory than the copies wrote into: read what it holds
                    start = time.perf_counter()
                    with one_thread(held.device):
                        got = tensor_checksum(held)
                    self.checksum_s += time.perf_counter() - start
                want = figures[name]
                if not (_close(got[0], want[0]) and _close(got[1], want[1])):
                    raise ValueError(f"{self.who}: staged tensor {name} reads (sum, weighted) {got}, the "
                                     f"trainer sent {tuple(want)}")
            self.complete.append(name)
            self.on_complete(name)

    def end(self, message: dict[str, Any]) -> None:
        """Step 4: the trainer's end of the stream.

        Raises:
            ValueError: A malformed end, another run's, or a count or a layout the stream did not complete.
        """
        check_fields("end message", message, {"end": (bool,), "tensors": (int,), "run": (str,)},
                     ("end", "tensors", "run"))
        if message["run"] != self.run:
            raise ValueError(f"end message: field 'run' is {message['run']!r}, a previous run's (this worker "
                             f"was initialised for run {self.run!r}); refused{self.written()}")
        if message["tensors"] != len(self.complete):
            raise ValueError(f"{self.who}: the trainer sent {message['tensors']} tensors, "
                             f"{len(self.complete)} arrived complete")
        complete = set(self.complete)
        missing = [n for n in self.layout if n not in complete]
        if missing:
            raise ValueError(f"{self.who}: this update did not rewrite {len(missing)} tensors "
                             f"(e.g. {missing[:3]}){self.written()}")

    def written(self) -> str:
        """What a failure leaves, in words (appended to its message)."""
        return ("; the model is partly updated until a complete update" if self.touched
                else "; nothing was written")


def receive_stream(channel: Connection, buckets: Sequence[torch.Tensor], update: StreamUpdate, *,
                   wait_s: float) -> None:
    """Consume one rank's stream to its end (the messages of [Note: vllm channel] in
    :mod:`hybridmem.adapters.vllm.server.channel`), then close ``channel``: each bucket message checked,
    its ranges copied out of ``buckets`` (opened once per run,
    :func:`~hybridmem.adapters.vllm.server.buckets.open_buckets`), acknowledged, and the tensors it
    completes checked; the end answered with the count of complete tensors.

    On a failure the update is abandoned (:meth:`StreamUpdate.abandon`) and the trainer told why before
    the error is raised.

    Raises:
        RuntimeError: The channel broke (closed, silent for ``wait_s``, or the trainer's error).
        ValueError: A message was malformed, a tensor's figures differ, or the stream ended incomplete.
    """
    try:
        while True:
            message = channel.receive(timeout_s=wait_s)
            if "end" in message:
                update.end(message)
                channel.send({"end": True, "tensors": len(update.complete), "checksum_s": update.checksum_s,
                              "copy_s": update.copy_s})
                break
            entries = check_bucket_message(message, run=update.run, num_buckets=len(buckets),
                                           bucket_nbytes=buckets[0].numel(), layout=update.layout,
                                           received=update.received)
            with torch.no_grad():
                update.copy(buckets[message["bucket"]], entries)
            channel.send({"done": message["bucket"], "seq": message["seq"]})
            with torch.no_grad():
                update.completed(entries, message["figures"])
    except BaseException as exc:
        update.abandon()
        with contextlib.suppress(ChannelError):
            channel.send({"error": f"{update.who}: {exc}"})
        if isinstance(exc, ChannelError):
            raise RuntimeError(f"{update.who}: {exc}{update.written()}") from exc
        raise
    finally:
        channel.close()


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))
