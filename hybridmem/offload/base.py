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
the copy writes the same bytes back). Once every storage is freed, the tensors on them refuse to be read
until the onload ([Note: offloaded tensors refuse reads] in :mod:`hybridmem.offload.guard`). Onload is
just as re-runnable: it keeps the record until every copy has completed, so an onload interrupted at any
point is finished by calling it again. Nothing decides what to undo from what a step was *supposed* to have
done: the manager undoes every step it entered, and each undo follows this record (see [Note: switch
transactions] in :mod:`hybridmem.switch.transaction`).

A held arena is never handed out for a new offload or dropped (``HostBufferPool`` refuses), so an
arena holding the only copy of some bytes cannot be overwritten whatever state an offloader believes
it is in.

[Note: foreign storages]
Some storages cannot be freed by ``resize_(0)``: those torch does not own (memory-mapped safetensors,
which ``from_pretrained`` leaves every parameter on when it loads on the CPU; ``from_numpy``,
``frombuffer``, ``from_blob``, DLPack) refuse with "Trying to resize storage that is not resizable", and
CPU shared-memory storages (``share_memory_()``) accept the shrink but crash the process when grown
back. The offloader re-homes such a storage on its first offload: after the copy to host and the
record, it makes a new storage of the same size that torch owns, points every tensor it was given that
used the old one at the new one with ``set_`` (same offset, sizes and strides, so the tensor objects,
tied weights and views the model and optimizer hold stay what they were), records the new storage in
the slot, and only then frees it with ``resize_(0)``. The old storage is dropped (its owner unmaps or
releases it once no other tensor uses it); every later switch moves the new one like any other. The
slot keeps the views to re-point, so an onload after an interruption anywhere in this (some tensors
moved, the slot not yet updated) points them all at the slot's storage again, which then holds the
bytes. A tensor the offloader was not given (a user's own view of a parameter) keeps the old storage
and its old bytes: it no longer aliases the parameter after the first switch. Re-homing needs the
storage's size on the device for a moment (the new storage exists before it is freed), one storage at
a time; :meth:`Offloader.rehome_nbytes` tells the memory plan.

[Note: discovery within a switch]
Finding an offloader's storages walks every tensor it is given (the modules' parameters, their grads,
every optimizer state): for a model of 600 parameters about 2.5 ms a walk on cpu-2c, and one switch asks
for them many times (each step's estimate three times for the memory plan, then every owner's bytes
before and after each step and in the residency report): 21 walks, about half of a 100 ms TRAIN->INFER
whose copies took 43. Between switches the training loop may change them (grads appear or become
``None``, the optimizer creates its state), so nothing is kept across switches. Within one, the manager
holds each offloader's discovery (:meth:`Offloader.discovery_held`): the first walk's result is kept
until the offloader's own offload or onload changes its state (both forget it on entry, and the offload
itself always walks its tensors again: what is copied and freed never comes from a kept result), or a
step that may touch the training tensors ran (``SwitchStep.touches_training_tensors``, true unless the
step says otherwise, so a step registered from outside makes every offloader look again; see
:func:`hybridmem.switch.transaction.run_steps`). The kept result only feeds figures: the memory plan's
estimates, the memory after each step and the residency report.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

import torch
from torch.profiler import record_function

from hybridmem.accel import Accelerator
from hybridmem.contract.kinds import StateKind
from hybridmem.offload.guard import guard, unguard
from hybridmem.offload.host_pool import HostBufferPool

__all__ = ["OffloadState", "Offloader", "TransferStats", "is_foreign", "storage_view"]


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
    copy_s: float = 0.0
    """Of :attr:`seconds`, from issuing the first copy to the host's wait for the last one."""
    device_memory_s: float = 0.0
    """Of :attr:`seconds`, freeing the device storages (offload; the device gets them back at the
    manager's ``empty_cache`` step) or allocating them (onload)."""

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
    views: tuple[_View, ...] | None = None
    """For a storage torch cannot resize: every tensor on it, to re-point (see [Note: foreign storages])."""
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        self.numel = self.nbytes // self.dtype.itemsize


@dataclass(frozen=True, slots=True, eq=False)
class _View:
    """A tensor on a storage being re-homed, with the geometry to put it on the new one."""

    tensor: torch.Tensor
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _View:
        return cls(tensor, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))

    def point_at(self, storage: torch.UntypedStorage) -> None:
        """Make the tensor use ``storage`` (no-op when it already does)."""
        if self.tensor.untyped_storage()._cdata != storage._cdata:
            with torch.no_grad():  # set_ on a leaf that requires grad is allowed only here
                self.tensor.set_(storage, self.offset, self.size, self.stride)


def is_foreign(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` cannot be freed and re-grown in place (see [Note: foreign storages])."""
    return not storage.resizable() or (storage.device.type == "cpu" and storage.is_shared())


def storage_view(storage: torch.UntypedStorage, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A 1-D tensor of ``numel`` ``dtype`` elements over ``storage`` from its start (no copy)."""
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, 0, (numel,), (1,))


def _slot_dtype(tensor: torch.Tensor, nbytes: int) -> torch.dtype:
    # A storage is viewed with the dtype of a tensor using it; if its size is not a whole number of
    # such elements (only possible for storages built by hand), it is moved as raw bytes.
    return tensor.dtype if nbytes % tensor.element_size() == 0 else torch.uint8


def _rehome(slot: _Slot) -> None:
    """Move a foreign storage's tensors onto a new storage torch owns, record it, free it (see [Note:
    foreign storages]); called once the bytes are safe in the host arena."""
    new = torch.UntypedStorage(slot.nbytes, device=slot.storage.device)
    for view in slot.views or ():
        view.point_at(new)
    slot.storage = new  # the record: from here on onload restores into ``new``
    new.resize_(0)


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

    def __init__(self, accel: Accelerator, pool: HostBufferPool, *,
                 owner: str | None = None, skip_zero: bool = False):
        self.accel = accel
        self.pool = pool
        self.owner = owner if owner is not None else self.kind.value
        self.skip_zero = skip_zero
        self._state = OffloadState.ON_DEVICE
        self._slots: list[_Slot] = []
        # [Note: offloaded tensors refuse reads] in :mod:`hybridmem.offload.guard`
        self._guarded: list[torch.Tensor] = []
        self._copy_stream = None  # created lazily: no device work at construction
        # see [Note: discovery within a switch]
        self._memo_depth = 0
        self._memo: list[tuple[torch.UntypedStorage, torch.dtype, tuple[_View, ...] | None]] | None = None

    @abstractmethod
    def tensors(self) -> Iterable[torch.Tensor]:
        """The tensors to move now (the set may change between switches, e.g. grads appearing)."""

    def held_by_user(self, freed: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors user code holds for ``freed`` (the tensors whose storages an offload freed), which
        refuse reads until the onload: ``freed`` itself; an offloader over the local tensors of wrappers
        (FSDP2's DTensors) adds the wrappers, whose ops reach their local tensors below
        ``__torch_function__`` (see [Note: offloaded tensors refuse reads] in
        :mod:`hybridmem.offload.guard`)."""
        return freed

    @property
    def state(self) -> OffloadState:
        """Where the bytes are."""
        return self._state

    # Discovery ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def discovery_held(self) -> Iterator[None]:
        """Within the block, this offloader's storages are found once per state ([Note: discovery within a
        switch]); nestable."""
        self._memo_depth += 1
        try:
            yield
        finally:
            self._memo_depth -= 1
            if self._memo_depth == 0:
                self._memo = None

    def forget_discovery(self) -> None:
        """Find the storages anew at the next look (a step may have changed them; [Note: discovery within a
        switch])."""
        self._memo = None

    def _device_tensors(self) -> list[torch.Tensor]:
        """:meth:`tensors` on this offloader's device."""
        return [t for t in self.tensors() if t is not None and t.device.type == self.accel.device.type]

    def _storages(self, tensors: Iterable[torch.Tensor] | None = None,
                  ) -> list[tuple[torch.UntypedStorage, torch.dtype, tuple[_View, ...] | None]]:
        """Unique storages of ``tensors`` (default: :meth:`_device_tensors`) that hold memory, in first-seen
        order, each with its dtype and, for a foreign storage, every tensor on it (see [Note: foreign
        storages]). Inside :meth:`discovery_held`, the default's result is kept until the state changes."""
        if tensors is None and self._memo is not None:
            return self._memo
        found: dict[int, tuple[torch.UntypedStorage, torch.dtype, list[_View] | None]] = {}
        for t in self._device_tensors() if tensors is None else tensors:
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in found:
                if storage.nbytes() == 0:
                    continue
                found[key] = (storage, _slot_dtype(t, storage.nbytes()), [] if is_foreign(storage) else None)
            views = found[key][2]
            if views is not None:
                views.append(_View.of(t))
        out = [(s, d, None if v is None else tuple(v)) for s, d, v in found.values()]
        if tensors is None and self._memo_depth > 0:
            self._memo = out
        return out

    def live_nbytes(self) -> int:
        """Device bytes an offload would free now (or an onload would allocate, when on host)."""
        if self._state is OffloadState.ON_HOST:
            return sum(s.nbytes for s in self._slots)
        return sum(s.nbytes() for s, _, _ in self._storages())

    def arena_needs(self) -> dict[torch.dtype, int]:
        """Host arena elements per dtype the next offload would ask for at most (every live storage
        copied); empty when the bytes are on host already. What the pool prewarms (see [Note: prewarmed
        arenas] in :mod:`hybridmem.offload.host_pool`)."""
        if self._state is OffloadState.ON_HOST:
            return {}
        totals: dict[torch.dtype, int] = {}
        for storage, dtype, _ in self._storages():
            itemsize = dtype.itemsize
            totals[dtype] = totals.get(dtype, 0) + storage.nbytes() // itemsize
        return totals

    def arena_growth_nbytes(self) -> int:
        """Host bytes the pool's arenas would grow by for the next offload: per dtype, what it would copy
        (:meth:`arena_needs`) beyond this owner's arena held or being prewarmed; 0 when the bytes are on
        host already (see [Note: host memory plan] in :mod:`hybridmem.switch.memplan`)."""
        total = 0
        for dtype, numel in self.arena_needs().items():
            nbytes = numel * dtype.itemsize
            total += max(0, nbytes - self.pool.arena_nbytes(self.owner, dtype))
        return total

    def rehome_nbytes(self) -> int:
        """Transient device bytes the next offload needs to re-home a foreign storage (the largest one;
        0 when there is none or the bytes are on host; see [Note: foreign storages])."""
        if self._state is OffloadState.ON_HOST:
            return 0
        return max((s.nbytes() for s, _, views in self._storages() if views is not None), default=0)

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
        self.forget_discovery()  # what it frees, and re-homes, is found anew (and found anew after it)
        start = time.perf_counter()
        with record_function(f"hybridmem.offload.{self.owner}"):
            if self.pool.is_held(self.owner):
                raise RuntimeError(
                    f"{self!r}: host arenas of owner {self.owner!r} hold the only copy of offloaded bytes; "
                    "an offload would overwrite them (internal error: state and pool disagree)"
                )
            tensors = self._device_tensors()
            slots = [_Slot(storage=s, nbytes=s.nbytes(), dtype=d, views=v)
                     for s, d, v in self._storages(tensors)]
            keys = {slot.storage._cdata for slot in slots}
            freed = [t for t in tensors if t.untyped_storage()._cdata in keys]
            if self.skip_zero and slots:
                self._mark_zero(slots)
            arenas = self._reserve_arenas(slots)
            stream = self._stream()
            event = self.accel.new_event()
            copy_start = time.perf_counter()
            with self.accel.on_side_stream(stream):
                for slot in slots:
                    if not slot.zero:
                        host = arenas[slot.dtype].narrow(0, slot.arena_offset, slot.numel)
                        host.copy_(storage_view(slot.storage, slot.dtype, slot.numel), non_blocking=True)
                event.record(stream)
            event.synchronize()  # [Note: copy ordering]: no storage is freed before its copy is done
            free_start = time.perf_counter()
            # [Note: offload journal]: record, then free.
            self._slots = slots
            self.pool.hold(self.owner)
            self._state = OffloadState.ON_HOST
            for slot in slots:
                if slot.views is None:
                    slot.storage.resize_(0)
                else:
                    _rehome(slot)
            free_s = time.perf_counter() - free_start
            self._guarded = guard(self.held_by_user(freed), self.kind.value)
        return self._stats("offload", slots, time.perf_counter() - start, copy_s=free_start - copy_start,
                           device_memory_s=free_s)

    def _mark_zero(self, slots: list[_Slot]) -> None:
        # One reduction per storage on the device and a single sync: far cheaper than copying.
        # Bytes, not values, are tested so -0.0 and NaN payloads are never mistaken for zero.
        flags = torch.stack([storage_view(s.storage, torch.uint8, s.nbytes).any() for s in slots]).tolist()
        for slot, nonzero in zip(slots, flags, strict=False):
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
        self.forget_discovery()
        start = time.perf_counter()
        slots = self._slots
        unguard(self._guarded)  # before any tensor is touched: every way back to the device lifts the guard
        self._guarded = []
        with record_function(f"hybridmem.onload.{self.owner}"):
            allocate_start = time.perf_counter()
            self._allocate(slots)
            allocate_s = time.perf_counter() - allocate_start
            for slot in slots:  # [Note: foreign storages]: finish a re-homing that was interrupted
                for view in slot.views or ():
                    view.point_at(slot.storage)
            arenas = {dtype: self.pool.arena(self.owner, dtype, 0)
                      for dtype in {s.dtype for s in slots if not s.zero}}
            stream = self._stream()
            event = self.accel.new_event()
            copy_start = time.perf_counter()
            with self.accel.on_side_stream(stream):
                for slot in slots:
                    dev = storage_view(slot.storage, slot.dtype, slot.numel)
                    if slot.zero:
                        dev.zero_()
                    else:
                        dev.copy_(arenas[slot.dtype].narrow(0, slot.arena_offset, slot.numel),
                                  non_blocking=True)
                event.record(stream)
            self.accel.current_stream().wait_event(event)
            event.synchronize()  # the report's time is the real copy time; arenas may be reused next
            copy_s = time.perf_counter() - copy_start
        self._state = OffloadState.ON_DEVICE
        self._slots = []
        self.pool.unhold(self.owner)
        return self._stats("onload", slots, time.perf_counter() - start, copy_s=copy_s,
                           device_memory_s=allocate_s)

    def _allocate(self, slots: list[_Slot]) -> None:
        done: list[_Slot] = []
        try:
            for slot in slots:
                if slot.storage.nbytes() != slot.nbytes:  # a storage never freed (interrupted) is kept
                    slot.storage.resize_(slot.nbytes)
                    done.append(slot)
        except BaseException:
            for slot in done:
                slot.storage.resize_(0)
            raise

    def _stats(self, direction: str, slots: list[_Slot], seconds: float, *, copy_s: float = 0.0,
               device_memory_s: float = 0.0) -> TransferStats:
        return TransferStats(
            copy_s=copy_s,
            device_memory_s=device_memory_s,
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
