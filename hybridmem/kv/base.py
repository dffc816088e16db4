"""The KV-cache allocator interface: allocate a pool of blocks, release it, resume it, view it as tensors.

An inference engine keeps its paged KV cache in one pool of ``num_blocks * block_nbytes`` bytes. On the
switch to TRAIN the pool's device memory is given back (:meth:`KVCacheAllocator.release`), and on the switch
to INFER it is taken again (:meth:`KVCacheAllocator.resume`). KV contents are never copied to the host: they
are dead once generation ends, so a resumed pool has the same blocks and size but undefined contents.

[Note: KV views stay valid]
A view returned by :meth:`KVCacheAllocator.view` is taken once (when the engine builds its cache) and used
for the allocator's whole life: it stays the same Python object and a valid tensor across any number of
release/resume cycles, so engines never rebuild their per-layer cache tensors. How depends on the backend:

- ``torch``: every view shares the one ``UntypedStorage`` of the pool. ``release`` resizes that storage to
  0 bytes and ``resume`` back to the pool size (the FSDP2 ``_free_storage`` pattern); the tensors keep
  their shape and follow the storage to its new memory. The data pointer MAY change across a cycle, so
  CUDA graphs captured over the pool must be re-captured (``preserves_addresses = False``).
- ``cuda-vmm``: the views sit at a reserved virtual address range; ``release`` unmaps the physical memory
  behind it and ``resume`` maps new physical memory at the same addresses, so ``data_ptr()`` never changes
  and captured CUDA graphs replay (``preserves_addresses = True``).

Between ``release`` and ``resume`` a view must not be read or written: torch does not check a view's
size against its (now 0-byte) storage, so the access reads freed memory and may crash the process (it
does on CPU); under VMM it faults the device.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from hybridmem.accel import Accelerator, get_accelerator
from hybridmem.errors import KVStateError

__all__ = [
    "KVState",
    "KVCacheAllocator",
    "KV_ALLOCATORS",
    "register_kv_allocator",
    "get_kv_allocator",
    "blocks_for_utilization",
]


class KVState(enum.Enum):
    """Where a KV pool's memory is."""

    EMPTY = enum.auto()
    """Nothing allocated yet (or closed): no device memory, no views."""
    ALLOCATED = enum.auto()
    """The pool's ``nbytes`` are resident on the device; views can be read and written."""
    RELEASED = enum.auto()
    """The device memory is given back; views exist but must not be touched until ``resume``."""


def blocks_for_utilization(
    *, total_nbytes: int, free_nbytes: int, block_nbytes: int, utilization: float, reserve_nbytes: int = 0,
    host_memory: bool = False,
) -> int:
    """Number of KV blocks that fit under a memory-utilization cap, as vLLM's ``gpu_memory_utilization``.

    On an accelerator with its own memory the process may use ``total_nbytes * utilization`` bytes in all;
    what the device already holds (``total_nbytes - free_nbytes``: this process's tensors, its allocator
    cache, other processes) and ``reserve_nbytes`` (activations, sampler workspace) are subtracted, and the
    rest is cut into blocks::

        floor((total * utilization - (total - free) - reserve) / block_nbytes)

    With ``host_memory`` (the CPU backend, whose "device" is the RAM every other program and the
    offloaded training state live in) the share is taken of what is free, never of the total::

        floor((free * utilization - reserve) / block_nbytes)

    Returns:
        The block count; zero or negative when nothing fits (the caller decides whether that is an error).
    """
    if host_memory:
        budget_nbytes = math.floor(free_nbytes * utilization) - reserve_nbytes
    else:
        used_nbytes = total_nbytes - free_nbytes
        budget_nbytes = math.floor(total_nbytes * utilization) - used_nbytes - reserve_nbytes
    return budget_nbytes // block_nbytes


class KVCacheAllocator(ABC):
    """Owns one KV-cache pool on one accelerator and moves it between :class:`KVState` s.

    Call order: ``allocate`` once, then ``view`` as often as needed, then any number of
    ``release``/``resume`` pairs, then ``close``. ``release`` on a released pool and ``resume`` on an
    allocated one are no-ops; any other call in the wrong state raises :class:`KVStateError` naming it.

    Subclasses implement ``_allocate``, ``_release``, ``_resume``, ``_view``, ``_resident_nbytes`` and
    ``_close``; this class checks states and arguments and sets the new state last, so a subclass step
    that raises leaves the state unchanged.

    Args:
        accel: The accelerator whose device holds the pool.

    Raises:
        ValueError: The allocator does not support ``accel``'s backend.
    """

    name: ClassVar[str]
    """Registry key (``"torch"``, ``"cuda-vmm"``, ...)."""
    preserves_addresses: ClassVar[bool]
    """Whether views keep their ``data_ptr()`` across release/resume (CUDA graphs survive)."""
    backends: ClassVar[frozenset[str]]
    """Accelerator backend names this allocator works on (``{"cpu", "cuda", "npu"}``)."""

    def __init__(self, accel: Accelerator):
        if accel.name not in self.backends:
            raise ValueError(
                f"KV-cache allocator {self.name!r} does not support accelerator backend {accel.name!r}; "
                f"it supports {sorted(self.backends)}"
            )
        self.accel = accel
        self.state = KVState.EMPTY
        self.num_blocks = 0
        self.block_nbytes = 0

    # Public API -----------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Pool size in bytes: ``num_blocks * block_nbytes`` (0 before ``allocate``)."""
        return self.num_blocks * self.block_nbytes

    def allocate(
        self,
        *,
        block_nbytes: int,
        num_blocks: int | None = None,
        utilization: float | None = None,
        reserve_nbytes: int = 0,
    ) -> int:
        """Allocate the pool, sized by a block count or by a memory-utilization cap.

        Args:
            block_nbytes: Bytes of one KV block (all layers, K and V, for ``block_size`` tokens).
            num_blocks: Exact block count. Exactly one of ``num_blocks`` and ``utilization`` is given.
            utilization: Fraction in (0, 1] of the device's total memory this process may use, counting
                what is already in use; see :func:`blocks_for_utilization`. Read from the accelerator's
                memory figures at call time.
            reserve_nbytes: Bytes to leave free besides the pool (only with ``utilization``).

        Returns:
            The number of blocks allocated.

        Raises:
            KVStateError: The pool was already allocated (state is not EMPTY).
            ValueError: A bad argument, or fewer than one block fits (the message gives the figures).
        """
        if self.state is not KVState.EMPTY:
            raise KVStateError("allocate", self.state, allocator=self.name,
                               hint="allocate once, then release/resume")
        if not isinstance(block_nbytes, int) or block_nbytes < 1:
            raise ValueError(f"block_nbytes={block_nbytes!r} must be a positive int")
        if (num_blocks is None) == (utilization is None):
            raise ValueError(
                f"give exactly one of num_blocks and utilization, got num_blocks={num_blocks!r}, "
                f"utilization={utilization!r}"
            )
        if reserve_nbytes < 0:
            raise ValueError(f"reserve_nbytes={reserve_nbytes} must be >= 0")
        if num_blocks is not None:
            if not isinstance(num_blocks, int) or num_blocks < 1:
                raise ValueError(f"num_blocks={num_blocks!r} must be a positive int")
            figures = self.accel.memory_figures()
            room = figures.free_nbytes + figures.cached_nbytes
            if num_blocks * block_nbytes > room:
                raise ValueError(
                    f"num_blocks={num_blocks} of block_nbytes={block_nbytes} is {num_blocks * block_nbytes} "
                    f"bytes, more than the {room} bytes free on {self.accel.device}"
                )
        else:
            assert utilization is not None  # narrowed by the exactly-one check above
            if not 0.0 < utilization <= 1.0:
                raise ValueError(f"utilization={utilization!r} must be in (0, 1]")
            figures = self.accel.memory_figures()
            num_blocks = blocks_for_utilization(
                total_nbytes=figures.total_nbytes,
                free_nbytes=figures.free_nbytes,
                block_nbytes=block_nbytes,
                utilization=utilization,
                reserve_nbytes=reserve_nbytes,
                host_memory=self.accel.memory_is_host,
            )
            if num_blocks < 1:
                share = (f"free_nbytes={figures.free_nbytes}" if self.accel.memory_is_host else
                         f"total_nbytes={figures.total_nbytes} minus used_nbytes="
                         f"{figures.total_nbytes - figures.free_nbytes}")
                raise ValueError(
                    f"no KV block fits: utilization={utilization} of {share} minus "
                    f"reserve_nbytes={reserve_nbytes} leaves less than block_nbytes={block_nbytes}"
                )
        self._allocate(num_blocks * block_nbytes)
        self.num_blocks = num_blocks
        self.block_nbytes = block_nbytes
        self.state = KVState.ALLOCATED
        return num_blocks

    def release(self) -> int:
        """Give the pool's device memory back; views stay valid objects (see [Note: KV views stay valid]).

        Waits for the work queued on the device first, since kernels may still read the cache.

        Returns:
            Bytes really given back to the device (0 if already released). For VMM this is the mapped
            size, i.e. ``nbytes`` rounded up to the allocation granularity.

        Raises:
            KVStateError: Nothing is allocated (state EMPTY).
        """
        if self.state is KVState.RELEASED:
            return 0
        if self.state is not KVState.ALLOCATED:
            raise KVStateError("release", self.state, allocator=self.name, hint="call allocate first")
        self.accel.synchronize()
        freed_nbytes = self._release()
        self.state = KVState.RELEASED
        return freed_nbytes

    def resume(self) -> None:
        """Take device memory for the pool again: same blocks, same size, same views; contents undefined.

        Raises:
            KVStateError: Nothing is allocated (state EMPTY).
            hybridmem.errors.KVResumeError: The device memory could not be had; nothing stays resident
                and the state is still RELEASED, so ``resume`` can be retried.
        """
        if self.state is KVState.ALLOCATED:
            return
        if self.state is not KVState.RELEASED:
            raise KVStateError("resume", self.state, allocator=self.name, hint="call allocate first")
        self._resume()
        self.state = KVState.ALLOCATED

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole pool as a tensor of ``dtype`` and ``shape`` (no copy).

        Take views once; they stay valid across release/resume ([Note: KV views stay valid]). Slice a
        view to get per-layer caches.

        Raises:
            KVStateError: Nothing is allocated (state EMPTY).
            ValueError: ``prod(shape) * dtype.itemsize`` differs from the pool's ``nbytes``.
        """
        if self.state is KVState.EMPTY:
            raise KVStateError("view", self.state, allocator=self.name, hint="call allocate first")
        shape = tuple(int(d) for d in shape)
        itemsize = dtype.itemsize
        view_nbytes = math.prod(shape) * itemsize
        if view_nbytes != self.nbytes or any(d < 0 for d in shape):
            raise ValueError(
                f"view of shape {shape} and dtype {dtype} covers {view_nbytes} bytes "
                f"({math.prod(shape)} x {itemsize}), but the pool has nbytes={self.nbytes} "
                f"({self.num_blocks} blocks x {self.block_nbytes})"
            )
        return self._view(dtype, shape)

    def resident_nbytes(self) -> int:
        """Device bytes the pool holds right now (0 when released or empty)."""
        return 0 if self.state is KVState.EMPTY else self._resident_nbytes()

    def close(self) -> None:
        """Free everything (device memory and any address reservation); state becomes EMPTY.

        Views taken earlier must not be used afterwards. Closing twice is a no-op.
        """
        if self.state is KVState.EMPTY:
            return
        self.accel.synchronize()
        self._close()
        self.num_blocks = 0
        self.block_nbytes = 0
        self.state = KVState.EMPTY

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(accel={self.accel}, state={self.state.name}, "
            f"num_blocks={self.num_blocks}, block_nbytes={self.block_nbytes})"
        )

    # Backend steps --------------------------------------------------------------------------------
    @abstractmethod
    def _allocate(self, nbytes: int) -> None:
        """Make ``nbytes`` resident and ready for views."""

    @abstractmethod
    def _release(self) -> int:
        """Give the resident memory back; return the bytes given back."""

    @abstractmethod
    def _resume(self) -> None:
        """Make the pool resident again, or raise with nothing resident."""

    @abstractmethod
    def _view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor over the whole pool (size already checked)."""

    @abstractmethod
    def _resident_nbytes(self) -> int:
        """Bytes resident now."""

    @abstractmethod
    def _close(self) -> None:
        """Free everything."""


KV_ALLOCATORS: dict[str, type[KVCacheAllocator]] = {}
"""KV-cache allocator classes by name; adapters register theirs with :func:`register_kv_allocator`."""


def register_kv_allocator(cls: type[KVCacheAllocator]) -> type[KVCacheAllocator]:
    """Add ``cls`` to :data:`KV_ALLOCATORS` under ``cls.name``; usable as a class decorator.

    Raises:
        ValueError: Another class is registered under the same name.
    """
    existing = KV_ALLOCATORS.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(f"KV-cache allocator name {cls.name!r} is already taken by {existing.__qualname__}")
    KV_ALLOCATORS[cls.name] = cls
    return cls


def get_kv_allocator(name: str, accel: Accelerator | str = "auto", **kwargs: Any) -> KVCacheAllocator:
    """A new allocator of the registered class ``name`` on ``accel``.

    Args:
        name: A key of :data:`KV_ALLOCATORS`.
        accel: An :class:`Accelerator`, or a spec for :func:`hybridmem.accel.get_accelerator`.
        **kwargs: Passed to the allocator's constructor (e.g. ``chunk_nbytes`` for ``cuda-vmm``).

    Raises:
        ValueError: ``name`` is not registered (the message lists the registered names), or the
            allocator does not support the accelerator's backend.
    """
    cls = KV_ALLOCATORS.get(name)
    if cls is None:
        raise ValueError(f"unknown KV-cache allocator {name!r}; registered: {sorted(KV_ALLOCATORS)}")
    return cls(get_accelerator(accel), **kwargs)
