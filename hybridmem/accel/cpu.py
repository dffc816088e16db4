"""The CPU backend: a real backend for tests and for machines without an accelerator.

"Device" tensors are ordinary CPU tensors; host buffers are separate CPU tensors. Offloading therefore
really copies bytes and really frees the "device" storage (``resize_(0)`` returns it to the C
allocator), so byte counts, round trips and rollbacks are tested for real. There are no streams: work
runs in program order, so stream and event objects are no-ops that keep the same call shape.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, ClassVar

import torch

from hybridmem.accel.base import Accelerator, MemoryFigures

__all__ = ["CpuAccelerator"]


class _NullEvent:
    """An event on a backend that runs everything in order: always complete."""

    def record(self, stream: Any = None) -> None:
        del stream

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        del stream


class _NullStream:
    """A stream on a backend without streams."""

    def wait_stream(self, other: Any) -> None:
        del other

    def wait_event(self, event: Any) -> None:
        del event

    def record_event(self, event: Any = None) -> _NullEvent:
        return event if event is not None else _NullEvent()

    def synchronize(self) -> None:
        pass


def _physical_memory_nbytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX
        return 1 << 40


def _available_memory_nbytes() -> int | None:
    """The OS's estimate of memory available to new allocations (``MemAvailable`` of /proc/meminfo), or
    ``None`` where there is no such file."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class CpuAccelerator(Accelerator):
    """The host CPU as the "device".

    Args:
        capacity_nbytes: The device capacity that memory plans are checked against; defaults to the
            machine's physical memory. Tests set it small to exercise the memory planner.
    """

    name: ClassVar[str] = "cpu"
    supports_pinned_memory: ClassVar[bool] = False
    has_streams: ClassVar[bool] = False
    measures_device_memory: ClassVar[bool] = False
    memory_is_host: ClassVar[bool] = True

    def __init__(self, device: torch.device | None = None, *, capacity_nbytes: int | None = None):
        super().__init__(torch.device("cpu") if device is None else device)
        if capacity_nbytes is not None and capacity_nbytes < 1:
            raise ValueError(f"capacity_nbytes={capacity_nbytes} must be positive")
        self.capacity_nbytes = capacity_nbytes if capacity_nbytes is not None else _physical_memory_nbytes()
        self._reads_os = capacity_nbytes is None
        """Free memory is the OS's figure (the machine's own capacity); a set capacity is a simulation."""
        self._stream = _NullStream()
        self._peak: int | None = None

    @classmethod
    def is_available(cls) -> bool:
        return True

    def current_stream(self) -> _NullStream:
        return self._stream

    def new_stream(self) -> _NullStream:
        return _NullStream()

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext(stream)

    def new_event(self) -> _NullEvent:
        return _NullEvent()

    def synchronize(self) -> None:
        pass

    def memory_figures(self, tracked_nbytes: int = 0) -> MemoryFigures:
        free = max(0, self.capacity_nbytes - tracked_nbytes)
        available = _available_memory_nbytes() if self._reads_os else None
        return MemoryFigures(
            allocated_nbytes=tracked_nbytes,
            reserved_nbytes=tracked_nbytes,
            free_nbytes=free if available is None else min(free, available),
            total_nbytes=self.capacity_nbytes,
        )

    def reset_peak(self) -> None:
        pass

    def peak_allocated_nbytes(self) -> int | None:
        return None

    def empty_cache(self) -> None:
        pass
