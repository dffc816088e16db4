"""Shared-memory staging of one vLLM worker's weights: written by the trainer, read by the worker.

[Note: vllm staging]
An engine in its own process cannot receive tensors as RPC arguments (vLLM's RPCs carry JSON or pickles,
and the HTTP server JSON only). So each vLLM worker rank gets one file in ``/dev/shm`` holding its own
weights in the vLLM layout (its TP shard of every parameter, fused ``qkv_proj``/``gate_up_proj``
included): the trainer maps it writable and the resharding engine writes into it in place, as it writes
into an in-process worker's parameters; the worker maps the same file and copies each tensor into its
model. The file is allocated once and reused by every switch. A weight update then names only the file
and, per tensor, its dtype, shape and byte offset (:class:`StagedTensor`), as plain JSON: vLLM hands
the worker exactly what the trainer sent.

Each tensor carries two figures (:func:`tensor_figures`, that is
:func:`~hybridmem.reshard.checksum.tensor_checksum`: its sum and a position-weighted sum, in float64)
computed by the trainer from what it staged; the worker recomputes them from what its parameter holds
after the copy and refuses the update on a difference, naming the tensor (an offset or dtype read
wrongly, a file rewritten under the worker). Offsets are aligned to :data:`ALIGN` bytes.
"""

from __future__ import annotations

import math
import mmap
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hybridmem.reshard.checksum import tensor_checksum as tensor_figures

__all__ = ["ALIGN", "StagedTensor", "StagingFile", "layout_entries", "map_staged", "tensor_figures",
           "dtype_name", "dtype_of"]

ALIGN = 64
"""Byte alignment of every tensor in a staging file."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``.

    Raises:
        ValueError: ``name`` is no torch dtype.
    """
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype")
    return dtype


@dataclass(frozen=True, slots=True)
class StagedTensor:
    """Where one tensor lies in a staging file."""

    name: str
    """The vLLM parameter name."""
    dtype: str
    """Element type, as :func:`dtype_name` writes it."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the file (a multiple of :data:`ALIGN`)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=dtype_of(self.dtype)).element_size()

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> StagedTensor:
        return cls(name=str(value["name"]), dtype=str(value["dtype"]),
                   shape=tuple(int(s) for s in value["shape"]), offset=int(value["offset"]))


def layout_entries(
        tensors: Iterable[tuple[str, Sequence[int], torch.dtype]]) -> tuple[list[StagedTensor], int]:
    """Lay ``(name, shape, dtype)`` out end to end, each at an :data:`ALIGN`-byte offset; returns the
    entries and the file's size in bytes."""
    entries, offset = [], 0
    for name, shape, dtype in tensors:
        entry = StagedTensor(name=name, dtype=dtype_name(dtype), shape=tuple(int(s) for s in shape),
                             offset=offset)
        entries.append(entry)
        offset += -(-entry.nbytes // ALIGN) * ALIGN
    return entries, max(offset, ALIGN)


class StagingFile:
    """The trainer's writable mapping of one worker rank's staging file (see [Note: vllm staging]).

    Args:
        path: The file, under ``/dev/shm`` (created, or reused when it exists with the same size).
        entries: Where each tensor lies (:func:`layout_entries`).
        nbytes: The file's size.

    Raises:
        MemoryError: The file system holding ``path`` has less room than ``nbytes``; names both.
    """

    def __init__(self, path: str, entries: Sequence[StagedTensor], nbytes: int):
        self.path = path
        self.entries = list(entries)
        self.nbytes = int(nbytes)
        directory = os.path.dirname(path) or "."
        exists = os.path.exists(path) and os.path.getsize(path) == self.nbytes
        if not exists:
            free = shutil.disk_usage(directory).free
            if free < self.nbytes:
                raise MemoryError(
                    f"{directory} has {free} bytes free, the staging file {path} needs {self.nbytes}: make "
                    f"/dev/shm larger (docker run --shm-size) or sync fewer weights per engine rank"
                )
        storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=self.nbytes)
        self._bytes = torch.empty(0, dtype=torch.uint8).set_(storage)
        self._views = {e.name: self._view(e) for e in self.entries}

    def _view(self, e: StagedTensor) -> torch.Tensor:
        dtype = dtype_of(e.dtype)
        return self._bytes[e.offset:e.offset + e.nbytes].view(dtype).view(e.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Writable views of every staged tensor, by name."""
        return dict(self._views)

    def update_info(self, *, figures: bool, generation: int) -> dict[str, Any]:
        """The JSON the worker's ``update_weights`` takes (:mod:`hybridmem.adapters.vllm.server.transfer`)."""
        info: dict[str, Any] = {"path": self.path, "entries": [e.to_json() for e in self.entries],
                                "generation": int(generation)}
        if figures:
            info["figures"] = [list(tensor_figures(self._views[e.name])) for e in self.entries]
        return info

    def close(self) -> None:
        """Drop the mapping and remove the file."""
        self._views.clear()
        self._bytes = torch.empty(0, dtype=torch.uint8)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def map_staged(path: str, entries: Sequence[StagedTensor]) -> tuple[mmap.mmap, dict[str, torch.Tensor]]:
    """The worker's read-only mapping of a staging file: the map (close it when done) and a view per entry.

    Raises:
        ValueError: An entry lies outside the file.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    views = {}
    for e in entries:
        if e.offset + e.nbytes > size:
            mapped.close()
            raise ValueError(f"staged tensor {e.name} ({e.nbytes} bytes at offset {e.offset}) lies outside "
                             f"{path} ({size} bytes)")
        with _quiet_readonly():
            views[e.name] = torch.frombuffer(mapped, dtype=dtype_of(e.dtype), count=e.numel,
                                             offset=e.offset).view(e.shape)
    return mapped, views


class _quiet_readonly:  # noqa: N801 - a context manager used like a function
    """torch warns that a tensor over a read-only buffer is not writable; the worker only reads it."""

    def __enter__(self) -> None:
        import warnings  # noqa: PLC0415

        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.filterwarnings("ignore", message="The given buffer is not writable")

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
