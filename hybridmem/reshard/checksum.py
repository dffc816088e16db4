"""Runtime check of a weight sync: per-cell checksums compared between sender and receiver.

Every cell of a plan (a local copy or a transfer, see [Note: plan cells] in :mod:`hybridmem.reshard.plan`)
gets two float64 figures, computed once from the source tensor by the rank that sends it and once from the
destination tensor by the rank that received it: the plain sum and a position-weighted sum
``u(row) @ X @ v(col)`` whose weights depend on the cell's position in the HF-full tensor, so swapped rows
or columns (a wrong interleave) change it. Each sender passes its figures to the receiver of each cell (one
message per peer, cells in plan order, so a rank's own share of the plan is enough), the receiver compares,
and one ``all_reduce`` of one count per rank tells every rank whether any rank found a mismatch: every rank
then raises :class:`~hybridmem.errors.WeightSyncError`, the finding rank naming the tensor, the slice
and both ranks, the others naming the ranks that found it. Cost: one extra read of the weights in
float64 chunks (see [Note: checksum chunks]), ``2`` doubles per cell sent, and ``world`` doubles summed.

[Note: checksum chunks]
One read of ``x``: each chunk (whole rows, or part of one row when a row is longer than a chunk) is
cast into one reused float64 buffer and read back, while still in cache, by two matrix-vector
products, ``chunk @ v`` and ``chunk @ 1``, added into two per-row accumulators. The weighted one is
indexed by row class: a chunk's rows land from position ``(row_lo + first row) mod row_period`` on,
so ``u`` (one period long, plus a chunk's height) is applied once at the end. Why not fewer or other
passes (cpu-2c, 100 MB): ``torch.sum(x, dtype=float64)`` casts all of ``x`` first (a transient of
the whole tensor in float64; 6x the copy's time for fp32, 12x for bf16); ``chunk @ [v, 1]`` as one
``(n, 2)`` product is slower in MKL than two ``mv``; summing row periods
(``chunk.view(-1, 61, cols).sum(0)``) needs 61 rows per chunk, more than a core's L2 for a 4096-wide
weight. What is left is mostly the cast (one float64 element written per element read): the whole
checksum of a 100 MB tensor takes about 1.2x a plain copy of it for fp32 and 2x for bf16 on cpu-2c
(``benchmarks/checksum.py``). Float64 accumulation throughout, so the figures agree to float64
rounding whatever the chunking or the thread count. On a CPU with numba, a contiguous tensor is read
by one kernel instead, and a copy can take the figures of what it writes ([Note: fused figures] in
:mod:`hybridmem.reshard.fused_checksum`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hybridmem.errors import WeightSyncError
from hybridmem.reshard.deadline import Bound, exchange, global_rank, wait_all
from hybridmem.reshard.execute import pack_cell
from hybridmem.reshard.fp8 import dequantize_block_fp8
from hybridmem.reshard.fused_checksum import fused_figures
from hybridmem.reshard.fused_triton import row_rectangles
from hybridmem.reshard.plan import ReshardPlan, Transfer, cell_dtype
from hybridmem.reshard.transforms import Box, piece_view

__all__ = [
    "box_checksum", "CellChecksums", "copy_checksum", "range_checksum", "tensor_checksum", "verify_offline",
]

_CHUNK_NUMEL = 1 << 18
"""Float64 elements of the one cast buffer on a CPU: 2 MiB, so each thread's half of a chunk stays in
its core's L2 while the two products read it back (2**17 to 2**18 are the fastest on cpu-2c; 2**15 pays
more in per-chunk calls, 2**22 writes each chunk out to memory and reads it back)."""

_ACCEL_CHUNK_NUMEL = 1 << 22
"""The same off the CPU: 32 MiB, so a 100 MB tensor takes a dozen chunks of three kernel launches."""


@functools.lru_cache(maxsize=64)
def _periodic(period: int, numel: int, device: torch.device) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float64, device=device).remainder_(period).div_(period).add_(1.0)


def _weights(lo: int, hi: int, period: int, device: torch.device) -> torch.Tensor:
    """``1 + (i mod period) / period`` for ``lo <= i < hi`` (period 1: all ones), a read-only view of a
    cached vector (lengths rounded up to a power of two, so a few vectors serve every call)."""
    numel = 1 << (hi - lo + period - 2).bit_length()
    start = lo % period
    return _periodic(period, numel, device)[start:start + hi - lo]


def _figures(x: torch.Tensor, row_lo: int, row_period: int, col_lo: int,
             col_period: int) -> tuple[float, float]:
    """``(sum, u @ x @ v)`` of the 2-D ``x`` in float64, ``u`` and ``v`` the :func:`_weights` of its rows
    from ``row_lo`` and of its columns from ``col_lo``, in one chunked read (see [Note: checksum chunks]).
    """
    rows, cols = x.shape
    if rows == 0 or cols == 0:
        return 0.0, 0.0
    chunk = _CHUNK_NUMEL if x.device.type == "cpu" else _ACCEL_CHUNK_NUMEL
    row_step, col_step = (min(rows, max(1, chunk // cols)), cols) if cols <= chunk else (1, chunk)
    device = x.device
    buf = torch.empty(row_step * col_step, dtype=torch.float64, device=device)
    # weighted[p]: the products of rows in class p mod row_period (the chunk at row r starts at its class)
    weighted = torch.zeros(row_step + row_period - 1, dtype=torch.float64, device=device)
    total = torch.zeros(row_step, dtype=torch.float64, device=device)
    for c in range(0, cols, col_step):
        width = min(col_step, cols - c)
        v = _weights(col_lo + c, col_lo + c + width, col_period, device)
        ones = _weights(0, width, 1, device)
        block = buf[:row_step * width].view(row_step, width)
        for r in range(0, rows, row_step):
            height = min(row_step, rows - r)
            part = block[:height]
            part.copy_(x[r:r + height, c:c + width])
            start = (row_lo + r) % row_period
            weighted[start:start + height].addmv_(part, v)
            total[:height].addmv_(part, ones)
    u = _weights(0, weighted.numel(), row_period, device)
    figures = torch.stack([total.sum(), u @ weighted]).tolist()
    return figures[0], figures[1]


def box_checksum(x: torch.Tensor, box: Box) -> tuple[float, float]:
    """``(sum, weighted sum)`` in float64 of ``x``, the slice ``box`` of an HF-full tensor (1-D or 2-D box).

    The weights belong to the HF-full coordinates, so a receiver holding the same cell in another layout
    gets the same figures: ``u(row) @ x @ v(col)`` with ``u = 1 + (row mod 61) / 61`` and
    ``v = 1 + (col mod 53) / 53`` (a 1-D box: ``x @ u(index)``). Computed where ``x`` lies, in chunks (see
    [Note: checksum chunks]): whatever the size of ``x``, the transient is one buffer of at most
    ``_CHUNK_NUMEL`` float64 elements (2 MiB; ``_ACCEL_CHUNK_NUMEL``, 32 MiB, off the CPU) and two
    float64 accumulators of a chunk's height plus 60 (``_CHUNK_NUMEL // width``: small but for narrow
    boxes, so three chunks at worst). ``x`` is viewed with ``box``'s shape (copied by ``reshape`` only
    where no view exists).
    """
    x = x.detach()
    shape = tuple(b - a for a, b in box)
    if tuple(x.shape) != shape:
        x = x.reshape(shape)
    if x.is_complex():
        raise TypeError(f"box_checksum takes real tensors, got {x.dtype}")
    if x.dim() == 1:
        return _figures(x[None], 0, 1, box[0][0], 61)
    if x.dim() != 2:
        raise ValueError(f"box_checksum supports 1-D and 2-D boxes, got {box}")
    return _figures(x, box[0][0], 61, box[1][0], 53)


def _row_views(t: torch.Tensor, row_lo: int) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first row, 2-D view)`` covering the rows of ``t`` (2-D or more, viewed as ``(-1, last dim)``)
    in order: one view where the strides allow it, else one per leading index (never a copy)."""
    try:
        rows = t.view(-1, t.shape[-1])
    except RuntimeError:  # strides no view can merge (a permuted tensor): split the leading dim
        rows_per_index = math.prod(t.shape[1:-1])
        for i in range(t.shape[0]):
            yield from _row_views(t[i], row_lo + i * rows_per_index)
        return
    yield row_lo, rows


def tensor_checksum(t: torch.Tensor) -> tuple[float, float]:
    """``(sum, weighted sum)`` in float64 of the whole of ``t``, computed on its own device.

    Defined as :func:`box_checksum` of ``t`` viewed as ``(numel // last dim, last dim)`` with the box
    ``((0, rows), (0, cols))``, a 0-D or 1-D ``t`` as the 1-D box ``((0, numel),)``: the same function
    and the same bounded transient. Values are read as numbers: floating dtypes (fp8 included), integers
    and bool are cast to float64 exactly (int64 beyond ``2**53`` rounds); complex dtypes raise.

    Raises:
        TypeError: ``t`` is complex.
    """
    t = t.detach()
    if t.is_complex():
        raise TypeError(f"tensor_checksum takes real tensors, got {t.dtype}")
    if t.is_contiguous():  # the whole tensor as one range (one pass of the CPU kernel where it serves)
        return range_checksum(t.view(-1), 0, t.shape)
    if t.dim() <= 1:
        return box_checksum(t.reshape(-1), ((0, t.numel()),))
    if t.numel() == 0:
        return 0.0, 0.0
    total = weighted = 0.0
    for row_lo, rows in _row_views(t, 0):
        figures = _figures(rows, row_lo, 61, 0, 53)
        total, weighted = total + figures[0], weighted + figures[1]
    return total, weighted


def _grid(shape: Sequence[int]) -> tuple[int, int, int]:
    """``(cols, row period, column period)`` of :func:`tensor_checksum`'s numbering of a tensor of ``shape``:
    rows of its last dim weighted mod 61 and 53; a 0-D or 1-D one as one row weighted mod 61."""
    if len(shape) <= 1:
        return max(math.prod(shape), 1), 1, 61
    return max(shape[-1], 1), 61, 53


def range_checksum(x: torch.Tensor, lo: int, shape: Sequence[int]) -> tuple[float, float]:
    """The figures of ``x``, 1-D, as the elements ``lo, lo + 1, ...`` of a tensor of ``shape`` (flat,
    row-major): the ranges of a tensor, summed, give its :func:`tensor_checksum` (to float64 rounding).
    Read with torch in chunks, as :func:`tensor_checksum` (a partial first and last row apart)."""
    x = x.detach()
    if x.is_complex():
        raise TypeError(f"range_checksum takes real tensors, got {x.dtype}")
    cols, rp, cp = _grid(shape)
    figures = fused_figures(x, None, lo, cols, rp, cp)
    if figures is not None:
        return figures
    total = weighted = 0.0
    for offset, rows, width, row_lo, col_lo in row_rectangles(x.numel(), lo, cols):
        figures = _figures(x[offset:offset + rows * width].view(rows, width), row_lo, rp, col_lo, cp)
        total, weighted = total + figures[0], weighted + figures[1]
    return total, weighted


def copy_checksum(dst: torch.Tensor, src: torch.Tensor, lo: int, shape: Sequence[int]) -> tuple[float, float]:
    """``dst.copy_(src)`` (1-D, as many elements) and :func:`range_checksum` of what it wrote, as the
    elements ``lo, ...`` of a tensor of ``shape``: in one pass where a CPU kernel serves the dtype ([Note:
    fused figures] in :mod:`hybridmem.reshard.fused_checksum`), else a copy and then a read."""
    cols, rp, cp = _grid(shape)
    fused = fused_figures(src, dst, lo, cols, rp, cp)
    if fused is not None:
        return fused
    dst.copy_(src)
    return range_checksum(dst, lo, shape)


@functools.lru_cache(maxsize=16)
def _cells(plan: ReshardPlan, rank: int) -> tuple[Transfer, ...]:
    """The cells ``rank`` sends, receives or copies: its local copies, then each step's in plan order."""
    return (*plan.local[rank],
            *(t for bucket in plan.buckets for t in bucket if rank in (t.src_rank, t.dst_rank)))


class CellChecksums:
    """This rank's figures of the cells of ``plan`` it sends, receives or copies.

    Fill the source side with :meth:`add_source`, the destination side with :meth:`add_destination`
    (all at once, or tensor by tensor as a stream yields them), then call :meth:`compare` on every rank.
    ``plan`` may be the whole plan or this rank's share of it.
    """

    def __init__(self, plan: ReshardPlan, rank: int):
        self.plan, self.rank = plan, rank
        cells = _cells(plan, rank)
        self._figures = torch.zeros(2, len(cells), 2, dtype=torch.float64)
        self._src = [i for i, t in enumerate(cells) if t.src_rank == rank]
        self._dst_by_name: dict[str, list[int]] = {}
        for i, t in enumerate(cells):
            if t.dst_rank == rank:
                self._dst_by_name.setdefault(t.dst_name, []).append(i)

    def add_source(self, src: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> None:
        """Figures of the cells this rank sends (or copies locally), from its source tensors as cast to
        the wire ``dtype`` (see [Note: wire dtype] in :mod:`hybridmem.reshard.execute`); of a cell that
        travels quantized, of the float32 values its e4m3 values and block scales stand for ([Note: fp8
        assembly] in :mod:`hybridmem.reshard.fp8_stream`)."""
        cells = _cells(self.plan, self.rank)
        for i in self._src:
            t = cells[i]
            piece = piece_view(src[t.src_name], t.src_piece, t.box)
            if self.plan.quantizes(t):
                piece = dequantize_block_fp8(*pack_cell(self.plan, t, src, dtype or piece.dtype))
            elif dtype is not None:
                piece = piece.to(cell_dtype(self.plan, t.hf_name, dtype))
            self._figures[0, i] = torch.tensor(box_checksum(piece, t.box))

    def add_destination(self, name: str, tensor: torch.Tensor) -> None:
        """Figures of the cells of destination tensor ``name`` (as the engine holds it now)."""
        cells = _cells(self.plan, self.rank)
        for i in self._dst_by_name.get(name, ()):
            t = cells[i]
            self._figures[1, i] = torch.tensor(box_checksum(piece_view(tensor, t.dst_piece, t.box), t.box))

    def add_destinations(self, dst: Mapping[str, torch.Tensor]) -> None:
        """:meth:`add_destination` for every destination tensor of this rank."""
        for name in self._dst_by_name:
            self.add_destination(name, dst[name])

    def compare(self, group: Any = None, *, device: torch.device | str = "cpu",
                bound: Bound | None = None) -> int:
        """Pass source figures to the receivers, compare, and agree on the outcome over ``group``;
        returns the number of cells this rank checked (those it received or copied).

        Raises:
            WeightSyncError: A cell's figures differ on some rank (on that rank: names the tensor, the
                slice, the source and the destination rank; on the others: the ranks that found it).
            CollectiveTimeoutError: A peer did not take part within ``bound`` (see [Note: collective
                deadlines] in :mod:`hybridmem.reshard.execute`).
        """
        cells = _cells(self.plan, self.rank)
        mine = [i for i, t in enumerate(cells) if t.dst_rank == self.rank]
        received = self._figures[1].clone()
        sent_figures = self._figures[0].clone()
        if self.plan.world_size > 1:
            self._exchange(cells, sent_figures, group, torch.device(device), bound)
        differ = set(_bad(sent_figures, received))
        bad = [i for i in mine if i in differ]
        counts = torch.zeros(self.plan.world_size, dtype=torch.float64, device=device)
        counts[self.rank] = len(bad)
        if self.plan.world_size > 1:
            work = dist.all_reduce(counts, group=group, async_op=True)
            wait_all([(work, tuple(range(self.plan.world_size)))], bound,
                     "the weight sync's checksum comparison")
        counts = counts.cpu()
        if bad:
            t = cells[bad[0]]
            raise WeightSyncError(
                f"weight sync corrupted {len(bad)} of {len(mine)} slices written on rank {self.rank}; first: "
                f"{t.hf_name} slice {list(t.box)} sent by rank {t.src_rank} ({t.src_name}) and written on "
                f"rank {t.dst_rank} into {t.dst_name}: checksums (sum, weighted) "
                f"{sent_figures[bad[0]].tolist()} sent vs {received[bad[0]].tolist()} received"
            )
        if counts.sum() > 0:
            found = {r: int(n) for r, n in enumerate(counts.tolist()) if n}
            where = f"rank {next(iter(found))}" if len(found) == 1 else f"ranks {sorted(found)}"
            raise WeightSyncError(
                f"weight sync corrupted {sum(found.values())} slices written on {where} (its error names the "
                f"first; slices per rank: {found})"
            )
        return len(mine)

    def _exchange(self, cells: tuple[Transfer, ...], figures: torch.Tensor, group: Any, device: torch.device,
                  bound: Bound | None) -> None:
        """Send the source figures of remote cells to their receivers; write theirs into ``figures``."""
        out: dict[int, list[int]] = {}
        into: dict[int, list[int]] = {}
        for i, t in enumerate(cells):
            if t.src_rank == self.rank and t.dst_rank != self.rank:
                out.setdefault(t.dst_rank, []).append(i)
            elif t.dst_rank == self.rank and t.src_rank != self.rank:
                into.setdefault(t.src_rank, []).append(i)
        ops, peers, bufs = [], [], {}
        for peer in sorted(out):
            buf = figures[out[peer]].to(device).contiguous()
            ops.append(dist.P2POp(dist.isend, buf, global_rank(group, peer), group))
            peers.append(peer)
        for peer in sorted(into):
            bufs[peer] = torch.empty(len(into[peer]), 2, dtype=torch.float64, device=device)
            ops.append(dist.P2POp(dist.irecv, bufs[peer], global_rank(group, peer), group))
            peers.append(peer)
        exchange(ops, peers, bound, f"rank {self.rank}: the weight sync's checksum exchange")
        for peer, idx in into.items():
            figures[idx] = bufs[peer].cpu()


def _bad(src: torch.Tensor, dst: torch.Tensor) -> list[int]:
    """Indices of the cells whose ``(sum, weighted)`` figures differ beyond float64 rounding."""
    tol = 1e-9 * (src.abs() + dst.abs()) + 1e-12
    return ((src - dst).abs() > tol).any(dim=1).nonzero().flatten().tolist()


def _whole_cells(plan: ReshardPlan) -> tuple[Transfer, ...]:
    if plan.rank is not None:
        raise ValueError(f"verify_offline needs the whole plan, not rank {plan.rank}'s share")
    return tuple(t for group in (*plan.local, *plan.buckets) for t in group)


def _raise_on_mismatch(cells: Sequence[Transfer], figures: torch.Tensor) -> int:
    src, dst = figures[0], figures[1]
    bad = _bad(src, dst)
    if bad:
        t = cells[bad[0]]
        raise WeightSyncError(
            f"weight sync corrupted {len(bad)} of {len(cells)} slices; first: {t.hf_name} slice "
            f"{list(t.box)} sent by rank {t.src_rank} ({t.src_name}) and written on rank {t.dst_rank} into "
            f"{t.dst_name}: checksums (sum, weighted) {src[bad[0]].tolist()} sent vs {dst[bad[0]].tolist()} "
            "received"
        )
    return figures.shape[1]


def verify_offline(plan: ReshardPlan, src: Sequence[Mapping[str, torch.Tensor]],
                   dst: Sequence[Mapping[str, torch.Tensor]]) -> int:
    """Check per-rank destination tensors against per-rank source tensors in one process (the whole
    plan); returns the number of cells checked.

    Raises:
        WeightSyncError: A slice differs (names the tensor, the slice and both ranks).
        ValueError: ``plan`` is one rank's share.
    """
    cells = _whole_cells(plan)
    figures = torch.zeros(2, len(cells), 2, dtype=torch.float64)
    for i, t in enumerate(cells):
        sent = piece_view(src[t.src_rank][t.src_name], t.src_piece, t.box)
        received = piece_view(dst[t.dst_rank][t.dst_name], t.dst_piece, t.box)
        figures[0, i] = torch.tensor(box_checksum(sent, t.box))
        figures[1, i] = torch.tensor(box_checksum(received, t.box))
    return _raise_on_mismatch(cells, figures)
