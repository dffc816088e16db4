"""The offloader mechanism shared by params, grads and optimizer state.

[Note: offload by storage]
An offloader moves *storages*, not tensors. Every tensor it is given is reduced to its underlying
``UntypedStorage``; storages shared by several tensors (views, tied weights, Megatron's contiguous
buffers whose parameters are views) are moved once. Offload copies each storage's bytes into a host
arena and then frees the device memory with ``storage.resize_(0)``; onload resizes the storage back and
copies the bytes in. Tensor objects are never replaced, so the references the optimizer, autograd hooks
and user code hold stay valid, and views keep their offsets and strides. Inside INFER every offloaded
storage has ``nbytes() == 0``.

[Note: copy ordering]
Device->host copies run on a dedicated copy stream that first waits for the compute stream, so they see
every pending write. An event is recorded after the last copy and the host waits for it *before* any
storage is resized to 0: freeing earlier would let the caching allocator hand the memory to a new
tensor while the copy still reads it (Megatron-core's ``offload_to_cpu`` frees right after a
non-blocking copy with no event; we do not). Onload allocates on the compute stream, copies on the copy
stream, and the compute stream waits on the copy's event, so the first kernel after a switch sees the
restored bytes.

[Note: offload journal]
Freeing a device storage is the one irreversible act of an offload, so it is recorded before it
happens. Offload does everything that can fail before the first free (arena allocation against the host
budget, the copies, waiting for them); then it records the slots and marks its host arenas as holding
the only valid copy (``HostBufferPool.hold``), sets the state to ``ON_HOST``, and only then frees the
storages one by one. An exception (or a ``KeyboardInterrupt``) at any point before the record leaves
the device untouched; at any point after it, the record says where every byte is, and :meth:`onload`
restores all of it whatever subset was freed (re-growing a storage that was never freed is a no-op and
the copy writes the same bytes back). Onload is just as re-runnable: it keeps the record until every copy
has completed, so an onload interrupted at any point is finished by calling it again. Nothing decides
what to undo from what a step was *supposed* to have done: the manager undoes every step it entered,
and each undo follows this record (see [Note: switch transactions] in :mod:`hybridmem.manager`).

A held arena is never handed out for a new offload or dropped (``HostBufferPool`` refuses), so an
arena holding the only copy of some bytes cannot be overwritten whatever state an offloader believes
it is in.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

import torch
from torch.profiler import record_function

from hybridmem.accel import Accelerator
from hybridmem.host_pool import HostBufferPool
from hybridmem.kinds import StateKind

__all__ = ["OffloadState", "TransferStats", "Offloader", "storage_view"]


class OffloadState(Enum):
    """Where an offloader's bytes are."""

    ON_DEVICE = "on_device"
    """Storages hold device memory with the live bytes; host arenas hold nothing of value."""
    ON_HOST = "on_host"
    """The pool's host arenas hold the authoritative bytes (or they are known to be zero); storages are
    resized to 0 bytes once the offload returns (some may still be allocated if it was interrupted, see
    [Note: offload journal])."""


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one offload or onload did."""

    kind: StateKind
    """What was moved."""
    owner: str
    """The offloader's owner name (its host arenas' key)."""
    direction: str
    """``"offload"`` (device->host) or ``"onload"`` (host->device)."""
    num_storages: int = 0
    """Storages handled (each shared storage counted once)."""
    copied_nbytes: int = 0
    """Bytes copied over the link."""
    zero_nbytes: int = 0
    """Bytes of all-zero storages released (or re-zeroed) without a copy."""
    seconds: float = 0.0
    """Wall time, including waiting for the copies to finish."""

    @property
    def device_nbytes(self) -> int:
        """Device bytes freed (offload) or allocated (onload)."""
        return self.copied_nbytes + self.zero_nbytes

    @property
    def gbps(self) -> float:
        """Achieved copy bandwidth in GB/s (1e9 bytes per second); 0 when nothing was copied."""
        return self.copied_nbytes / self.seconds / 1e9 if self.seconds > 0 and self.copied_nbytes else 0.0


@dataclass(slots=True)
class _Slot:
    """One storage an offloader moved, and where its bytes are on the host."""

    storage: torch.UntypedStorage
    nbytes: int
    dtype: torch.dtype
    arena_offset: int = 0
    """Element offset of this storage's bytes in its dtype's arena."""
    zero: bool = False
    """All bytes were zero at offload: nothing was copied; onload re-zeroes."""
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        self.numel = self.nbytes // torch.empty((), dtype=self.dtype).element_size()


def storage_view(storage: torch.UntypedStorage, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A 1-D tensor of ``numel`` ``dtype`` elements over ``storage`` from its start (no copy)."""
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, (numel,), (1,))


def _slot_dtype(tensor: torch.Tensor, nbytes: int) -> torch.dtype:
    # A storage is viewed with the dtype of a tensor using it; if its size is not a whole number of
    # such elements (only possible for storages built by hand), it is moved as raw bytes.
    return tensor.dtype if nbytes % tensor.element_size() == 0 else torch.uint8


class Offloader(ABC):
    """Moves a set of device tensors to host memory and back (see [Note: offload by storage]).

    Subclasses say which tensors by implementing :meth:`tensors`; the mechanism is shared.

    Args:
        accel: The accelerator the tensors live on; tensors on other devices are left alone.
        pool: Where host arenas come from (kept across switches).
        owner: Key of this offloader's arenas in ``pool``; unique per offloader.
        skip_zero: Release all-zero storages without copying and re-zero them on onload.
    """

    kind: ClassVar[StateKind]

    def __init__(self, accel: Accelerator, pool: HostBufferPool, *, owner: str | None = None, skip_zero: bool = False):
        self.accel = accel
        self.pool = pool
        self.owner = owner if owner is not None else self.kind.value
        self.skip_zero = skip_zero
        self._state = OffloadState.ON_DEVICE
        self._slots: list[_Slot] = []
        self._copy_stream = None  # created lazily: no device work at construction

    @abstractmethod
    def tensors(self) -> Iterable[torch.Tensor]:
        """The tensors to move now (the set may change between switches, e.g. grads appearing)."""

    @property
    def state(self) -> OffloadState:
        """Where the bytes are."""
        return self._state

    # Discovery ------------------------------------------------------------------------------------
    def _storages(self) -> list[tuple[torch.UntypedStorage, torch.dtype]]:
        """Unique device storages of :meth:`tensors` that hold memory, in first-seen order."""
        seen: set[int] = set()
        out = []
        for t in self.tensors():
            if t is None or t.device.type != self.accel.device.type:
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            out.append((storage, _slot_dtype(t, storage.nbytes())))
        return out

    def live_nbytes(self) -> int:
        """Device bytes an offload would free now (or an onload would allocate, when on host)."""
        if self._state is OffloadState.ON_HOST:
            return sum(s.nbytes for s in self._slots)
        return sum(s.nbytes() for s, _ in self._storages())

    def resident_nbytes(self) -> int:
        """Device bytes this offloader's tensors hold now."""
        if self._state is OffloadState.ON_HOST:
            return sum(s.storage.nbytes() for s in self._slots)
        return self.live_nbytes()

    def _stream(self):
        if self._copy_stream is None:
            self._copy_stream = self.accel.new_stream()
        return self._copy_stream

    # Offload --------------------------------------------------------------------------------------
    def offload(self) -> TransferStats:
        """Copy every live storage to host, wait for the copies, then free the device storage.

        A no-op returning empty stats when already on host. Journaled (see [Note: offload journal]):
        if it raises before its record, the device is untouched; after it, :meth:`onload` restores
        everything.

        Raises:
            HostMemoryBudgetError: The host arenas would exceed the pool's budget (nothing changed).
        """
        if self._state is OffloadState.ON_HOST:
            return TransferStats(kind=self.kind, owner=self.owner, direction="offload")
        start = time.perf_counter()
        with record_function(f"hybridmem.offload.{self.owner}"):
            if self.pool.is_held(self.owner):
                raise RuntimeError(
                    f"{self!r}: host arenas of owner {self.owner!r} hold the only copy of offloaded bytes; an "
                    f"offload would overwrite them (internal error: state and pool disagree)"
                )
            slots = [_Slot(storage=s, nbytes=s.nbytes(), dtype=d) for s, d in self._storages()]
            if self.skip_zero and slots:
                self._mark_zero(slots)
            arenas = self._reserve_arenas(slots)
            stream = self._stream()
            event = self.accel.new_event()
            with self.accel.on_side_stream(stream):
                for slot in slots:
                    if not slot.zero:
                        host = arenas[slot.dtype].narrow(0, slot.arena_offset, slot.numel)
                        host.copy_(storage_view(slot.storage, slot.dtype, slot.numel), non_blocking=True)
                event.record(stream)
            event.synchronize()  # [Note: copy ordering]: no storage is freed before its copy is done
            # [Note: offload journal]: record, then free.
            self._slots = slots
            self.pool.hold(self.owner)
            self._state = OffloadState.ON_HOST
            for slot in slots:
                slot.storage.resize_(0)
        return self._stats("offload", slots, time.perf_counter() - start)

    def _mark_zero(self, slots: list[_Slot]) -> None:
        # One reduction per storage on the device and a single sync: far cheaper than copying.
        # Bytes, not values, are tested so -0.0 and NaN payloads are never mistaken for zero.
        flags = torch.stack([storage_view(s.storage, torch.uint8, s.nbytes).any() for s in slots]).tolist()
        for slot, nonzero in zip(slots, flags):
            slot.zero = not nonzero

    def _reserve_arenas(self, slots: list[_Slot]) -> dict[torch.dtype, torch.Tensor]:
        totals: dict[torch.dtype, int] = {}
        for slot in slots:
            if slot.zero:
                continue
            slot.arena_offset = totals.get(slot.dtype, 0)
            totals[slot.dtype] = slot.arena_offset + slot.numel
        return {dtype: self.pool.arena(self.owner, dtype, numel) for dtype, numel in totals.items()}

    # Onload ---------------------------------------------------------------------------------------
    def onload(self) -> TransferStats:
        """Re-allocate every offloaded storage and copy its bytes back (or re-zero it).

        A no-op returning empty stats when already on device. Re-runnable: the record is kept until
        every copy has completed, so an interrupted onload is finished by calling it again (see
        [Note: offload journal]); a failed allocation frees what this call allocated.

        Raises:
            torch.OutOfMemoryError: The device could not hold the storages; nothing stays allocated.
        """
        if self._state is OffloadState.ON_DEVICE:
            return TransferStats(kind=self.kind, owner=self.owner, direction="onload")
        start = time.perf_counter()
        slots = self._slots
        with record_function(f"hybridmem.onload.{self.owner}"):
            self._allocate(slots)
            arenas = {dtype: self.pool.arena(self.owner, dtype, 0) for dtype in {s.dtype for s in slots if not s.zero}}
            stream = self._stream()
            event = self.accel.new_event()
            with self.accel.on_side_stream(stream):
                for slot in slots:
                    dev = storage_view(slot.storage, slot.dtype, slot.numel)
                    if slot.zero:
                        dev.zero_()
                    else:
                        dev.copy_(arenas[slot.dtype].narrow(0, slot.arena_offset, slot.numel), non_blocking=True)
                event.record(stream)
            self.accel.current_stream().wait_event(event)
            event.synchronize()  # the report's time is the real copy time; arenas may be reused next
        self._state = OffloadState.ON_DEVICE
        self._slots = []
        self.pool.unhold(self.owner)
        return self._stats("onload", slots, time.perf_counter() - start)

    def _allocate(self, slots: list[_Slot]) -> None:
        done: list[_Slot] = []
        try:
            for slot in slots:
                slot.storage.resize_(slot.nbytes)
                done.append(slot)
        except BaseException:
            for slot in done:
                slot.storage.resize_(0)
            raise

    def _stats(self, direction: str, slots: list[_Slot], seconds: float) -> TransferStats:
        return TransferStats(
            kind=self.kind,
            owner=self.owner,
            direction=direction,
            num_storages=len(slots),
            copied_nbytes=sum(s.nbytes for s in slots if not s.zero),
            zero_nbytes=sum(s.nbytes for s in slots if s.zero),
            seconds=seconds,
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(owner={self.owner!r}, state={self._state.name})"
