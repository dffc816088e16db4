"""The fixed-size buckets one trainer rank's weights travel through to its vLLM worker.

[Note: vllm buckets]
An engine in its own process cannot receive tensors as RPC arguments (vLLM's RPCs carry JSON or pickles,
and the HTTP server JSON only), so each trainer rank owns :data:`NUM_BUCKETS` buffers of ``bucket_nbytes``
that its own worker rank maps too, allocated once per engine and reused by every switch (as vLLM's
``packed_tensor.py`` reuses its two IPC buffers):

- CPU: files in the engine's shared directory (``/dev/shm``: RAM), allocated in full at construction
  (``posix_fallocate``: a full ``/dev/shm`` is an error then, not a ``SIGBUS`` in the middle of a switch),
  mapped by the trainer and by the worker;
- CUDA: device buffers on the trainer rank's device, shared once per run through CUDA IPC
  (``torch.multiprocessing.reductions.reduce_tensor``); the worker opens each handle once
  (``rebuild_cuda_tensor`` with its own device index) and checks that it is the same physical device.
  The IPC arguments travel as plain JSON (:func:`encode_ipc` / :func:`decode_ipc`: numbers and base64
  bytes): no pickle crosses the wire, so the worker needs no ``VLLM_ALLOW_INSECURE_SERIALIZATION``;
- NPU: refused by name (no IPC path for torch_npu tensors was read).

A switch packs this rank's tensors into them (:mod:`hybridmem.adapters.vllm.server.packing`) and tells the
worker what each holds over the rank's channel (:mod:`hybridmem.adapters.vllm.server.channel`). The
buckets stay allocated in both phases: the memory plan counts them as the owner ``"engine buckets"`` of
the trainer's device (host RAM on CPU).

``bucket_nbytes=None`` picks :func:`default_bucket_nbytes` (:mod:`hybridmem.contract.buckets`, the one rule
the memory plan's ``--engine-process`` counts too): 64 MiB on CPU (a quarter of the shared
directory's free space where that is less); on CUDA a sixteenth of the device's free memory at
construction (both buckets: an eighth), at most 1 GiB (vLLM's own packed default) and at least 1 MiB.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from enum import Enum
from typing import Any

import torch

from hybridmem.contract.buckets import (
    CPU_BUCKET_NBYTES,
    MAX_DEFAULT_BUCKET_NBYTES,
    MIN_BUCKET_NBYTES,
    NUM_BUCKETS,
    default_bucket_nbytes,
)

__all__ = ["ALIGN", "NUM_BUCKETS", "MIN_BUCKET_NBYTES", "MAX_DEFAULT_BUCKET_NBYTES", "CPU_BUCKET_NBYTES",
           "BucketState", "Buckets", "default_bucket_nbytes", "check_bucket_nbytes", "open_buckets",
           "encode_ipc", "decode_ipc", "aligned", "dtype_name", "dtype_of", "one_thread"]

ALIGN = 64
"""Byte alignment of every range in a bucket (any dtype's element, and vector loads)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (how dtypes travel)."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``.

    Raises:
        ValueError: ``name`` is no torch dtype.
    """
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype")
    return dtype


def aligned(offset: int) -> int:
    """``offset`` rounded up to :data:`ALIGN`."""
    return -(-offset // ALIGN) * ALIGN


class BucketState(Enum):
    """Where one bucket is in a switch (the bytes never move: a file in ``/dev/shm`` or a device buffer of
    the trainer rank, mapped by both processes)."""

    FREE = "free"
    """The trainer may write it: the worker holds no reference to its bytes."""
    WITH_WORKER = "with_worker"
    """Handed to the worker, which copies its ranges out; the trainer writes it again only after the
    worker's acknowledgement."""


def check_bucket_nbytes(bucket_nbytes: int, *, limit_nbytes: int, what: str,
                        num_buckets: int = NUM_BUCKETS) -> int:
    """``bucket_nbytes`` as an int, when ``num_buckets`` of it fit in ``limit_nbytes``.

    Raises:
        TypeError: Not an integer.
        ValueError: Below :data:`MIN_BUCKET_NBYTES` (0 and negatives included).
        MemoryError: ``num_buckets`` buckets exceed ``limit_nbytes`` (``what`` names where they go).
    """
    if isinstance(bucket_nbytes, bool) or not isinstance(bucket_nbytes, int):
        raise TypeError(f"bucket_nbytes={bucket_nbytes!r}; expected an integer number of bytes or None")
    if bucket_nbytes < MIN_BUCKET_NBYTES:
        raise ValueError(f"bucket_nbytes={bucket_nbytes}; expected at least {MIN_BUCKET_NBYTES} (one page), "
                         f"or None for the default")
    if num_buckets * bucket_nbytes > limit_nbytes:
        raise MemoryError(f"bucket_nbytes={bucket_nbytes}: {num_buckets} buckets need "
                          f"{num_buckets * bucket_nbytes} bytes, {what} has {limit_nbytes} free; pass a "
                          f"smaller bucket_nbytes")
    return int(bucket_nbytes)


def bucket_limit(device: torch.device, directory: str) -> tuple[int, str]:
    """What the buckets may take on ``device`` and where that is: the free bytes of ``directory`` (CPU) or
    of the device (CUDA).

    Raises:
        ValueError: ``device`` is an NPU or another device without a bucket path.
    """
    if device.type == "cpu":
        return shutil.disk_usage(directory).free, f"the shared directory {directory}"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"device {device}"
    raise ValueError(f"VLLMServerEngine moves weights through CPU shared memory or CUDA IPC; device "
                     f"{device} ({device.type}) has no bucket path (an NPU engine runs in the trainer's "
                     f"process: VLLMEngine)")


class Buckets:
    """The :data:`NUM_BUCKETS` buckets of one trainer rank (see [Note: vllm buckets]).

    Args:
        directory: The engine's shared directory (CPU bucket files go there).
        rank: The trainer rank (names the files).
        bucket_nbytes: Bytes per bucket (checked by :func:`check_bucket_nbytes` first).
        device: Where they live: ``cpu`` or a CUDA device.
        num_buckets: How many.

    Raises:
        MemoryError: The shared directory (CPU) cannot hold them after all.
        ValueError: ``device`` has no bucket path.
    """

    def __init__(self, directory: str, rank: int, *, bucket_nbytes: int, device: torch.device,
                 num_buckets: int = NUM_BUCKETS):
        self.bucket_nbytes = int(bucket_nbytes)
        self.device = torch.device(device)
        self.paths: list[str] = []
        self.views: list[torch.Tensor] = []
        """Each bucket's bytes (``uint8``, ``bucket_nbytes`` long), writable."""
        self.states = [BucketState.FREE] * num_buckets
        if self.device.type == "cpu":
            for i in range(num_buckets):
                path = os.path.join(directory, f"bucket-rank{rank}-{i}.bin")
                self.paths.append(path)
                self.views.append(_shared_file(path, self.bucket_nbytes))
        elif self.device.type == "cuda":
            self.views = [torch.empty(self.bucket_nbytes, dtype=torch.uint8, device=self.device)
                          for _ in range(num_buckets)]
        else:
            bucket_limit(self.device, directory)  # raises, naming the device
        self._handles: list[dict[str, Any]] | None = None

    @property
    def num_buckets(self) -> int:
        return len(self.views)

    @property
    def nbytes(self) -> int:
        """Bytes the buckets hold (on the trainer's device; host RAM on CPU)."""
        return self.bucket_nbytes * len(self.views)

    def descriptor(self) -> dict[str, Any]:
        """Where a worker finds these buckets, as JSON (:func:`open_buckets` reads it)."""
        if self.device.type == "cpu":
            return {"kind": "cpu", "paths": list(self.paths)}
        if self._handles is None:
            from torch.multiprocessing.reductions import reduce_tensor  # noqa: PLC0415

            self._handles = [encode_ipc(reduce_tensor(v)[1]) for v in self.views]
            torch.cuda.current_stream(self.device).synchronize()
        uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        return {"kind": "cuda", "uuid": uuid, "handles": self._handles}

    def close(self) -> None:
        """Drop the buffers and remove the files (the worker's mappings stay valid until it drops them)."""
        self.views = []
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if self.device.type == "cuda" and self._handles is not None:
            torch.cuda.ipc_collect()


def _shared_file(path: str, nbytes: int) -> torch.Tensor:
    """A file of ``nbytes`` in RAM-backed ``path``, allocated in full now, mapped writable."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.unlink(path)
            raise MemoryError(f"bucket_nbytes={nbytes}: allocating {path} failed ({exc.strerror}); "
                              f"{os.path.dirname(path)} has {shutil.disk_usage(os.path.dirname(path)).free} "
                              f"bytes free: pass a smaller bucket_nbytes or make /dev/shm larger (docker "
                              f"run --shm-size)") from exc
    finally:
        os.close(fd)
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


# CUDA IPC as JSON -----------------------------------------------------------------------------------------
_IPC_FIELDS = ("size", "stride", "offset", None, None, "device", "handle", "storage_nbytes",
               "storage_offset_nbytes", None, "ref_counter_handle", "ref_counter_offset", "event_handle",
               "event_sync_required")
"""``reduce_tensor``'s rebuild arguments after the tensor's class (torch 2.11 to 2.13,
``torch/multiprocessing/reductions.py``): ``None`` marks the storage class, dtype and ``requires_grad``,
which are fixed for a bucket (``TypedStorage``, ``uint8``, ``False``)."""


def encode_ipc(args: Sequence[Any]) -> dict[str, Any]:
    """``reduce_tensor(bucket)[1]`` as JSON: numbers, and bytes in base64.

    Raises:
        TypeError: The arguments are not those of a plain ``uint8`` CUDA tensor as torch 2.11-2.13 shares it.
    """
    args = tuple(args)
    if (len(args) != 1 + len(_IPC_FIELDS) or args[0] is not torch.Tensor or args[5] is not torch.uint8
            or args[10]):
        raise TypeError(f"reduce_tensor gave {len(args)} arguments starting {args[:1]}: not those of a "
                        f"uint8 tensor as torch 2.11-2.13 shares one; this torch ({torch.__version__}) "
                        f"shares CUDA tensors otherwise")
    out: dict[str, Any] = {}
    for key, value in zip(_IPC_FIELDS, args[1:], strict=True):
        if key is None:
            continue
        if isinstance(value, bytes):
            value = {"b64": base64.b64encode(value).decode("ascii")}
        elif isinstance(value, torch.Size | tuple):
            value = [int(v) for v in value]
        out[key] = value
    return out


def decode_ipc(encoded: Mapping[str, Any], device_index: int) -> tuple[Any, ...]:
    """:func:`encode_ipc`'s arguments back, for ``rebuild_cuda_tensor`` on ``device_index``."""
    def field(key: str) -> Any:
        value = encoded[key]
        if isinstance(value, dict):
            return base64.b64decode(value["b64"])
        return value

    values = []
    for key in _IPC_FIELDS:
        if key is None:
            values.append(None)
        elif key == "device":
            values.append(int(device_index))
        elif key in ("size", "stride"):
            values.append(torch.Size(field(key)) if key == "size" else tuple(field(key)))
        else:
            values.append(field(key))
    values[3], values[4], values[9] = torch.storage.TypedStorage, torch.uint8, False
    return (torch.Tensor, *values)


def open_buckets(descriptor: Mapping[str, Any], *, bucket_nbytes: int,
                 device: torch.device) -> list[torch.Tensor]:
    """The worker's view of a trainer rank's buckets (``uint8``, ``bucket_nbytes`` each), opened once.

    Raises:
        ValueError: A file is missing or shorter than ``bucket_nbytes``, the buckets are on another physical
            device than ``device``, or the kind is unknown; each names what it found.
    """
    kind = descriptor.get("kind")
    if kind == "cpu":
        views = []
        for path in descriptor["paths"]:
            try:
                size = os.path.getsize(path)
            except OSError as exc:
                raise ValueError(f"bucket {path}: {exc.strerror}") from exc
            if size < bucket_nbytes:
                raise ValueError(f"bucket {path} holds {size} bytes, fewer than "
                                 f"bucket_nbytes={bucket_nbytes}")
            storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=bucket_nbytes)
            views.append(torch.empty(0, dtype=torch.uint8).set_(storage))
        return views
    if kind == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor  # noqa: PLC0415

        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        if descriptor.get("uuid") != uuid:
            raise ValueError(f"the trainer rank's buckets are on GPU {descriptor.get('uuid')}, this worker "
                             f"on {uuid}: run each trainer rank on its worker rank's device")
        return [rebuild_cuda_tensor(*decode_ipc(h, index))[:bucket_nbytes] for h in descriptor["handles"]]
    raise ValueError(f"bucket kind {kind!r}; expected 'cpu' or 'cuda'")


@contextlib.contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """Torch on one thread while the block runs, for a CPU ``device``: a bucket's copies and the figures
    of a tensor, taken on each side while the other side copies a bucket on the same cores, where each
    of torch's parallel operations would wait for the slowest of its threads (on cpu-2c beside a vLLM
    worker: the checksum of 633 MB 1.4 s on two threads, 0.2 s on one; the stand-in worker of
    ``benchmarks/bucket_transport.py --device cpu --quick`` copying 10 MB out of 1 MiB buckets 92 ms a
    round on two threads, against the trainer's copies into the other bucket)."""
    if device.type != "cpu" or torch.get_num_threads() == 1:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
