"""A copy that takes the checksum's figures on the way, in one pass over the bytes (CPU, with numba).

[Note: fused figures]
:func:`hybridmem.reshard.checksum.copy_checksum` copies a range of a tensor and returns its figures
(the definition of :func:`~hybridmem.reshard.checksum.tensor_checksum`, restricted to the range). Done
as a copy and then a read, the read costs about as much as the copy again on a CPU (memory-bound:
one more pass over every byte, [Note: checksum chunks] in :mod:`hybridmem.reshard.checksum`); done here,
each element is read once, written once and added into the two float64 figures while in a register, so
the figures cost what the arithmetic costs: on cpu-2c, 100-400 MB on one thread, 3-10% of the copy's
time for float32 and 10-18% for bfloat16 (``python benchmarks/checksum.py``). The same kernel without
the write is :func:`~hybridmem.reshard.checksum.tensor_checksum`'s read of a contiguous CPU tensor (one
pass, no float64 buffer). Element types: float32 and float64 as they are, bfloat16 and float16 widened
from their bits (a shift, ``fpext``), the two float8 types through a 256-entry table of their values
(taken from torch, so the values are torch's). Elements are numbered in the range's tensor as
``tensor_checksum`` numbers them: rows of ``cols`` elements, a row's weight ``1 + (row mod rp) / rp``, a
column's ``1 + (col mod cp) / cp``; float64 sums in another order than torch's chunks, so the two agree
to float64 rounding, which is what the figures' comparison allows.

On a GPU the same is a Triton kernel ([Note: fused figures on a GPU] in
:mod:`hybridmem.reshard.fused_triton`). Numba is optional (vLLM brings it): without it (or Triton on a
GPU), for another dtype or for a non-contiguous range, :func:`fused_figures` answers ``None`` and the
caller reads with torch
(``tests/reshard/test_checksum.py`` runs both). The kernel holds no GIL and starts no threads of its own
(a vLLM worker and the trainer each run it on their one thread, [Note: vllm packing] in
:mod:`hybridmem.adapters.vllm.server.packing`); numba compiles it once per element type and machine and
caches it (about 0.3 s each the first time). ``HYBRIDMEM_FUSED_CHECKSUM=0`` turns it off.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from hybridmem.reshard.fused_triton import triton_figures

__all__ = ["fused_figures"]

log = logging.getLogger(__name__)

_BITS: dict[torch.dtype, torch.dtype] = {torch.float32: torch.float32, torch.float64: torch.float64,
                                        torch.bfloat16: torch.int16, torch.float16: torch.uint16,
                                        torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
"""The dtype each supported element type is handed to the kernel as (its own, or its bits: the kernel
tells bfloat16 from float16 by int16 against uint16)."""


_REFUSED: set[torch.dtype] = set()
"""Element types the kernel failed to take in this process (read with torch from then on)."""


@functools.cache
def _kernel() -> Callable[..., tuple[float, float]] | None:
    """The compiled kernel, or ``None`` without numba (or with ``HYBRIDMEM_FUSED_CHECKSUM=0``)."""
    if os.environ.get("HYBRIDMEM_FUSED_CHECKSUM", "1") == "0":
        return None
    try:
        from hybridmem.reshard.fused_kernels import copy_figures  # noqa: PLC0415 - numba is optional
    except ImportError:
        return None
    except Exception as exc:  # a numba that cannot cache or build here: torch reads instead
        log.warning("hybridmem: the one-pass checksum kernel is unavailable (%s: %s); figures are read with "
                    "torch", type(exc).__name__, exc)
        return None
    return copy_figures


@functools.cache
def _vtab(cp: int) -> Any:
    """``1 + (p mod cp) / cp`` for ``p < BLOCK + cp`` (numpy float64)."""
    from hybridmem.reshard.fused_kernels import BLOCK  # noqa: PLC0415 - as _kernel
    return (1.0 + torch.arange(BLOCK + cp, dtype=torch.float64).remainder(cp) / cp).numpy()


@functools.cache
def _table(dtype: torch.dtype) -> Any:
    """The float32 value of each of a one-byte type's 256 bit patterns (torch's), or a dummy table."""
    if dtype.itemsize != 1:
        return torch.zeros(1, dtype=torch.float32).numpy()
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32).numpy()


def fused_figures(src: torch.Tensor, dst: torch.Tensor | None, lo: int, cols: int, rp: int,
                  cp: int) -> tuple[float, float] | None:
    """The figures of ``src``'s elements, numbered from ``lo`` in rows of ``cols`` (see [Note: fused
    figures]), taken while copying them into ``dst`` (``None``: a read alone); ``None`` (nothing copied)
    where no kernel serves these tensors.

    Args:
        src: 1-D, contiguous, on the CPU (on a GPU: :func:`~hybridmem.reshard.fused_triton.triton_figures`).
        dst: 1-D, as many elements, the same dtype, contiguous, on the same device; or ``None``.
        lo: The tensor's index of the first element.
        cols: Elements per row of the tensor (``tensor_checksum``'s view).
        rp: The row weights' period (1: every row weighs 1).
        cp: The column weights' period.
    """
    if src.device.type != "cpu":  # before the CPU kernel: a GPU process never imports numba (0.4 s on cpu-2c)
        return triton_figures(src, dst, lo, cols, rp, cp)
    if src.dtype not in _BITS or src.dtype in _REFUSED or src.dim() != 1 or not src.is_contiguous():
        return None
    kernel = _kernel()
    if kernel is None:
        return None
    if dst is not None and (dst.dtype != src.dtype or dst.device.type != "cpu" or dst.dim() != 1
                            or dst.numel() != src.numel() or not dst.is_contiguous()
                            or src.requires_grad and torch.is_grad_enabled()):
        return None
    if src.numel() == 0:
        return 0.0, 0.0
    bits = _BITS[src.dtype]
    try:  # typing and compiling come before the kernel's first write
        s = src.detach().view(bits).numpy()
        d = s if dst is None else dst.detach().view(bits).numpy()
        total, weighted = kernel(s, d, dst is not None, lo, cols, rp, cp, _vtab(cp), _table(src.dtype))
    except Exception as exc:  # numpy or numba cannot take this dtype here: torch reads it from now on
        _REFUSED.add(src.dtype)
        log.warning("hybridmem: the one-pass checksum kernel cannot take %s (%s: %s); its figures are read "
                    "with torch", src.dtype, type(exc).__name__, exc)
        return None
    return float(total), float(weighted)
