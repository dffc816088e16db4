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
float64 chunks (bounded by ``_CHUNK_NUMEL``), ``2`` doubles per cell sent, and ``world`` doubles summed.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hybridmem.errors import WeightSyncError
from hybridmem.reshard.deadline import Bound, exchange, global_rank, wait_all
from hybridmem.reshard.plan import ReshardPlan, Transfer, cell_dtype
from hybridmem.reshard.transforms import Box, piece_view

__all__ = ["box_checksum", "CellChecksums", "tensor_checksum", "verify_offline"]

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
        the wire ``dtype`` (see [Note: wire dtype] in :mod:`hybridmem.reshard.execute`)."""
        cells = _cells(self.plan, self.rank)
        for i in self._src:
            t = cells[i]
            piece = piece_view(src[t.src_name], t.src_piece, t.box)
            if dtype is not None:
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


def tensor_checksum(t: torch.Tensor) -> tuple[float, float]:
    """``(sum, weighted sum)`` in float64 of the whole of ``t``, on its own device: :func:`box_checksum` of
    ``t`` viewed as ``(numel // last dim, last dim)``, a 0-D or 1-D ``t`` as the 1-D box ``((0, numel),)``."""
    t = t.detach()
    if t.dim() <= 1:
        return box_checksum(t.reshape(-1), ((0, t.numel()),))
    cols = t.shape[-1]
    rows = t.numel() // cols if cols else 0
    return box_checksum(t.reshape(rows, cols), ((0, rows), (0, cols)))
