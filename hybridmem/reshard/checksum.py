"""Runtime check of a weight sync: per-cell checksums compared between sender and receiver.

Every cell of a plan (a local copy or a transfer, see [Note: plan cells]) gets two float64 figures,
computed once from the source tensor by the rank that sends it and once from the destination tensor by
the rank that received it: the plain sum and a position-weighted sum ``u(row) @ X @ v(col)`` whose
weights depend on the cell's position in the HF-full tensor, so swapped rows or columns (a wrong
interleave) change it. The figures are summed over ranks with one ``all_reduce`` and compared; a
mismatch raises :class:`~hybridmem.errors.WeightSyncError` naming the tensor, the slice, and both ranks.
Cost: one extra read of the weights in float64 chunks (bounded by ``_CHUNK_NUMEL``) and an all_reduce
of ``4 * num_cells`` doubles.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hybridmem.errors import WeightSyncError
from hybridmem.reshard.plan import ReshardPlan, Transfer, cell_dtype
from hybridmem.reshard.deadline import Bound, wait_all
from hybridmem.reshard.transforms import Box, piece_view

__all__ = ["box_checksum", "CellChecksums", "verify_offline"]

_CHUNK_NUMEL = 1 << 22


def _weights(lo: int, hi: int, period: int, device: torch.device) -> torch.Tensor:
    idx = torch.arange(lo, hi, dtype=torch.float64, device=device)
    return 1.0 + torch.remainder(idx, period) / period


def box_checksum(x: torch.Tensor, box: Box) -> tuple[float, float]:
    """``(sum, weighted sum)`` of ``x``, the slice ``box`` of an HF-full tensor (1-D or 2-D box)."""
    x = x.reshape(tuple(b - a for a, b in box))
    if x.dim() == 1:
        x64 = x.to(torch.float64)
        return float(x64.sum()), float(x64 @ _weights(box[0][0], box[0][1], 61, x.device))
    if x.dim() != 2:
        raise ValueError(f"box_checksum supports 1-D and 2-D boxes, got {box}")
    (r0, r1), (c0, c1) = box
    v = _weights(c0, c1, 53, x.device)
    total = weighted = 0.0
    step = max(1, _CHUNK_NUMEL // max(1, c1 - c0))
    for s in range(0, r1 - r0, step):
        part = x[s:s + step].to(torch.float64)
        total += float(part.sum())
        weighted += float(_weights(r0 + s, r0 + s + part.shape[0], 61, x.device) @ part @ v)
    return total, weighted


@functools.lru_cache(maxsize=16)
def _cells(plan: ReshardPlan) -> tuple[Transfer, ...]:
    return tuple(t for group in (*plan.local, *plan.buckets) for t in group)


class CellChecksums:
    """This rank's share of the figures of every cell of ``plan``.

    Fill the source side with :meth:`add_source`, the destination side with :meth:`add_destination`
    (all at once, or tensor by tensor as a stream yields them), then call :meth:`compare` on every rank.
    """

    def __init__(self, plan: ReshardPlan, rank: int):
        self.plan, self.rank = plan, rank
        cells = _cells(plan)
        self._figures = torch.zeros(2, len(cells), 2, dtype=torch.float64)
        self._src = [i for i, t in enumerate(cells) if t.src_rank == rank]
        self._dst_by_name: dict[str, list[int]] = {}
        for i, t in enumerate(cells):
            if t.dst_rank == rank:
                self._dst_by_name.setdefault(t.dst_name, []).append(i)

    def add_source(self, src: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> None:
        """Figures of the cells this rank sends (or copies locally), from its source tensors as cast to
        the wire ``dtype`` (see [Note: wire dtype] in :mod:`hybridmem.reshard.execute`)."""
        cells = _cells(self.plan)
        for i in self._src:
            t = cells[i]
            piece = piece_view(src[t.src_name], t.src_piece, t.box)
            if dtype is not None:
                piece = piece.to(cell_dtype(self.plan, t.hf_name, dtype))
            self._figures[0, i] = torch.tensor(box_checksum(piece, t.box))

    def add_destination(self, name: str, tensor: torch.Tensor) -> None:
        """Figures of the cells of destination tensor ``name`` (as the engine holds it now)."""
        cells = _cells(self.plan)
        for i in self._dst_by_name.get(name, ()):
            t = cells[i]
            self._figures[1, i] = torch.tensor(box_checksum(piece_view(tensor, t.dst_piece, t.box), t.box))

    def add_destinations(self, dst: Mapping[str, torch.Tensor]) -> None:
        """:meth:`add_destination` for every destination tensor of this rank."""
        for name in self._dst_by_name:
            self.add_destination(name, dst[name])

    def compare(self, group: Any = None, *, device: torch.device | str = "cpu", bound: Bound | None = None) -> int:
        """Sum the figures over ``group`` and compare; returns the number of cells checked.

        Raises:
            WeightSyncError: A cell's figures differ (names tensor, slice, source and destination rank).
            CollectiveTimeoutError: The sum did not complete within ``bound`` (see [Note: collective
                deadlines] in :mod:`hybridmem.reshard.execute`).
        """
        figures = self._figures.to(device)
        if self.plan.world_size > 1:
            work = dist.all_reduce(figures, group=group, async_op=True)
            wait_all([(work, tuple(range(self.plan.world_size)))], bound, "the weight sync's checksum comparison")
        return _raise_on_mismatch(self.plan, figures.cpu())


def _raise_on_mismatch(plan: ReshardPlan, figures: torch.Tensor) -> int:
    src, dst = figures[0], figures[1]
    tol = 1e-9 * (src.abs() + dst.abs()) + 1e-12
    bad = ((src - dst).abs() > tol).any(dim=1).nonzero().flatten().tolist()
    if bad:
        cells = _cells(plan)
        t = cells[bad[0]]
        raise WeightSyncError(
            f"weight sync corrupted {len(bad)} of {len(cells)} slices; first: {t.hf_name} slice {list(t.box)} "
            f"sent by rank {t.src_rank} ({t.src_name}) and written on rank {t.dst_rank} into {t.dst_name}: "
            f"checksums (sum, weighted) {src[bad[0]].tolist()} sent vs {dst[bad[0]].tolist()} received"
        )
    return figures.shape[1]


def verify_offline(plan: ReshardPlan, src: Sequence[Mapping[str, torch.Tensor]],
                   dst: Sequence[Mapping[str, torch.Tensor]]) -> int:
    """Check per-rank destination tensors against per-rank source tensors in one process.

    Raises:
        WeightSyncError: A slice differs (see :meth:`CellChecksums.compare`).
    """
    total = torch.zeros(2, len(_cells(plan)), 2, dtype=torch.float64)
    for rank in range(plan.world_size):
        sums = CellChecksums(plan, rank)
        sums.add_source(src[rank])
        sums.add_destinations(dst[rank])
        total += sums._figures
    return _raise_on_mismatch(plan, total)
