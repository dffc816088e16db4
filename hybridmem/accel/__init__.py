"""Accelerator backends behind one interface, picked by name.

>>> from hybridmem.accel import get_accelerator
>>> get_accelerator("cpu").device
device(type='cpu')
"""

from __future__ import annotations

from typing import Any

import torch

from hybridmem.accel.base import Accelerator, MemoryFigures
from hybridmem.accel.cpu import CpuAccelerator
from hybridmem.accel.cuda import CudaAccelerator, NpuAccelerator

__all__ = [
    "Accelerator",
    "MemoryFigures",
    "CpuAccelerator",
    "CudaAccelerator",
    "NpuAccelerator",
    "ACCELERATORS",
    "get_accelerator",
]

ACCELERATORS: dict[str, type[Accelerator]] = {
    cls.name: cls for cls in (NpuAccelerator, CudaAccelerator, CpuAccelerator)
}
"""Backends by name, in the order ``"auto"`` tries them."""


def get_accelerator(spec: str | torch.device | Accelerator = "auto", **kwargs: Any) -> Accelerator:
    """Return the accelerator for ``spec``.

    Args:
        spec: ``"auto"`` (npu, then cuda, then cpu), a backend name, ``"cuda:1"``, a ``torch.device``,
            or an :class:`Accelerator`, which is returned as is.
        **kwargs: Passed to the backend's constructor (e.g. ``capacity_nbytes`` for cpu).

    Raises:
        ValueError: The backend name is unknown, or the backend is not available here.
    """
    if isinstance(spec, Accelerator):
        return spec
    if spec == "auto":
        for cls in ACCELERATORS.values():
            if cls.is_available():
                return cls(**kwargs)
        raise AssertionError("unreachable: the cpu backend is always available")
    device = torch.device(spec)
    cls = ACCELERATORS.get(device.type)
    if cls is None:
        raise ValueError(f"device {str(spec)!r} has no hybridmem backend; expected one of "
                         f"{sorted(ACCELERATORS)}")
    if not cls.is_available():
        raise ValueError(f"device {str(spec)!r} was asked for but backend {cls.name!r} is not available here")
    return cls(device, **kwargs)
