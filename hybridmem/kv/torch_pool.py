"""The ``torch`` KV-cache allocator: one untyped storage, resized to 0 on release and back on resume.

Works on every backend (CPU included), at the price of addresses: the storage's memory may come back at
a different address, so CUDA graphs over the pool must be re-captured after ``resume``. See
[Note: KV views stay valid] in :mod:`hybridmem.kv.base`.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from hybridmem.accel import Accelerator
from hybridmem.kv.base import KVCacheAllocator, register_kv_allocator

__all__ = ["TorchKVAllocator"]


@register_kv_allocator
class TorchKVAllocator(KVCacheAllocator):
    """KV pool in one ``torch.UntypedStorage`` from the backend's own allocator.

    ``release`` resizes the storage to 0 bytes and empties the backend's allocator cache, so the bytes
    show up as free to other processes (``mem_get_info`` on CUDA), not just as cached in this one.

    Args:
        accel: The accelerator whose device holds the pool.
    """

    name: ClassVar[str] = "torch"
    preserves_addresses: ClassVar[bool] = False
    backends: ClassVar[frozenset[str]] = frozenset({"cpu", "cuda", "npu"})

    def __init__(self, accel: Accelerator):
        super().__init__(accel)
        self._storage: torch.UntypedStorage | None = None

    @property
    def storage(self) -> torch.UntypedStorage:
        """The pool's storage (all views share it)."""
        if self._storage is None:
            raise AssertionError(f"{self!r}: no storage outside allocate/close")
        return self._storage

    def _allocate(self, nbytes: int) -> None:
        self._storage = torch.UntypedStorage(nbytes, device=self.accel.device)

    def _release(self) -> int:
        freed_nbytes = self.storage.nbytes()
        self.storage.resize_(0)
        # resize_(0) hands the block to the caching allocator; emptying the cache gives it to the device.
        self.accel.empty_cache()
        return freed_nbytes

    def _resume(self) -> None:
        self.storage.resize_(self.nbytes)

    def _view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(0, dtype=dtype, device=self.accel.device).set_(self.storage, 0, shape)

    def _resident_nbytes(self) -> int:
        return self.storage.nbytes()

    def _close(self) -> None:
        self.storage.resize_(0)
        self._storage = None
        self.accel.empty_cache()
