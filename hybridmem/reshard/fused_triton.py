"""The checksum's figures in one pass on a GPU: a Triton kernel, optional (Triton comes with CUDA PyTorch).

[Note: fused figures on a GPU]
Off the CPU, torch takes a range's figures in float64 chunks: each chunk cast into a float64 buffer (a
write of 4 or 8 bytes per element read) and read back by two matrix-vector products ([Note: checksum
chunks] in :mod:`hybridmem.reshard.checksum`), so about 13 bytes of memory traffic per bf16 byte, where a
copy moves 2. :func:`triton_figures` reads each element once instead, widens it to float64 in a register,
weighs it by its row and column (``1 + (row mod rp) / rp`` and ``1 + (col mod cp) / cp``, as
:func:`~hybridmem.reshard.checksum.tensor_checksum` numbers a tensor) and, given a destination, writes it
there in the same pass: a copy that takes its figures on the way, as the CPU kernel does ([Note: fused
figures] in :mod:`hybridmem.reshard.fused_checksum`). Each program of the kernel sums one tile of at most
:data:`TILE` elements in float64 and writes its two sums; torch adds the tiles' sums up in a fixed order,
so a range gives the same figures every time, and the torch read's figures to float64 rounding (the
figures' comparison allows that). A range is read as at most three rectangles of the tensor's rows (a
partial first row, whole rows, a partial last row), so no element's row is found by a division. The
transient is the tiles' sums: 16 bytes per :data:`TILE` elements (8 MiB for a 1 GiB bf16 tensor, where
torch's chunked read takes a 32 MiB float64 buffer).

Element types: float32, float64, bfloat16 and float16 (widened exactly); others are read with torch. An
element type's first use in a process checks the kernel on the first elements against the figures'
definition computed with torch (:func:`_self_check`): both sides of a sync compare figures, and where one
side read with torch, a kernel a compiler got wrong would fail every sync instead of once. With no Triton,
or where the kernel fails to build, run or pass that check (it is then not tried again in this process,
a warning says why), :func:`triton_figures` answers ``None`` and the caller reads with torch.
``HYBRIDMEM_FUSED_CHECKSUM=0`` turns it off with the CPU kernel. Triton's interpreter
(``TRITON_INTERPRET=1``) runs the same kernel on CPU tensors: that is how the tests without a GPU check its
arithmetic (``tests/reshard/test_fused_triton.py``).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

__all__ = ["TILE", "row_rectangles", "triton_figures"]

log = logging.getLogger(__name__)

TILE = 2048
"""Elements one program of the kernel reads (a power of two: rows x columns of a tile)."""

_TYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_FAILED: list[str] = []
"""Why the kernel failed in this process, once it did (then torch reads from then on)."""


@functools.cache
def _kernel() -> Any:
    """The Triton kernel, or ``None`` without Triton (or with ``HYBRIDMEM_FUSED_CHECKSUM=0``)."""
    if os.environ.get("HYBRIDMEM_FUSED_CHECKSUM", "1") == "0":
        return None
    try:
        import triton  # noqa: PLC0415 - optional, and slow to import where it is not used
        import triton.language as tl  # noqa: PLC0415
    except ImportError:
        return None

    @triton.jit
    def figures_kernel(src, dst, partial, nrows, ncols, n_col_tiles, stride, row_lo, col_lo, rp, cp,
                       write: tl.constexpr, widen: tl.constexpr, br: tl.constexpr, bc: tl.constexpr):
        pid = tl.program_id(0)
        tile_r = pid // n_col_tiles
        tile_c = pid - tile_r * n_col_tiles
        rows = tile_r.to(tl.int64) * br + tl.arange(0, br)
        cols = tile_c.to(tl.int64) * bc + tl.arange(0, bc)
        mask = (rows[:, None] < nrows) & (cols[None, :] < ncols)
        offsets = rows[:, None] * stride + cols[None, :]
        x = tl.load(src + offsets, mask=mask, other=0)
        if write:
            tl.store(dst + offsets, x, mask=mask)
        if widen:  # a 2-byte float: exactly into float32 first
            x = x.to(tl.float32)
        x = x.to(tl.float64)
        u = 1.0 + ((rows + row_lo) % rp).to(tl.float64) / rp
        v = 1.0 + ((cols + col_lo) % cp).to(tl.float64) / cp
        tl.store(partial + 2 * pid, tl.sum(tl.sum(x, axis=1), axis=0))
        tl.store(partial + 2 * pid + 1, tl.sum(tl.sum(x * v[None, :], axis=1) * u, axis=0))

    return figures_kernel


def _shape(ncols: int) -> tuple[int, int]:
    """Rows and columns of a tile for rows of ``ncols`` elements: as wide as the rows (16 to 1024)."""
    bc = min(1024, max(16, 1 << max(0, ncols - 1).bit_length()))
    return TILE // bc, bc


def row_rectangles(n: int, lo: int, cols: int) -> list[tuple[int, int, int, int, int]]:
    """The rectangles ``(offset, rows, columns, first row, first column)`` of the range of ``n`` elements
    from element ``lo`` of a tensor with rows of ``cols``: a partial first row, whole rows, a partial last
    row (those present), in order (how the kernel and torch's chunked read,
    :func:`~hybridmem.reshard.checksum.range_checksum`, both cut a range)."""
    out, k = [], 0
    row, col = divmod(lo, cols)
    if col:
        first = min(cols - col, n)
        out.append((0, 1, first, row, col))
        k = first
    whole = (n - k) // cols
    if whole:
        out.append((k, whole, cols, (lo + k) // cols, 0))
        k += whole * cols
    if k < n:
        out.append((k, 1, n - k, (lo + k) // cols, 0))
    return out


def _launch(kernel: Any, src: torch.Tensor, dst: torch.Tensor | None, lo: int, cols: int, rp: int,
            cp: int) -> tuple[float, float]:
    """Run the kernel over the rectangles of ``src`` (checked by :func:`triton_figures`)."""
    rectangles = row_rectangles(src.numel(), lo, cols)
    grids = []
    for _, rows, ncols, _, _ in rectangles:
        br, bc = _shape(ncols)
        grids.append((br, bc, -(-ncols // bc), -(-rows // br)))
    partial = torch.empty(2 * sum(c * r for _, _, c, r in grids), dtype=torch.float64, device=src.device)
    source, target = src.detach(), (src.detach() if dst is None else dst.detach())
    start = 0
    for (offset, rows, ncols, row_lo, col_lo), (br, bc, col_tiles, row_tiles) in zip(rectangles, grids,
                                                                                   strict=True):
        programs = col_tiles * row_tiles
        kernel[(programs,)](source[offset:], target[offset:], partial[2 * start:], rows, ncols, col_tiles,
                            ncols, row_lo, col_lo, rp, cp, write=dst is not None,
                            widen=src.element_size() == 2, br=br, bc=bc)
        start += programs
    figures = partial.view(-1, 2).sum(0).tolist()
    return float(figures[0]), float(figures[1])


_CHECKED: set[torch.dtype] = set()
"""Element types whose first use in this process matched the definition (see :func:`_self_check`)."""
_CHECK_NUMEL = 1 << 16


def _self_check(kernel: Any, src: torch.Tensor, cols: int) -> str | None:
    """On an element type's first use in a process: the kernel's figures and copy of the first elements of
    ``src`` (up to :data:`_CHECK_NUMEL`, from a row's middle, so a partial row is among them) against the
    figures' definition computed with torch in float64 (a product of weights and values, nothing shared with
    the kernel); why they differ, or ``None``. A kernel that a compiler got wrong then fails here once,
    instead of failing every weight sync's comparison against the other side's torch figures."""
    sample = src[:_CHECK_NUMEL].detach()
    lo, rp, cp = cols // 2, 61, 53
    index = torch.arange(lo, lo + sample.numel(), dtype=torch.int64, device=sample.device)
    row, col = index // cols, index % cols
    weights = (1 + (row % rp).double() / rp) * (1 + (col % cp).double() / cp)
    values = sample.double()
    want = (values.sum().item(), (values * weights).sum().item())
    copy = torch.zeros_like(sample)
    got = [_launch(kernel, sample, copy, lo, cols, rp, cp), _launch(kernel, sample, None, lo, cols, rp, cp)]
    for figures in got:
        if any(abs(a - b) > 1e-9 * max(1.0, abs(b)) for a, b in zip(figures, want, strict=True)):
            return f"its figures of {sample.numel()} {sample.dtype} elements are {figures}, torch's {want}"
    if not torch.equal(copy, sample):
        return f"its copy of {sample.numel()} {sample.dtype} elements differs from the source"
    return None


def triton_figures(src: torch.Tensor, dst: torch.Tensor | None, lo: int, cols: int, rp: int,
                   cp: int) -> tuple[float, float] | None:
    """The figures of ``src``'s elements, numbered from ``lo`` in rows of ``cols`` (see [Note: fused figures
    on a GPU]), taken while copying them into ``dst`` (``None``: a read alone); ``None`` (nothing copied)
    where the kernel does not serve these tensors.

    Args:
        src: 1-D, contiguous, on a CUDA device (any device under Triton's interpreter).
        dst: 1-D, as many elements, the same dtype and device, contiguous; or ``None``.
        lo, cols, rp, cp: As :func:`~hybridmem.reshard.fused_checksum.fused_figures`.

    Raises:
        torch.OutOfMemoryError: The device had no room for the tiles' sums (the kernel stays in use).
    """
    if (src.dtype not in _TYPES or src.dim() != 1 or not src.is_contiguous() or _FAILED
            or (src.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1")):
        return None
    if dst is not None and (dst.dtype != src.dtype or dst.device != src.device or dst.dim() != 1
                            or dst.numel() != src.numel() or not dst.is_contiguous()
                            or src.requires_grad and torch.is_grad_enabled()):
        return None
    kernel = _kernel()
    if kernel is None:
        return None
    if src.numel() == 0:
        return 0.0, 0.0
    try:
        if src.dtype not in _CHECKED:
            wrong = _self_check(kernel, src, cols)
            if wrong is not None:
                raise ArithmeticError(f"the kernel disagrees with the figures' definition: {wrong}")
            _CHECKED.add(src.dtype)
        return _launch(kernel, src, dst, lo, cols, rp, cp)
    except torch.OutOfMemoryError:  # the device's state, not the kernel's: the caller's to handle
        raise
    except Exception as exc:  # a Triton that cannot build or run it here: torch reads from now on
        _FAILED.append(f"{type(exc).__name__}: {exc}")
        log.warning("hybridmem: the GPU one-pass checksum kernel failed (%s); figures are read with torch",
                    _FAILED[0])
        return None  # a copy may have written part of dst: the caller copies the whole range again
