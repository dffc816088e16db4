"""ReshardPlan: which source rank sends which slice of which tensor to which destination rank.

A pure function of (source layout, destination layout, element size, bucket size), cached, so it is
computed once per job and reused on every TRAIN->INFER switch.

[Note: plan cells]
For each HF tensor, the distinct source boxes (the pieces of one training replica) partition the full
tensor; replicas hold identical boxes. Every destination piece D is cut by those boxes into cells
``D & B``. A cell the destination rank already holds in the source layout is a local copy (no traffic);
any other cell is one :class:`Transfer` from a holder of ``B``: the ranks wanting a piece of ``B`` that do
not hold it (its consumers), ascending, are split into equal contiguous runs, one per holder in
ascending order, so every holder serves as many consumers (within one) and neighbours pair up. So each
rank receives exactly what it lacks: planned received
bytes equal the minimum. The transfers then run in steps both ends compute alone (see [Note: plan
schedule] in :mod:`hybridmem.reshard.schedule`), in which no rank sends plus receives more than
``bucket_nbytes`` (its temporary memory for that step), unless a single row is larger than half of it.

Both rules depend only on who holds and who wants each box, so ``build_plan(src, dst, rank=r)``
computes rank r's share alone, from the layouts' rank groups (:mod:`hybridmem.reshard.holders`), equal
to rank r's part of the whole plan (tests/reshard/test_rank_plan.py).

[Note: quantized cells]
A plan into an FP8 engine (``quantized``: the checkpoint weights vLLM holds in e4m3 with 128x128 block
scales, [Note: fp8 block layout] in :mod:`hybridmem.reshard.fp8`) is a plan into the engine's unquantized
layout whose cells of those weights travel quantized wherever they can: a cell that is whole blocks of its
weight (:func:`~hybridmem.reshard.fp8.whole_blocks`; every block of it lies in it) is quantized by its
sender, and its e4m3 values (one byte an element) and float32 block scales (four bytes a block) are what
moves (:meth:`ReshardPlan.quantizes`, :meth:`ReshardPlan.cell_nbytes`); a block depends on its own elements
alone, so those are the blocks of the quantized whole. A cell cut inside a block (a training shard boundary
inside one, e.g. Megatron's 64-row k heads) travels in the wire dtype, and the receiver quantizes the blocks
it touches once they are complete: they hold no element of a quantized cell, since a quantized cell is made
of whole blocks. Sender and receiver decide from the cell alone, so they agree without a word. The
buckets are sized by the wire dtype (a quantized cell takes less); the byte figures count what moves.
"""

from __future__ import annotations

import bisect
import functools
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from hybridmem.reshard.fp8 import scale_box, whole_blocks
from hybridmem.reshard.holders import holders_of, sender_of, served_by
from hybridmem.reshard.layouts import ShardLayout
from hybridmem.reshard.schedule import StepKey, model_offsets, schedule, transfer_key
from hybridmem.reshard.spec import ModelSpec
from hybridmem.reshard.transforms import Box, Piece, box_intersection, box_numel

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
        return box_numel(self.box)


def cell_dtype(plan: ReshardPlan, hf_name: str, wire_dtype: torch.dtype) -> torch.dtype:
    """The dtype a slice of ``hf_name`` travels in: ``wire_dtype`` (the plan's element size), or fp32
    where :meth:`ReshardPlan.cell_itemsize` widens it."""
    return torch.float32 if plan.cell_itemsize(hf_name) > wire_dtype.itemsize else wire_dtype


class ReshardPlan:
    """The transfers of one resharding, grouped in steps; build with :func:`build_plan`.

    The whole plan (``rank`` is ``None``) or one rank's share of it (the transfers that rank sends,
    receives or copies; its figures only).

    Attributes:
        src: Source (training) layout.
        dst: Destination (inference or HF) layout.
        itemsize: Bytes per element.
        bucket_nbytes: Largest send+receive bytes of one rank in one step.
        rank: The rank whose share this is, or ``None`` for the whole plan.
        local: Per rank, the cells it copies from its own source tensors (a tuple over all ranks for
            the whole plan; ``{rank: cells}`` for a share).
        buckets: Per step, the transfers between different ranks (a share: those of its rank).
        keys: Per step, its ``(window, shift, chunk)`` key ([Note: plan schedule] in
            :mod:`hybridmem.reshard.schedule`).
        quantized: The HF weights whose cells travel FP8-quantized where they are whole blocks ([Note:
            quantized cells]); empty: none.
    """

    def __init__(self, src: ShardLayout, dst: ShardLayout, itemsize: int, bucket_nbytes: int,
                 local: tuple[tuple[Transfer, ...], ...] | Mapping[int, tuple[Transfer, ...]],
                 buckets: tuple[tuple[Transfer, ...], ...], *, keys: tuple[StepKey, ...] = (),
                 rank: int | None = None, quantized: frozenset[str] = frozenset()):
        self.src, self.dst, self.itemsize, self.bucket_nbytes = src, dst, itemsize, bucket_nbytes
        self.rank = rank
        self.quantized = quantized
        self._shapes = src.spec.full_shapes() if quantized else {}
        self.local = local
        self.buckets = buckets
        self.keys = keys
        ranks = range(src.world_size) if rank is None else (rank,)
        self._recv = dict.fromkeys(ranks, 0)
        self._send = dict.fromkeys(ranks, 0)
        self._peak = dict.fromkeys(ranks, 0)
        for bucket in buckets:
            per: dict[int, int] = {}
            for t in bucket:
                n = self.cell_nbytes(t)
                for r, mine in ((t.dst_rank, self._recv), (t.src_rank, self._send)):
                    if r in mine:
                        mine[r] += n
                        per[r] = per.get(r, 0) + n
            for r, n in per.items():
                self._peak[r] = max(self._peak[r], n)
        self._min = {r: self._min_recv(r) for r in ranks}

    @property
    def world_size(self) -> int:
        return self.src.world_size

    def cell_itemsize(self, hf_name: str) -> int:
        """Bytes per element of ``hf_name`` on the wire: ``itemsize``, or 4 for a tensor the spec keeps in
        fp32 when ``itemsize`` is smaller (see :func:`cell_dtype`)."""
        return self.src.spec.wire_itemsize(hf_name, self.itemsize)

    def quantizes(self, t: Transfer) -> bool:
        """Whether cell ``t`` travels as e4m3 values and block scales ([Note: quantized cells])."""
        return t.hf_name in self.quantized and whole_blocks(t.box, self._shapes[t.hf_name])

    def cell_nbytes(self, t: Transfer) -> int:
        """Bytes cell ``t`` moves: its elements in the wire dtype, or, quantized, one byte an element and four
        a block scale."""
        if self.quantizes(t):
            return t.numel + 4 * box_numel(scale_box(t.box))
        return t.numel * self.cell_itemsize(t.hf_name)

    def _mine(self, rank: int) -> int:
        if self.rank is not None and rank != self.rank:
            raise ValueError(f"this plan is rank {self.rank}'s share; build_plan(..., rank={rank}) gives "
                             f"rank {rank}'s")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} outside world_size={self.world_size}")
        return rank

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
                held = [i for b in held_by_name.get(p.hf_name, ())
                        if (i := box_intersection(p.src, b)) is not None]
                missing = p.numel - sum(box_numel(i) for i in held)
                if p.hf_name in self.quantized and missing:  # a byte an element, four a block not held whole
                    blocks = box_numel(scale_box(p.src)) - sum(
                        box_numel(scale_box(i)) for i in held if whole_blocks(i, self._shapes[p.hf_name]))
                    need += missing + 4 * blocks
                else:
                    need += missing * self.cell_itemsize(p.hf_name)
        return need

    def min_recv_nbytes(self, rank: int) -> int:
        """The fewest bytes ``rank`` must receive: what its destination tensors need minus what it holds."""
        return self._min[self._mine(rank)]

    def recv_nbytes(self, rank: int) -> int:
        """Bytes the plan has ``rank`` receive."""
        return self._recv[self._mine(rank)]

    def send_nbytes(self, rank: int) -> int:
        """Bytes the plan has ``rank`` send."""
        return self._send[self._mine(rank)]

    def peak_temp_nbytes(self, rank: int) -> int:
        """Largest send+receive staging bytes of ``rank`` in one step."""
        return self._peak[self._mine(rank)]

    def dst_nbytes(self, rank: int) -> int:
        """Bytes of ``rank``'s destination tensors (padding included)."""
        return sum(t.numel * (self.cell_itemsize(t.pieces[0].hf_name) if t.pieces else self.itemsize)
                   for t in self.dst.tensors(self._mine(rank)).values())

    def __repr__(self) -> str:
        who = "" if self.rank is None else f"rank {self.rank}'s share, "
        return (f"ReshardPlan({who}{self.src.side.value} {self.src.parallel} -> {self.dst.side.value} "
                f"{self.dst.parallel}, world={self.world_size}, steps={len(self.buckets)}, "
                f"recv={list(self._recv.values())}, min={list(self._min.values())})")


def _check(src: ShardLayout, dst: ShardLayout, itemsize: int, bucket_nbytes: int, rank: int | None) -> None:
    if src.spec != dst.spec:
        raise ValueError(f"source and destination specs differ: {src.spec} vs {dst.spec}")
    if dst.side is not src.side and getattr(dst.convention, "weight_block_size", None) is not None:
        raise ValueError(f"destination weight_block_size={list(dst.convention.weight_block_size)}: a plan "
                         "moves slices of the training tensors, and an FP8 block is quantized whole; sync "
                         "into an FP8 engine from full tensors (ReshardSync does into an engine that reports "
                         "FP8; or hybridmem.reshard.fp8.quantize_stream into iter_shard)")
    if src.world_size != dst.world_size:
        raise ValueError(f"source world_size={src.world_size} != destination world_size={dst.world_size}")
    if bucket_nbytes < itemsize:
        raise ValueError(f"bucket_nbytes={bucket_nbytes} is smaller than one element ({itemsize} bytes)")
    if rank is not None and not 0 <= rank < src.world_size:
        raise ValueError(f"rank={rank} outside world_size={src.world_size}")


def _check_partition(hf: str, boxes: Iterable[Box], shape: tuple[int, ...]) -> None:
    distinct = list(boxes)
    total = sum(box_numel(b) for b in distinct)
    overlap = any(box_intersection(a, b) for i, a in enumerate(distinct) for b in distinct[i + 1:])
    if overlap or total != box_numel(tuple((0, s) for s in shape)):
        raise RuntimeError(f"source layout does not partition {hf} {shape} into disjoint boxes")


def _sorted_local(cells: list[Transfer], spec: ModelSpec, itemsize: int) -> tuple[Transfer, ...]:
    offsets = model_offsets(spec, itemsize)
    return tuple(sorted(cells, key=lambda t: transfer_key(t, offsets)))


@functools.lru_cache(maxsize=64)
def build_plan(src: ShardLayout, dst: ShardLayout, *, itemsize: int = 2,
               bucket_nbytes: int = DEFAULT_BUCKET_NBYTES, rank: int | None = None,
               quantized: frozenset[str] = frozenset()) -> ReshardPlan:
    """Plan moving every tensor from ``src`` to ``dst`` (pure; cached on its arguments).

    Args:
        src: The source layout (:func:`~hybridmem.reshard.layouts.megatron_layout`, an HF source layout).
        dst: The destination layout (:func:`~hybridmem.reshard.layouts.vllm_layout`, ``hf_layout``).
        itemsize: Bytes per element on the wire.
        bucket_nbytes: Largest send+receive bytes of one rank in one step.
        rank: Build only this rank's share (what it sends, receives and copies), without the rest of
            the plan: what each rank of a job needs, at a cost that grows with what the rank moves
            rather than with the cluster. ``None``: the whole plan (every rank's figures; costs the
            whole cluster's transfers).
        quantized: HF weights of ``dst`` an FP8 engine holds in e4m3 with block scales, whose cells move
            quantized where they are whole blocks ([Note: quantized cells]).

    Raises:
        ValueError: The layouts are of different models or world sizes, ``bucket_nbytes`` < itemsize,
            or ``rank`` is outside the world.
        RuntimeError: The source layout does not cover an HF tensor exactly once per replica (a bug
            in a layout table; the message names the tensor).
    """
    _check(src, dst, itemsize, bucket_nbytes, rank)
    unknown = quantized - src.spec.full_shapes().keys()
    if unknown:  # before any planning
        raise ValueError(f"quantized names {sorted(unknown)[:3]} are not tensors of the model")
    if rank is None:
        local, remote = _whole(src, dst)
    else:
        local, remote = _share(src, dst, rank)
    keys, buckets = schedule(remote, src.spec, src.world_size, itemsize, bucket_nbytes, quantized)
    if rank is None:
        cells = tuple(_sorted_local(cs, src.spec, itemsize) for cs in local)
    else:
        cells = {rank: _sorted_local(local[0], src.spec, itemsize)}
    return ReshardPlan(src, dst, itemsize, bucket_nbytes, cells, buckets, keys=keys, rank=rank,
                       quantized=frozenset(quantized))


def _whole(src: ShardLayout, dst: ShardLayout) -> tuple[list[list[Transfer]], list[Transfer]]:
    """Every rank's cells, from every rank's tensors (the reference the per-rank shares must equal)."""
    world = src.world_size
    shapes = src.spec.full_shapes()
    # Distinct source boxes per HF tensor, each with its holders in rank order.
    holders: dict[str, dict[Box, list[tuple[int, str, Piece]]]] = defaultdict(lambda: defaultdict(list))
    for r in range(world):
        for name, local in src.tensors(r).items():
            for p in local.pieces:
                holders[p.hf_name][p.src].append((r, name, p))
    for hf, boxes in holders.items():
        _check_partition(hf, boxes, shapes[hf])
    # The first holding of each box on each rank, the holders ascending, and the consumers: the ranks
    # wanting a piece that meets the box, ascending, holders excluded.
    first = {hf: {box: {r: (r, n, p) for r, n, p in reversed(owners)} for box, owners in boxes.items()}
             for hf, boxes in holders.items()}
    ranks = {hf: {box: tuple(sorted(by_rank)) for box, by_rank in boxes.items()}
             for hf, boxes in first.items()}
    wanted: dict[str, list[tuple[int, Box]]] = defaultdict(list)
    for d in range(world):
        for dlocal in dst.tensors(d).values():
            for dp in dlocal.pieces:
                wanted[dp.hf_name].append((d, dp.src))
    consumers = {hf: {box: tuple(sorted({d for d, want in wanted[hf]
                                         if box_intersection(want, box)} - set(by_rank)))
                      for box, by_rank in boxes.items()} for hf, boxes in first.items()}
    local: list[list[Transfer]] = [[] for _ in range(world)]
    remote: list[Transfer] = []
    for d in range(world):
        for dname, dlocal in dst.tensors(d).items():
            for dp in dlocal.pieces:
                for box, by_rank in first[dp.hf_name].items():
                    cell = box_intersection(dp.src, box)
                    if cell is None:
                        continue
                    if d in by_rank:
                        _, sname, sp = by_rank[d]
                        local[d].append(Transfer(d, d, dp.hf_name, cell, sname, sp, dname, dp))
                        continue
                    s = sender_of(ranks[dp.hf_name][box], consumers[dp.hf_name][box], d)
                    _, sname, sp = by_rank[s]
                    remote.append(Transfer(s, d, dp.hf_name, cell, sname, sp, dname, dp))
    return local, remote


def _share(src: ShardLayout, dst: ShardLayout, rank: int) -> tuple[list[list[Transfer]], list[Transfer]]:
    """Rank ``rank``'s cells only: its receives (from the holders of what it lacks), its local copies, and
    the cells it sends (to the ranks between it and the next holder of each box it holds)."""
    have, want = holders_of(src), holders_of(dst)
    shapes = src.spec.full_shapes()
    local: list[Transfer] = []
    remote: list[Transfer] = []
    checked: set[str] = set()
    for dname, dlocal in dst.tensors(rank).items():
        for dp in dlocal.pieces:
            boxes = have.boxes(dp.hf_name)
            if dp.hf_name not in checked:
                _check_partition(dp.hf_name, boxes, shapes[dp.hf_name])
                checked.add(dp.hf_name)
            for box, holders in boxes.items():
                cell = box_intersection(dp.src, box)
                if cell is None:
                    continue
                s = rank if rank in holders else sender_of(holders.ranks,
                                                           want.wanting(dp.hf_name, box, holders.ranks),
                                                             rank)
                held = holders.held_by(s)
                t = Transfer(s, rank, dp.hf_name, cell, held.name, held.piece, dname, dp)
                (local if s == rank else remote).append(t)
    for sname, slocal in src.tensors(rank).items():
        for sp in slocal.pieces:
            holders = have.boxes(sp.hf_name)[sp.src]
            held = holders.held_by(rank)
            if (held.name, held.piece) != (sname, sp):
                continue  # a second copy on this rank: cells go from the first
            mine = served_by(holders.ranks, want.wanting(sp.hf_name, sp.src, holders.ranks), rank)
            if not mine:
                continue
            for there in want.holdings(sp.hf_name):
                cell = box_intersection(there.piece.src, sp.src)
                if cell is None:
                    continue
                for d in mine:
                    i = bisect.bisect_left(there.ranks, d)
                    if i < len(there.ranks) and there.ranks[i] == d:
                        remote.append(Transfer(rank, d, sp.hf_name, cell, sname, sp, there.name, there.piece))
    return [local], remote
