"""The accelerator interface: streams, events, memory figures, host allocation.

hybridmem never calls ``torch.cuda`` directly outside :mod:`hybridmem.accel`; everything goes through an
:class:`Accelerator`, so the same switch code runs on CUDA GPUs, Ascend NPUs (torch_npu) and the CPU.
Constructing an accelerator object does not touch the device; the first stream or memory query does.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

__all__ = ["Accelerator", "MemoryFigures"]


@dataclass(frozen=True, slots=True)
class MemoryFigures:
    """Device memory as the backend reports it, in bytes.

    On CPU "device" memory is the storage of the tensors hybridmem tracks, so ``allocated_nbytes`` is the
    tracked figure passed in; ``free_nbytes`` is what the OS says is available (``MemAvailable``), at most
    the accelerator's capacity minus the tracked bytes.
    """

    allocated_nbytes: int
    """Bytes held by live tensors (``torch.cuda.memory_allocated``)."""
    reserved_nbytes: int
    """Bytes the caching allocator holds, live or cached (``torch.cuda.memory_reserved``)."""
    free_nbytes: int
    """Bytes free on the device outside this process's allocator (``mem_get_info()[0]``)."""
    total_nbytes: int
    """Device capacity (``mem_get_info()[1]``)."""

    @property
    def cached_nbytes(self) -> int:
        """Bytes the allocator holds but no tensor uses (reusable by this process, not by others)."""
        return max(0, self.reserved_nbytes - self.allocated_nbytes)


class Accelerator(ABC):
    """One device of one backend.

    Attributes:
        device: The ``torch.device`` tensors live on.
    """

    name: ClassVar[str]
    """Registry key: ``"cpu"``, ``"cuda"``, ``"npu"``."""
    supports_pinned_memory: ClassVar[bool]
    """Whether host buffers can be page-locked (fast, truly asynchronous copies)."""
    has_streams: ClassVar[bool]
    """Whether copies on a side stream can overlap compute."""
    measures_device_memory: ClassVar[bool]
    """Whether :meth:`memory_figures` reads the whole device (``mem_get_info``: the CUDA context, other
    processes and every allocator included) rather than echoing the bytes hybridmem tracks."""
    memory_is_host: ClassVar[bool] = False
    """Whether the "device" memory is the host's RAM, shared with everything else the machine runs (the
    CPU backend): shares of it are taken of what is free, not of the total (see
    :func:`hybridmem.kv.blocks_for_utilization`)."""

    def __init__(self, device: torch.device):
        self.device = device

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this backend can be used in this process (does not initialise the device)."""

    # Streams and events ---------------------------------------------------------------------------
    @abstractmethod
    def current_stream(self) -> Any:
        """The stream compute is queued on."""

    @abstractmethod
    def new_stream(self) -> Any:
        """A new side stream (for copies)."""

    @abstractmethod
    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        """Context manager that makes ``stream`` current."""

    @abstractmethod
    def new_event(self) -> Any:
        """A new event with ``record(stream)``, ``synchronize()``, ``query()``."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all work queued on the device."""

    # Memory ---------------------------------------------------------------------------------------
    @abstractmethod
    def memory_figures(self, tracked_nbytes: int = 0) -> MemoryFigures:
        """Current memory figures. ``tracked_nbytes`` is used where the backend has no allocator stats."""

    @abstractmethod
    def reset_peak(self) -> None:
        """Start a new peak measurement window (``reset_peak_memory_stats``)."""

    @abstractmethod
    def peak_allocated_nbytes(self) -> int | None:
        """Peak allocated bytes since :meth:`reset_peak`, or ``None`` if the backend cannot tell."""

    @abstractmethod
    def empty_cache(self) -> None:
        """Return cached, unused allocator blocks to the device."""

    def alloc_host(self, numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
        """A 1-D host tensor of ``numel`` elements, page-locked if ``pin`` and the backend supports it."""
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin and self.supports_pinned_memory)

    @contextlib.contextmanager
    def on_side_stream(self, stream: Any) -> Iterator[Any]:
        """Run the body on ``stream`` after the work already queued on the current stream."""
        stream.wait_stream(self.current_stream())
        with self.stream(stream):
            yield stream

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device})"
