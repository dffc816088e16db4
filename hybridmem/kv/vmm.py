"""The ``cuda-vmm`` KV-cache allocator: a pool at fixed virtual addresses, physical memory mapped on demand.

``allocate`` reserves a virtual address range once and maps physical chunks into it; ``release`` unmaps
and releases the chunks (the device gets the memory back, ``mem_get_info`` shows it free) but keeps the
range; ``resume`` creates and maps new chunks at the same addresses. Views are built once over the range,
so their ``data_ptr()`` never changes and CUDA graphs captured over them replay after a resume
(``preserves_addresses = True``; see [Note: KV views stay valid] in :mod:`hybridmem.kv.base`).

This is the mechanism of vLLM's ``CuMemAllocator`` and SGLang's torch_memory_saver, applied to one pool
the allocator owns instead of to every allocation made under a context manager, and without a host
backup (KV contents are dead after generation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn, Protocol

import torch

from hybridmem.accel import Accelerator
from hybridmem.errors import KVResumeError
from hybridmem.kv.base import KVCacheAllocator, register_kv_allocator
from hybridmem.kv.cuda_driver import (
    CudaDriver,
    CudaDriverError,
    cuda_bindings_available,
)

__all__ = ["CudaVmmKVAllocator", "VmmMapping", "VmmDriver", "DEFAULT_CHUNK_NBYTES"]

DEFAULT_CHUNK_NBYTES = 256 << 20
"""Physical allocation size (rounded up to the granularity): few handles, yet a failed resume stops early."""


class VmmDriver(Protocol):
    """The driver calls :class:`VmmMapping` makes (:class:`hybridmem.kv.cuda_driver.CudaDriver`)."""

    def granularity(self) -> int: ...
    def reserve(self, nbytes: int, alignment: int) -> int: ...
    def free(self, address: int, nbytes: int) -> None: ...
    def create(self, nbytes: int) -> Any: ...
    def release(self, handle: Any) -> None: ...
    def map(self, address: int, nbytes: int, handle: Any) -> None: ...
    def set_access(self, address: int, nbytes: int) -> None: ...
    def unmap(self, address: int, nbytes: int) -> None: ...


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, slots=True)
class _Chunk:
    """One physical allocation mapped into the range."""

    offset: int
    nbytes: int
    handle: Any


class VmmMapping:
    """A reserved virtual address range whose physical memory can be mapped and unmapped in chunks.

    Construction reserves the range (``nbytes`` rounded up to the granularity); nothing is mapped until
    :meth:`map`. Pure bookkeeping over a :class:`VmmDriver`, so its undo logic is tested on CPU with a
    fake driver.

    Args:
        driver: The driver calls.
        nbytes: Bytes the caller needs.
        chunk_nbytes: Size of each physical allocation, rounded up to the granularity; the last chunk
            is what remains.

    Raises:
        ValueError: ``nbytes`` or ``chunk_nbytes`` is not positive.
        CudaDriverError: The address range could not be reserved.
    """

    def __init__(self, driver: VmmDriver, *, nbytes: int, chunk_nbytes: int = DEFAULT_CHUNK_NBYTES):
        if nbytes < 1:
            raise ValueError(f"nbytes={nbytes} must be positive")
        if chunk_nbytes < 1:
            raise ValueError(f"chunk_nbytes={chunk_nbytes} must be positive")
        self._driver = driver
        self.granularity = driver.granularity()
        self.mapped_size = _round_up(nbytes, self.granularity)
        self.chunk_nbytes = min(_round_up(chunk_nbytes, self.granularity), self.mapped_size)
        self.address = driver.reserve(self.mapped_size, self.granularity)
        self._chunks: list[_Chunk] = []
        self._freed = False

    @property
    def num_chunks(self) -> int:
        """Physical allocations a full mapping uses."""
        return -(-self.mapped_size // self.chunk_nbytes)

    @property
    def is_mapped(self) -> bool:
        """Whether physical memory is mapped (all of it: a partial mapping never survives a call)."""
        return bool(self._chunks)

    def resident_nbytes(self) -> int:
        """Physical bytes mapped now."""
        return sum(c.nbytes for c in self._chunks)

    def map(self) -> None:
        """Create, map and enable every chunk; on any failure undo all of them and raise.

        Raises:
            KVResumeError: A driver call failed; nothing is mapped afterwards. ``step`` names the call.
        """
        if self._freed:
            raise RuntimeError(f"VmmMapping at {self.address:#x} was freed; it cannot be mapped again")
        if self._chunks:
            return
        for offset in range(0, self.mapped_size, self.chunk_nbytes):
            size = min(self.chunk_nbytes, self.mapped_size - offset)
            try:
                handle = self._driver.create(size)
            except CudaDriverError as exc:
                self._undo_partial(exc, offset)
            try:
                self._driver.map(self.address + offset, size, handle)
            except CudaDriverError as exc:
                self._driver.release(handle)
                self._undo_partial(exc, offset)
            self._chunks.append(_Chunk(offset, size, handle))
            try:
                self._driver.set_access(self.address + offset, size)
            except CudaDriverError as exc:
                self._undo_partial(exc, offset)

    def _undo_partial(self, exc: CudaDriverError, offset: int) -> NoReturn:
        mapped_nbytes = self.resident_nbytes()
        self.unmap()
        raise KVResumeError(
            f"mapping {self.mapped_size} bytes at {self.address:#x} failed at byte offset {offset} "
            f"({mapped_nbytes} bytes mapped so far, all unmapped again): {exc}",
            requested_nbytes=self.mapped_size,
            mapped_nbytes=mapped_nbytes,
            step=exc.step,
        ) from exc

    def unmap(self) -> int:
        """Unmap and release every chunk; the address range stays reserved.

        Returns:
            Physical bytes given back.
        """
        freed_nbytes = 0
        while self._chunks:
            chunk = self._chunks[-1]
            self._driver.unmap(self.address + chunk.offset, chunk.nbytes)
            self._driver.release(chunk.handle)
            self._chunks.pop()
            freed_nbytes += chunk.nbytes
        return freed_nbytes

    def free(self) -> None:
        """Unmap everything and give the address range back. Freeing twice is a no-op."""
        if self._freed:
            return
        self.unmap()
        self._driver.free(self.address, self.mapped_size)
        self._freed = True


class _CudaArrayInterface:
    """Describes raw device bytes to ``torch.as_tensor`` (which wraps them without copying)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "strides": None,
            "version": 3,
        }


@register_kv_allocator
class CudaVmmKVAllocator(KVCacheAllocator):
    """KV pool in CUDA virtual memory: addresses fixed for the allocator's life, memory mapped on demand.

    Needs ``cuda.bindings`` (package ``cuda-bindings``); it is imported on first ``allocate``.

    Args:
        accel: A CUDA accelerator.
        chunk_nbytes: Size of each physical allocation (rounded up to the 2 MiB granularity).
    """

    name: ClassVar[str] = "cuda-vmm"
    preserves_addresses: ClassVar[bool] = True
    backends: ClassVar[frozenset[str]] = frozenset({"cuda"})

    def __init__(self, accel: Accelerator, *, chunk_nbytes: int = DEFAULT_CHUNK_NBYTES):
        super().__init__(accel)
        if chunk_nbytes < 1:
            raise ValueError(f"chunk_nbytes={chunk_nbytes} must be positive")
        self.chunk_nbytes = chunk_nbytes
        self._driver: CudaDriver | None = None
        self._mapping: VmmMapping | None = None
        self._bytes: torch.Tensor | None = None

    @classmethod
    def is_available(cls) -> bool:
        """Whether a CUDA device and ``cuda.bindings`` are both present."""
        return torch.cuda.is_available() and cuda_bindings_available()

    @property
    def mapping(self) -> VmmMapping:
        """The address range and its chunks."""
        if self._mapping is None:
            raise AssertionError(f"{self!r}: no mapping outside allocate/close")
        return self._mapping

    @property
    def data_ptr(self) -> int:
        """Start of the pool's address range (every view's ``data_ptr()`` is at or after it)."""
        return self.mapping.address

    def _device_index(self) -> int:
        index = self.accel.device.index
        return 0 if index is None else index

    def _allocate(self, nbytes: int) -> None:
        index = self._device_index()
        with torch.cuda.device(index):
            torch.cuda.synchronize(index)  # makes the device's primary context current for driver calls
            if self._driver is None:
                self._driver = CudaDriver(index)
            mapping = VmmMapping(self._driver, nbytes=nbytes, chunk_nbytes=self.chunk_nbytes)
            try:
                mapping.map()
                pool = torch.as_tensor(_CudaArrayInterface(mapping.address, nbytes), device=self.accel.device)
            except BaseException:
                mapping.free()
                raise
        if pool.data_ptr() != mapping.address or pool.numel() != nbytes:
            mapping.free()
            raise AssertionError(
                f"torch wrapped the VMM range at {pool.data_ptr():#x} ({pool.numel()} bytes), "
                f"expected {mapping.address:#x} ({nbytes} bytes)"
            )
        self._mapping = mapping
        self._bytes = pool

    def _release(self) -> int:
        with torch.cuda.device(self._device_index()):
            return self.mapping.unmap()

    def _resume(self) -> None:
        with torch.cuda.device(self._device_index()):
            self.mapping.map()

    def _view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        assert self._bytes is not None, f"{self!r}: no pool tensor"
        return self._bytes.view(dtype).view(shape)

    def _resident_nbytes(self) -> int:
        return self.mapping.resident_nbytes()

    def _close(self) -> None:
        with torch.cuda.device(self._device_index()):
            self.mapping.free()
        self._mapping = None
        self._bytes = None
