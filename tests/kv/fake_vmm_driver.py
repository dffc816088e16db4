"""A CPU stand-in for the CUDA VMM driver calls, with real bookkeeping and injectable failures.

It enforces the rules the driver enforces (map only inside a reservation and never over a mapping,
unmap exactly what was mapped, free only an unmapped range, physical memory limited to a capacity) so
tests of :class:`hybridmem.kv.vmm.VmmMapping` catch leaks and bad undo orders on a machine without a GPU.
"""

from __future__ import annotations

import itertools

from hybridmem.kv.cuda_driver import CudaDriverError


class FakeVmmDriver:
    """Reserved ranges, physical handles and mappings kept in dicts.

    Args:
        capacity_nbytes: Physical memory; ``create`` beyond it fails with CUDA_ERROR_OUT_OF_MEMORY.
        granularity: What ``granularity()`` reports.
        fail_at: ``{step: n}``: the n-th call (1-based, counted over the driver's life) of ``step``
            (``"cuMemCreate"``, ``"cuMemMap"``, ``"cuMemSetAccess"``) fails.
    """

    def __init__(self, *, capacity_nbytes: int, granularity: int = 2 << 20,
                 fail_at: dict[str, int] | None = None):
        self.capacity_nbytes = capacity_nbytes
        self._granularity = granularity
        self.fail_at = dict(fail_at or {})
        self.calls: dict[str, int] = {}
        self.reserved: dict[int, int] = {}  # address -> nbytes
        self.handles: dict[int, int] = {}  # handle -> nbytes (created, not released)
        self._sizes: dict[int, int] = {}  # every handle ever created -> nbytes
        self.mapped: dict[int, tuple[int, int]] = {}  # address -> (nbytes, handle)
        self.accessible: set[int] = set()  # mapped addresses with access granted
        self._next_address = 1 << 40
        self._handle_ids = itertools.count(1)
        self.log: list[tuple[str, int]] = []

    def _count(self, step: str) -> None:
        self.calls[step] = self.calls.get(step, 0) + 1
        if self.fail_at.get(step) == self.calls[step]:
            raise CudaDriverError(step, "CUDA_ERROR_INVALID_VALUE", "injected")

    @property
    def physical_nbytes(self) -> int:
        """Physical bytes held by handles not yet released, or released but still mapped."""
        live = set(self.handles) | {h for _, h in self.mapped.values()}
        return sum(self._sizes[h] for h in live)

    def granularity(self) -> int:
        return self._granularity

    def reserve(self, nbytes: int, alignment: int) -> int:
        assert nbytes % self._granularity == 0 and alignment % self._granularity == 0, (nbytes, alignment)
        address = self._next_address
        self._next_address += nbytes + (1 << 30)
        self.reserved[address] = nbytes
        return address

    def free(self, address: int, nbytes: int) -> None:
        if self.reserved.get(address) != nbytes:
            raise CudaDriverError("cuMemAddressFree", "CUDA_ERROR_INVALID_VALUE", f"{address:#x}+{nbytes}")
        if any(address <= a < address + nbytes for a in self.mapped):
            raise CudaDriverError("cuMemAddressFree", "CUDA_ERROR_INVALID_VALUE", "range still mapped")
        del self.reserved[address]

    def create(self, nbytes: int) -> int:
        self._count("cuMemCreate")
        assert nbytes % self._granularity == 0, nbytes
        if self.physical_nbytes + nbytes > self.capacity_nbytes:
            raise CudaDriverError("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY")
        handle = next(self._handle_ids)
        self.handles[handle] = nbytes
        self._sizes[handle] = nbytes
        return handle

    def release(self, handle: int) -> None:
        if handle not in self.handles:
            raise CudaDriverError("cuMemRelease", "CUDA_ERROR_INVALID_VALUE", f"handle {handle}")
        del self.handles[handle]

    def map(self, address: int, nbytes: int, handle: int) -> None:
        self._count("cuMemMap")
        if handle not in self.handles or self.handles[handle] != nbytes:
            raise CudaDriverError("cuMemMap", "CUDA_ERROR_INVALID_VALUE", f"handle {handle}")
        if not any(r <= address and address + nbytes <= r + n for r, n in self.reserved.items()):
            raise CudaDriverError("cuMemMap", "CUDA_ERROR_INVALID_VALUE", "outside every reservation")
        if any(a < address + nbytes and address < a + n for a, (n, _) in self.mapped.items()):
            raise CudaDriverError("cuMemMap", "CUDA_ERROR_INVALID_VALUE", "overlaps a mapping")
        self.mapped[address] = (nbytes, handle)
        self.log.append(("map", address))

    def set_access(self, address: int, nbytes: int) -> None:
        self._count("cuMemSetAccess")
        if self.mapped.get(address, (None,))[0] != nbytes:
            raise CudaDriverError("cuMemSetAccess", "CUDA_ERROR_INVALID_VALUE", "not mapped")
        self.accessible.add(address)

    def unmap(self, address: int, nbytes: int) -> None:
        if self.mapped.get(address, (None,))[0] != nbytes:
            raise CudaDriverError("cuMemUnmap", "CUDA_ERROR_INVALID_VALUE",
                                  f"{address:#x}+{nbytes} not mapped")
        del self.mapped[address]
        self.accessible.discard(address)
        self.log.append(("unmap", address))
