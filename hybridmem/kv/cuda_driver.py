"""The few CUDA driver calls the ``cuda-vmm`` allocator needs, through ``cuda.bindings.driver``.

``cuda.bindings`` (the ``cuda-bindings`` / ``cuda-python`` package) is imported when a :class:`CudaDriver`
is built, never at module import, so hybridmem imports fine without it. Every method checks the
``CUresult`` the binding returns and raises :class:`CudaDriverError` naming the call and the error, so
callers can undo what they did (see :class:`hybridmem.kv.vmm.VmmMapping`).

The calls follow the CUDA virtual memory management API (CUDA driver API, "Virtual Memory Management"):
reserve an address range, create physical allocations, map them into the range, grant access, and undo
each step in reverse.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from hybridmem.errors import HybridMemError

__all__ = ["CudaDriver", "CudaDriverError", "cuda_bindings_available"]


class CudaDriverError(HybridMemError, RuntimeError):
    """A CUDA driver call returned an error.

    Attributes:
        step: The driver function (e.g. ``"cuMemCreate"``).
        code: The ``CUresult`` name (e.g. ``"CUDA_ERROR_OUT_OF_MEMORY"``).
    """

    def __init__(self, step: str, code: str, detail: str = ""):
        self.step = step
        self.code = code
        super().__init__(f"{step} failed with {code}" + (f" ({detail})" if detail else ""))

    @property
    def out_of_memory(self) -> bool:
        """Whether the device had too little memory for the call."""
        return self.code == "CUDA_ERROR_OUT_OF_MEMORY"


def _import_driver() -> ModuleType:
    try:
        return importlib.import_module("cuda.bindings.driver")
    except ImportError:
        # cuda-python < 12.6 only ships the older module path.
        return importlib.import_module("cuda.cuda")


def cuda_bindings_available() -> bool:
    """Whether ``cuda.bindings.driver`` (or the older ``cuda.cuda``) can be imported."""
    try:
        _import_driver()
    except ImportError:
        return False
    return True


class CudaDriver:
    """Checked wrappers over the VMM calls of the CUDA driver, for one device.

    The caller makes the device's primary context current first (PyTorch does when it initialises the
    device; :class:`hybridmem.kv.vmm.CudaVmmKVAllocator` runs every call under ``torch.cuda.device``).

    Args:
        device_index: The CUDA device ordinal allocations are placed on.

    Raises:
        ImportError: ``cuda.bindings`` is not installed (the message says which package provides it).
    """

    def __init__(self, device_index: int):
        try:
            self._drv = _import_driver()
        except ImportError as exc:
            raise ImportError(
                "the cuda-vmm KV-cache allocator needs NVIDIA's CUDA Python bindings: "
                "pip install cuda-bindings (module cuda.bindings.driver)"
            ) from exc
        self.device_index = device_index
        self._check("cuInit", self._drv.cuInit(0))
        drv = self._drv
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
        prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        self._prop = prop
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device_index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access

    def _check(self, step: str, result: Any) -> Any:
        """Unpack ``(CUresult, *values)``; raise :class:`CudaDriverError` unless it is CUDA_SUCCESS."""
        if not isinstance(result, tuple):
            result = (result,)
        err, values = result[0], result[1:]
        if err != self._drv.CUresult.CUDA_SUCCESS:
            code = getattr(err, "name", str(err))
            raise CudaDriverError(step, code, f"device {self.device_index}")
        return values[0] if len(values) == 1 else values

    def _ptr(self, address: int) -> Any:
        return self._drv.CUdeviceptr(address)

    def granularity(self) -> int:
        """Minimum physical allocation granularity in bytes (2 MiB on current NVIDIA GPUs)."""
        flag = self._drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(self._check("cuMemGetAllocationGranularity",
                               self._drv.cuMemGetAllocationGranularity(self._prop, flag)))

    def reserve(self, nbytes: int, alignment: int) -> int:
        """Reserve ``nbytes`` of virtual address space; returns its start address."""
        return int(self._check("cuMemAddressReserve", self._drv.cuMemAddressReserve(nbytes, alignment, 0, 0)))

    def free(self, address: int, nbytes: int) -> None:
        """Give a reserved address range back (everything in it must be unmapped)."""
        self._check("cuMemAddressFree", self._drv.cuMemAddressFree(self._ptr(address), nbytes))

    def create(self, nbytes: int) -> Any:
        """Create a physical allocation of ``nbytes`` on the device; returns its handle."""
        return self._check("cuMemCreate", self._drv.cuMemCreate(nbytes, self._prop, 0))

    def release(self, handle: Any) -> None:
        """Release a physical allocation (its memory returns to the device once it is unmapped)."""
        self._check("cuMemRelease", self._drv.cuMemRelease(handle))

    def map(self, address: int, nbytes: int, handle: Any) -> None:
        """Map the whole allocation ``handle`` at ``address``."""
        self._check("cuMemMap", self._drv.cuMemMap(self._ptr(address), nbytes, 0, handle, 0))

    def set_access(self, address: int, nbytes: int) -> None:
        """Grant this device read/write access to a mapped range."""
        self._check("cuMemSetAccess", self._drv.cuMemSetAccess(self._ptr(address), nbytes, [self._access], 1))

    def unmap(self, address: int, nbytes: int) -> None:
        """Unmap a mapped range."""
        self._check("cuMemUnmap", self._drv.cuMemUnmap(self._ptr(address), nbytes))
