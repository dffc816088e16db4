"""ReshardPlan: which source rank sends which slice of which tensor to which destination rank.

A pure function of (source layout, destination layout, element size, bucket size), cached, so it is
computed once per job and reused on every TRAIN->INFER switch.

[Note: plan cells]
For each HF tensor, the distinct source boxes (the pieces of one training replica) partition the full
tensor; replicas hold identical boxes. Every destination piece D is cut by those boxes into cells
``D & B``. A cell the destination rank already holds in the source layout is a local copy (no traffic);
any other cell is one :class:`Transfer` from a holder of ``B`` (the holder that has sent the fewest
bytes so far, ties to the nearest rank). So each rank receives exactly what it lacks: planned received
bytes equal the minimum. Transfers larger than a bucket are cut along their first axis, then packed
first-fit into buckets such that no rank sends plus receives more than ``bucket_nbytes`` in one bucket
(its temporary memory for that bucket), unless a single row is larger.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass

import torch

from hybridmem.reshard.layouts import ShardLayout
from hybridmem.reshard.spec import ModelSpec
from hybridmem.reshard.transforms import Box, Piece

__all__ = ["Transfer", "ReshardPlan", "build_plan", "cell_dtype", "DEFAULT_BUCKET_NBYTES"]

DEFAULT_BUCKET_NBYTES = 512 * 2**20


@dataclass(frozen=True, slots=True)
class Transfer:
    """One slice of one HF tensor moving between two ranks (or inside one, for a local copy)."""

    src_rank: int
    dst_rank: int
    hf_name: str
    box: Box
    """The slice, as ranges on the HF-full tensor's axes."""
    src_name: str
    src_piece: Piece
    dst_name: str
    dst_piece: Piece

    @property
    def numel(self) -> int:
        n = 1
        for a, b in self.box:
            n *= b - a
        return n


def _cell_itemsize(spec: ModelSpec, hf_name: str, itemsize: int) -> int:
    """Bytes per element of ``hf_name`` on a wire of ``itemsize`` bytes: 4 (fp32) for a tensor the spec
    keeps in fp32 when the wire is narrower, else ``itemsize`` (see [Note: wire dtype] in
    :mod:`hybridmem.reshard.execute`)."""
    return max(itemsize, 4) if spec.keeps_fp32(hf_name) else itemsize


def cell_dtype(plan: ReshardPlan, hf_name: str, wire_dtype: torch.dtype) -> torch.dtype:
    """The dtype a slice of ``hf_name`` travels in: ``wire_dtype`` (the plan's element size), or fp32
    where :meth:`ReshardPlan.cell_itemsize` widens it."""
    return torch.float32 if plan.cell_itemsize(hf_name) > wire_dtype.itemsize else wire_dtype


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def _numel(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


class ReshardPlan:
    """The transfers of one resharding, grouped in buckets; build with :func:`build_plan`.

    Attributes:
        src: Source (training) layout.
        dst: Destination (inference or HF) layout.
        itemsize: Bytes per element.
        bucket_nbytes: Largest send+receive bytes of one rank in one bucket.
        local: Per rank, the cells it copies from its own source tensors.
        buckets: Per bucket, the transfers between different ranks.
    """

    def __init__(self, src: ShardLayout, dst: ShardLayout, itemsize: int, bucket_nbytes: int,
                 local: tuple[tuple[Transfer, ...], ...], buckets: tuple[tuple[Transfer, ...], ...]):
        self.src, self.dst, self.itemsize, self.bucket_nbytes = src, dst, itemsize, bucket_nbytes
        self.local = local
        self.buckets = buckets
        world = src.world_size
        self._recv = [0] * world
        self._send = [0] * world
        self._peak = [0] * world
        for bucket in buckets:
            per = [0] * world
            for t in bucket:
                n = t.numel * self.cell_itemsize(t.hf_name)
                self._recv[t.dst_rank] += n
                self._send[t.src_rank] += n
                per[t.dst_rank] += n
                per[t.src_rank] += n
            self._peak = [max(a, b) for a, b in zip(self._peak, per)]
        self._min = [self._min_recv(r) for r in range(world)]

    @property
    def world_size(self) -> int:
        return self.src.world_size

    def cell_itemsize(self, hf_name: str) -> int:
        """Bytes per element of ``hf_name`` on the wire: ``itemsize``, or 4 for a tensor the spec keeps in
        fp32 when ``itemsize`` is smaller (see :func:`cell_dtype`)."""
        return _cell_itemsize(self.src.spec, hf_name, self.itemsize)

    def _min_recv(self, rank: int) -> int:
        # Elements the destination needs minus those it already holds in the source layout; computed
        # from the layouts alone (not from the transfers) so a test can compare the two.
        need = 0
        held_by_name: dict[str, list[Box]] = defaultdict(list)
        for local in self.src.tensors(rank).values():
            for p in local.pieces:
                held_by_name[p.hf_name].append(p.src)
        for local in self.dst.tensors(rank).values():
            for p in local.pieces:
                held = sum(_numel(i) for b in held_by_name.get(p.hf_name, ())
                           if (i := _intersect(p.src, b)) is not None)
                need += (p.numel - held) * self.cell_itemsize(p.hf_name)
        return need

    def min_recv_nbytes(self, rank: int) -> int:
        """The fewest bytes ``rank`` must receive: what its destination tensors need minus what it holds."""
        return self._min[rank]

    def recv_nbytes(self, rank: int) -> int:
        """Bytes the plan has ``rank`` receive."""
        return self._recv[rank]

    def send_nbytes(self, rank: int) -> int:
        """Bytes the plan has ``rank`` send."""
        return self._send[rank]

    def peak_temp_nbytes(self, rank: int) -> int:
        """Largest send+receive staging bytes of ``rank`` in one bucket."""
        return self._peak[rank]

    def dst_nbytes(self, rank: int) -> int:
        """Bytes of ``rank``'s destination tensors (padding included)."""
        return sum(t.numel * (self.cell_itemsize(t.pieces[0].hf_name) if t.pieces else self.itemsize)
                   for t in self.dst.tensors(rank).values())

    def __repr__(self) -> str:
        return (f"ReshardPlan({self.src.side.value} {self.src.parallel} -> {self.dst.side.value} "
                f"{self.dst.parallel}, world={self.world_size}, buckets={len(self.buckets)}, "
                f"recv={self._recv}, min={self._min})")


def _split_rows(t: Transfer, max_numel: int, scale: int) -> list[Transfer]:
    """Cut ``t`` along its first axis longer than 1 into transfers of at most ``max_numel`` wire elements
    (``scale`` wire elements per element of ``t``), rows kept whole."""
    if t.numel * scale <= max_numel:
        return [t]
    axis = next(i for i, (a, b) in enumerate(t.box) if b - a > 1)
    row = t.numel // (t.box[axis][1] - t.box[axis][0]) * scale
    step = max(1, max_numel // row)
    out = []
    lo, hi = t.box[axis]
    for s in range(lo, hi, step):
        box = list(t.box)
        box[axis] = (s, min(hi, s + step))
        out.append(Transfer(t.src_rank, t.dst_rank, t.hf_name, tuple(box), t.src_name, t.src_piece,
                            t.dst_name, t.dst_piece))
    return out


def _pack(transfers: list[tuple[Transfer, int]], world: int, max_numel: int) -> tuple[tuple[Transfer, ...], ...]:
    """First-fit ``(transfer, wire elements)`` into buckets of at most ``max_numel`` wire elements per rank."""
    buckets: list[list[Transfer]] = []
    load: list[list[int]] = []  # load[b][rank]: wire elements rank sends + receives in bucket b
    first_open = [0] * world  # buckets before this are full enough for rank to skip (speed only)
    for t, n in transfers:
        b = max(first_open[t.src_rank], first_open[t.dst_rank])
        while b < len(buckets) and (load[b][t.src_rank] + n > max_numel or load[b][t.dst_rank] + n > max_numel):
            b += 1
        if b == len(buckets):
            buckets.append([])
            load.append([0] * world)
        buckets[b].append(t)
        load[b][t.src_rank] += n
        load[b][t.dst_rank] += n
        for r in (t.src_rank, t.dst_rank):
            while first_open[r] < len(buckets) and load[first_open[r]][r] >= max_numel:
                first_open[r] += 1
    return tuple(tuple(b) for b in buckets)


@functools.lru_cache(maxsize=64)
def build_plan(src: ShardLayout, dst: ShardLayout, *, itemsize: int = 2,
               bucket_nbytes: int = DEFAULT_BUCKET_NBYTES) -> ReshardPlan:
    """Plan moving every tensor from ``src`` to ``dst`` (pure; cached on its arguments).

    Raises:
        ValueError: The layouts are of different models or world sizes, or ``bucket_nbytes`` < itemsize.
        RuntimeError: The source layout does not cover an HF tensor exactly once per replica (a bug
            in a layout table; the message names the tensor).
    """
    if src.spec != dst.spec:
        raise ValueError(f"source and destination specs differ: {src.spec} vs {dst.spec}")
    if src.world_size != dst.world_size:
        raise ValueError(f"source world_size={src.world_size} != destination world_size={dst.world_size}")
    if bucket_nbytes < itemsize:
        raise ValueError(f"bucket_nbytes={bucket_nbytes} is smaller than one element ({itemsize} bytes)")
    world = src.world_size
    shapes = src.spec.full_shapes()
    # Distinct source boxes per HF tensor, each with its holders.
    holders: dict[str, dict[Box, list[tuple[int, str, Piece]]]] = defaultdict(lambda: defaultdict(list))
    for r in range(world):
        for name, local in src.tensors(r).items():
            for p in local.pieces:
                holders[p.hf_name][p.src].append((r, name, p))
    for hf, boxes in holders.items():
        distinct = list(boxes)
        total = sum(_numel(b) for b in distinct)
        overlap = any(_intersect(a, b) for i, a in enumerate(distinct) for b in distinct[i + 1:])
        if overlap or total != _numel(tuple((0, s) for s in shapes[hf])):
            raise RuntimeError(f"source layout does not partition {hf} {shapes[hf]} into disjoint boxes")
    # The first holder of each box on each rank: a local copy needs no sender.
    held_here = {hf: {box: {r: o for o in reversed(owners) for r in (o[0],)} for box, owners in boxes.items()}
                 for hf, boxes in holders.items()}
    sent = [0] * world
    local: list[list[Transfer]] = [[] for _ in range(world)]
    remote: list[Transfer] = []
    for d in range(world):
        for dname, dlocal in dst.tensors(d).items():
            for dp in dlocal.pieces:
                here = held_here[dp.hf_name]
                for box, owners in holders[dp.hf_name].items():
                    cell = _intersect(dp.src, box)
                    if cell is None:
                        continue
                    mine = here[box].get(d)
                    if mine is not None:
                        _, sname, sp = mine
                        local[d].append(Transfer(d, d, dp.hf_name, cell, sname, sp, dname, dp))
                        continue
                    s, sname, sp = min(owners, key=lambda o: (sent[o[0]], abs(o[0] - d), o[0]))
                    sent[s] += _numel(cell)
                    remote.append(Transfer(s, d, dp.hf_name, cell, sname, sp, dname, dp))
    max_numel = max(1, bucket_nbytes // itemsize)

    def scale(t: Transfer) -> int:  # wire elements per element (2 for an fp32 tensor on a 2-byte wire)
        return _cell_itemsize(src.spec, t.hf_name, itemsize) // itemsize

    pieces = [(piece, piece.numel * scale(t)) for t in remote for piece in _split_rows(t, max_numel, scale(t))]
    return ReshardPlan(src, dst, itemsize, bucket_nbytes, tuple(tuple(x) for x in local),
                       _pack(pieces, world, max_numel))
