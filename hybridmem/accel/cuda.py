"""CUDA and Ascend NPU backends.

torch_npu mirrors ``torch.cuda`` as ``torch.npu`` (streams, events, ``mem_get_info``, the caching
allocator's statistics), so one class serves both; only the module differs. torch_npu is imported
lazily, the first time an NPU accelerator is asked for.
"""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Any, ClassVar

import torch

from hybridmem.accel.base import Accelerator, MemoryFigures

__all__ = ["CudaAccelerator", "NpuAccelerator"]


class _CudaLikeAccelerator(Accelerator):
    """An accelerator whose torch module follows the ``torch.cuda`` API."""

    supports_pinned_memory: ClassVar[bool] = True
    has_streams: ClassVar[bool] = True
    measures_device_memory: ClassVar[bool] = True

    @classmethod
    def _module(cls) -> ModuleType:
        raise NotImplementedError

    def __init__(self, device: torch.device | None = None):
        if device is None:
            device = torch.device(self.name, 0)
        elif device.index is None:
            device = torch.device(device.type, 0)
        super().__init__(device)

    @property
    def _mod(self) -> ModuleType:
        return self._module()

    def current_stream(self) -> Any:
        return self._mod.current_stream(self.device)

    def new_stream(self) -> Any:
        return self._mod.Stream(device=self.device)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self._mod.stream(stream)

    def new_event(self) -> Any:
        return self._mod.Event()

    def synchronize(self) -> None:
        self._mod.synchronize(self.device)

    def memory_figures(self, tracked_nbytes: int = 0) -> MemoryFigures:
        del tracked_nbytes  # the allocator knows
        free, total = self._mod.mem_get_info(self.device)
        return MemoryFigures(
            allocated_nbytes=self._mod.memory_allocated(self.device),
            reserved_nbytes=self._mod.memory_reserved(self.device),
            free_nbytes=free,
            total_nbytes=total,
        )

    def reset_peak(self) -> None:
        self._mod.reset_peak_memory_stats(self.device)

    def peak_allocated_nbytes(self) -> int | None:
        return self._mod.max_memory_allocated(self.device)

    def empty_cache(self) -> None:
        self._mod.empty_cache()


class CudaAccelerator(_CudaLikeAccelerator):
    """An NVIDIA (or ROCm) GPU through ``torch.cuda``."""

    name: ClassVar[str] = "cuda"

    @classmethod
    def _module(cls) -> ModuleType:
        return torch.cuda

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()


class NpuAccelerator(_CudaLikeAccelerator):
    """An Ascend NPU through torch_npu's ``torch.npu``."""

    name: ClassVar[str] = "npu"

    @classmethod
    def _module(cls) -> ModuleType:
        importlib.import_module("torch_npu")  # registers torch.npu
        return torch.npu  # type: ignore[attr-defined]

    @classmethod
    def is_available(cls) -> bool:
        try:
            return bool(cls._module().is_available())
        except ImportError:
            return False
