"""Run a :class:`~hybridmem.reshard.plan.ReshardPlan` over a ``torch.distributed`` process group.

Every rank calls :func:`run_plan` (or iterates :func:`iter_layout_tensors` to the end) with the same plan,
in the same order relative to other collectives on ``group``. Per bucket, each rank packs what it sends
to each peer into one flat buffer, posts one ``isend`` per peer and one ``irecv`` per peer through
``dist.batch_isend_irecv`` (gloo on CPU, NCCL on GPU, HCCL on NPU), waits, then copies the received
slices into the destination tensors. The staging buffers of a bucket are dropped before the next one,
so temporary memory is bounded by the plan's ``peak_temp_nbytes``. On an accelerator with streams the
work runs on a side stream that first waits for the current one; the current stream waits for it at
the end, so the results are ready for whatever is queued next.

[Note: wire dtype]
A receiver sizes its staging buffer from the plan in elements of the wire dtype, so every rank must
use the same one: sources of another dtype (Megatron keeps some norms in fp32 beside bf16 weights)
are cast to it when packed, and received slices are cast to each destination tensor's dtype when
unpacked. ``hybridmem.weight_sync.ReshardSync`` passes its ``dtype`` on every rank; by default the dtype
holding most of the training weights' bytes, which is the same on every rank of a real model (see [Note: no
silent dtype change] in :mod:`hybridmem.weight_sync.base`).

[Note: collective deadlines]
A rank that dies or hangs mid-sync would leave every peer waiting in its ``batch_isend_irecv`` until the
process group's own timeout (30 minutes by default). So every wait here is bounded by the sync's
``deadline_s`` (counted from the call; ``None``: unbounded): each wait gets what is left of it
(``Work.wait(timeout)``, which gloo honours), and a wait that times out, or fails because a peer's
connection closed, raises :class:`~hybridmem.errors.CollectiveTimeoutError` naming the bucket and the
peers it still waited for. The switch then rolls this rank back as for any failed step. The group is
not usable afterwards (gloo closes a pair whose operation timed out) and the error says so.

The one exception is a tensor the spec keeps in fp32 (``ModelSpec.keeps_fp32``: DeepSeek-V3's router
bias): on a narrower wire its slices travel in fp32, in a second buffer per peer, and local copies of
it are not cast; every rank knows which cells those are from the plan (``plan.cell_dtype``).

[Note: layout streams]
:func:`iter_layout_tensors` yields each destination tensor complete, once, and keeps none: a tensor is
allocated when first touched (zeroed where its layout has padding elements, vocab padding rows), its
local cells (what this rank holds in the source layout) are copied into it then, and it is yielded and
dropped as soon as its data elements (the sum of its pieces, as ``run_plan``'s coverage counts them) are
all written. Tensors made of local cells alone come first, one at a time in destination order (with one
rank, every tensor); each of the others is touched first by the plan bucket that first brings it a cell
and completed by the last one. So at most the largest local tensor, or the tensors open across one
bucket, are alive at once (:func:`stream_peak_nbytes`), never a copy of the whole model. The buckets,
and so the collectives, are those of :func:`run_plan`, in the same order on every rank. A caller may give
the memory a tensor of local cells alone is built in (``target``: e.g. the part of a transfer bucket it
is to be sent from), which saves the copy into it; such a tensor is yielded right after it is built, so
the caller's memory holds it only until the caller's next request. A caller that only reads what it is
given may also take a tensor that is one local cell, whole, in its own dtype and order, as the source
tensor itself (``borrow``): nothing is allocated or copied for it.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridmem.accel import get_accelerator
from hybridmem.reshard.conventions import Side
from hybridmem.reshard.deadline import (
    Bound,
    deadline_bound,
    exchange,
    global_rank,
    wait_all,
)
from hybridmem.reshard.fp8 import FP8_DTYPE, quantize_block_fp8, scale_box
from hybridmem.reshard.plan import ReshardPlan, Transfer, cell_dtype
from hybridmem.reshard.spec import ModelSpec
from hybridmem.reshard.transforms import box_numel, piece_view

__all__ = ["run_plan", "iter_layout_tensors", "iter_full_tensors", "stream_peak_nbytes", "TransferStats",
           "held_dtype"]


@dataclass(frozen=True, slots=True)
class TransferStats:
    """What one run of a plan moved on this rank."""

    num_tensors: int = 0
    """Destination tensors written (or yielded)."""
    sent_nbytes: int = 0
    """Bytes this rank sent to other ranks."""
    received_nbytes: int = 0
    """Bytes this rank received from other ranks or copied locally."""
    min_received_nbytes: int = 0
    """The fewest bytes this rank could have received (what it did not already hold)."""
    temp_peak_nbytes: int = 0
    """Peak staging bytes of one bucket."""
    seconds: float = 0.0


def _box_shape(t: Transfer) -> tuple[int, ...]:
    return tuple(b - a for a, b in t.box)


def _warm_group(plan: ReshardPlan, group: Any, device: torch.device, deadline: Bound | None) -> None:
    """Initialise the communicator with one collective before the first p2p batch.

    NCCL requires every rank of a group to take part in ``batch_isend_irecv`` when it is the first
    collective on that group; ranks with nothing to move in a step skip the call, so a tiny all_reduce
    comes first, on every rank whatever its share of the plan holds (gloo has no such rule).
    """
    if plan.world_size > 1 and dist.get_backend(group) != "gloo":
        work = dist.all_reduce(torch.zeros(1, device=device), group=group, async_op=True)
        wait_all([(work, tuple(range(plan.world_size)))], deadline, "the resharding group's first collective")


def _check_sources(plan: ReshardPlan, rank: int, src: Mapping[str, torch.Tensor],
                   dtype: torch.dtype | None) -> tuple[torch.dtype, torch.device]:
    expected = plan.src.tensors(rank)
    missing = [n for n in expected if n not in src]
    if missing:
        raise ValueError(f"rank {rank}: source tensors lack {missing[:5]} "
                         f"({len(missing)} of {len(expected)})")
    for name, local in expected.items():
        if tuple(src[name].shape) != local.shape:
            raise ValueError(
                f"rank {rank}: source {name} has shape {tuple(src[name].shape)}, the {plan.src.side.value} "
                f"layout {plan.src.parallel} expects {local.shape}"
            )
    first = next(iter(src.values()))
    dtype = first.dtype if dtype is None else dtype
    itemsize = dtype.itemsize
    if itemsize != plan.itemsize:
        raise ValueError(f"rank {rank}: wire dtype {dtype} has {itemsize} bytes per element, plan has "
                         f"{plan.itemsize}")
    return dtype, first.device


Arrival = tuple[Transfer, tuple[torch.Tensor, ...]]
"""A received cell and its parts ([Note: quantized cells] in :mod:`hybridmem.reshard.plan`): its values
shaped like its box in its wire dtype; or, quantized, its e4m3 values shaped like its box and its float32
block scales shaped like their box."""


def _parts(plan: ReshardPlan, t: Transfer, dtype: torch.dtype) -> tuple[tuple[torch.dtype, int], ...]:
    """``(dtype on the wire, elements)`` of each part cell ``t`` travels in."""
    if plan.quantizes(t):
        return (torch.uint8, t.numel), (torch.float32, box_numel(scale_box(t.box)))
    return ((cell_dtype(plan, t.hf_name, dtype), t.numel),)


def pack_cell(plan: ReshardPlan, t: Transfer, src: Mapping[str, torch.Tensor],
              dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The parts of cell ``t`` as its sender makes them from its source tensors (shaped as :data:`Arrival`
    says): cast to the cell's wire dtype, and, where the plan quantizes it, quantized from that cast."""
    piece = piece_view(src[t.src_name], t.src_piece, t.box).to(cell_dtype(plan, t.hf_name, dtype))
    if not plan.quantizes(t):
        return (piece,)
    values, scales = quantize_block_fp8(piece.reshape(_box_shape(t)), name=f"{t.hf_name} {list(t.box)}")
    return values, scales


def _exchange(plan: ReshardPlan, rank: int, index: int, src: Mapping[str, torch.Tensor], group: Any,
              dtype: torch.dtype, device: torch.device, deadline: Bound | None
              ) -> tuple[list[Arrival], int, int]:
    """Post and wait for the sends and receives of bucket ``index``; returns what arrived, cell by cell in the
    bucket's order, and the bytes sent and received.

    Each peer gets one buffer per dtype on the wire (see [Note: wire dtype]; a quantized cell's values and
    scales go in two, [Note: quantized cells] in :mod:`hybridmem.reshard.plan`), posted in the same order on
    both sides, each holding its cells' parts in the bucket's order.
    """
    sends: dict[tuple[int, str], list[torch.Tensor]] = defaultdict(list)
    recvs: dict[tuple[int, str], int] = defaultdict(int)
    arriving: list[tuple[Transfer, list[tuple[tuple[int, str], int, int, torch.dtype]]]] = []
    for t in plan.buckets[index]:
        if t.src_rank == rank:
            for part in pack_cell(plan, t, src, dtype):
                wire = torch.uint8 if part.dtype == FP8_DTYPE else part.dtype
                sends[t.dst_rank, str(wire)].append(part.reshape(-1).view(wire))
        if t.dst_rank == rank:
            spans = []
            for wire, n in _parts(plan, t, dtype):
                key = (t.src_rank, str(wire))
                spans.append((key, recvs[key], n, wire))
                recvs[key] += n
            arriving.append((t, spans))
    ops, peers = [], []
    send_bufs = {}
    for key in sorted(sends):
        send_bufs[key] = buf = torch.cat(sends[key])
        ops.append(dist.P2POp(dist.isend, buf, global_rank(group, key[0]), group))
        peers.append(key[0])
    wires = {str(w): w for _, spans in arriving for _, _, _, w in spans}
    recv_bufs = {}
    for key in sorted(recvs):
        recv_bufs[key] = buf = torch.empty(recvs[key], dtype=wires[key[1]], device=device)
        ops.append(dist.P2POp(dist.irecv, buf, global_rank(group, key[0]), group))
        peers.append(key[0])
    exchange(ops, peers, deadline, f"rank {rank}: bucket {index + 1} of {len(plan.buckets)} of the "
                                   "resharding plan")
    sent = sum(b.numel() * b.element_size() for b in send_bufs.values())
    received = sum(b.numel() * b.element_size() for b in recv_bufs.values())
    arrived = []
    for t, spans in arriving:
        parts = [recv_bufs[key][offset:offset + n] for key, offset, n, _ in spans]
        if len(parts) == 2:
            parts = [parts[0].view(FP8_DTYPE).view(_box_shape(t)),
                     parts[1].view(tuple(b - a for a, b in scale_box(t.box)))]
        else:
            parts = [parts[0].view(_box_shape(t))]
        arrived.append((t, tuple(parts)))
    return arrived, sent, received


def _unpack(arrived: Iterable[Arrival], dst: MutableMapping[str, torch.Tensor],
            written: dict[str, int] | None = None) -> None:
    for t, (values,) in arrived:
        target = piece_view(dst[t.dst_name], t.dst_piece, t.box)
        target.copy_(values)
        if written is not None:
            written[t.dst_name] = written.get(t.dst_name, 0) + target.numel()


def _plain(plan: ReshardPlan, what: str) -> None:
    """Refuse a plan whose cells travel quantized where every cell must arrive as values."""
    if plan.quantized:
        raise ValueError(f"{what} writes unquantized tensors; a plan that moves FP8-quantized cells "
                         "(quantized=...) runs through hybridmem.reshard.fp8_stream.iter_fp8_layout_tensors")


def _copy_local(plan: ReshardPlan, cells: Iterable[Transfer], src: Mapping[str, torch.Tensor],
                dst: Mapping[str, torch.Tensor], dtype: torch.dtype,
                written: dict[str, int] | None = None) -> int:
    """Copy local ``cells``, cast as they would be on the wire; returns the number of elements copied."""
    copied = 0
    for t in cells:
        piece = piece_view(src[t.src_name], t.src_piece, t.box).to(cell_dtype(plan, t.hf_name, dtype))
        target = piece_view(dst[t.dst_name], t.dst_piece, t.box)
        target.copy_(piece)
        if written is not None:
            written[t.dst_name] = written.get(t.dst_name, 0) + target.numel()
        copied += t.numel
    return copied


def run_plan(plan: ReshardPlan, *, rank: int, src: Mapping[str, torch.Tensor], group: Any = None,
             dst: MutableMapping[str, torch.Tensor] | None = None,
             dtype: torch.dtype | None = None,
             written: dict[str, int] | None = None,
             deadline_s: float | None = None) -> tuple[dict[str, torch.Tensor], TransferStats]:
    """Write this rank's destination tensors from every rank's source tensors.

    Call on every rank of ``group`` with the same ``plan``.

    Args:
        plan: The plan (``plan.world_size`` must be the size of ``group``).
        rank: This process's rank in ``group``.
        src: This rank's source tensors by name (e.g. the Megatron model's ``named_parameters()``).
        group: The process group (``None``: the default group).
        dst: The destination tensors to write into, by name (e.g. the engine's ``named_parameters()``);
            ``None`` allocates them. Tensors with padding rows are zeroed first.
        dtype: The element type on the wire and of allocated destinations, the same on every rank
            (see [Note: wire dtype]); ``None``: the first source tensor's.
        written: When given, receives the number of elements written into each destination tensor,
            counted at each copy (the weight-coverage proof, [Note: weight coverage] in
            :mod:`hybridmem.weight_sync`).
        deadline_s: Seconds from the call within which every collective must complete (see [Note:
            collective deadlines]); ``None``: no bound but the process group's own timeout.

    Returns:
        The destination tensors and this rank's figures (``received_nbytes`` counts bytes that arrived
        from other ranks; local slices are copied, not counted).

    Raises:
        ValueError: A source or destination tensor is missing or has the wrong shape.
        CollectiveTimeoutError: A peer did not complete a bucket within ``deadline_s`` (stuck or dead).
    """
    start = time.perf_counter()
    _plain(plan, "run_plan")
    bound = deadline_bound(deadline_s)
    dtype, device = _check_sources(plan, rank, src, dtype)
    expected = plan.dst.tensors(rank)
    if dst is None:
        dst = {name: torch.zeros(local.shape, dtype=held_dtype(plan.src.spec, local, dtype), device=device)
               for name, local in expected.items()}
    else:
        for name, local in expected.items():
            if name not in dst:
                raise ValueError(f"rank {rank}: destination lacks {name} (a {plan.dst.side.value} "
                                 f"{plan.dst.parallel} tensor)")
            if tuple(dst[name].shape) != local.shape:
                raise ValueError(f"rank {rank}: destination {name} has shape {tuple(dst[name].shape)}, "
                                 f"expected {local.shape}")
            if sum(p.numel for p in local.pieces) < local.numel:
                dst[name].zero_()
    accel = get_accelerator(device)
    side = accel.new_stream()
    sent = received = peak = 0
    _warm_group(plan, group, device, bound)
    with torch.no_grad(), accel.on_side_stream(side):
        _copy_local(plan, plan.local[rank], src, dst, dtype, written)
        for i in range(len(plan.buckets)):
            arrived, s, r = _exchange(plan, rank, i, src, group, dtype, device, bound)
            _unpack(arrived, dst, written)
            sent, received, peak = sent + s, received + r, max(peak, s + r)
            del arrived
    accel.current_stream().wait_stream(side)
    accel.synchronize()  # so ``seconds`` is the time to completion
    return dict(dst), TransferStats(
        num_tensors=len(expected),
        sent_nbytes=sent,
        received_nbytes=received,
        min_received_nbytes=plan.min_recv_nbytes(rank),
        temp_peak_nbytes=peak,
        seconds=time.perf_counter() - start,
    )


def held_dtype(spec: ModelSpec, local: Any, dtype: torch.dtype) -> torch.dtype:
    """dtype of a layout tensor ``local`` held in ``dtype`` (the wire's, or the engine's): fp32 for a tensor
    ``spec`` keeps in fp32 where ``dtype`` is narrower (see [Note: wire dtype])."""
    if local.pieces and spec.wire_itemsize(local.pieces[0].hf_name, dtype.itemsize) > dtype.itemsize:
        return torch.float32
    return dtype


def _data_numel(local: Any) -> int:
    """Data elements of a destination tensor: its pieces; the rest is padding."""
    return sum(p.numel for p in local.pieces)


def _stream_books(plan: ReshardPlan, rank: int) -> tuple[dict[str, Any], dict[str, int],
                                                        dict[str, list[Transfer]], dict[str, tuple[int, int]],
                                                        dict[str, int]]:
    """What a stream of ``rank``'s destination tensors keeps track of ([Note: layout streams]): the tensors,
    the data elements each still lacks, the local cells of each, the buckets each receives in
    (:func:`_received_spans`) and each one's place in destination order."""
    expected = plan.dst.tensors(rank)
    remaining = {name: _data_numel(local) for name, local in expected.items()}
    cells: dict[str, list[Transfer]] = defaultdict(list)
    for t in plan.local[rank]:
        cells[t.dst_name].append(t)
    order = {name: i for i, name in enumerate(expected)}
    return expected, remaining, cells, _received_spans(plan, rank), order


def _received_spans(plan: ReshardPlan, rank: int) -> dict[str, tuple[int, int]]:
    """The first and last bucket of each destination tensor of ``rank`` that receives cells from others."""
    spans: dict[str, tuple[int, int]] = {}
    for i, bucket in enumerate(plan.buckets):
        for t in bucket:
            if t.dst_rank == rank:
                spans[t.dst_name] = (spans.get(t.dst_name, (i, i))[0], i)
    return spans


def _lent(plan: ReshardPlan, cells: Sequence[Transfer], shape: tuple[int, ...],
          src: Mapping[str, torch.Tensor], dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor | None:
    """The source tensor that is, as it lies, a destination tensor of ``shape`` made of the one cell in
    ``cells`` (whole, in ``out_dtype``, in the destination's element order); ``None`` where none is."""
    if len(cells) != 1:
        return None
    t = cells[0]
    if t.numel != math.prod(shape) or cell_dtype(plan, t.hf_name, dtype) != out_dtype:
        return None
    order = piece_view(torch.empty(shape, device="meta"), t.dst_piece, t.box)
    if tuple(order.shape) != tuple(shape) or order.storage_offset() or not order.is_contiguous():
        return None
    piece = piece_view(src[t.src_name], t.src_piece, t.box)
    if piece.dtype != out_dtype or tuple(piece.shape) != tuple(shape) or not piece.is_contiguous():
        return None
    return piece


TargetFn = Callable[[str, tuple[int, ...], torch.dtype], "torch.Tensor | None"]
"""``target(name, shape, dtype)`` of :func:`iter_layout_tensors`."""


def stream_peak_nbytes(plan: ReshardPlan, rank: int, dtype: torch.dtype) -> int:
    """The most bytes of destination tensors :func:`iter_layout_tensors` holds at once on ``rank`` (the one
    yielded included), in ``dtype`` (its ``out_dtype``, else the wire's): the largest tensor made of local
    cells alone, or the tensors open across one bucket, whichever is more ([Note: layout streams])."""
    expected = plan.dst.tensors(rank)
    nbytes = {name: local.numel * held_dtype(plan.src.spec, local, dtype).itemsize
              for name, local in expected.items()}
    spans = _received_spans(plan, rank)
    peak = max((n for name, n in nbytes.items() if name not in spans), default=0)
    opened = [0] * (len(plan.buckets) + 1)
    for name, (first, last) in spans.items():
        opened[first] += nbytes[name]
        opened[last + 1] -= nbytes[name]
    alive = 0
    for change in opened:
        alive += change
        peak = max(peak, alive)
    return peak


def iter_layout_tensors(plan: ReshardPlan, *, rank: int, src: Mapping[str, torch.Tensor], group: Any = None,
                        dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
                        stats: list[TransferStats] | None = None,
                        deadline_s: float | None = None,
                        target: TargetFn | None = None,
                        borrow: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for each of this rank's destination tensors, complete, once, in the plan's
    destination layout (any: vLLM's, HF's).

    Holds only the tensors in flight ([Note: layout streams]): at most :func:`stream_peak_nbytes` bytes of
    destination tensors, the one yielded included, on ``src``'s device. A yielded tensor is this function's
    to drop: it is valid until the next one is requested, and the caller copies it out. Every rank must
    exhaust the iterator (a rank that stops early leaves its peers waiting in a bucket).

    Args:
        plan: The plan (``plan.world_size`` must be the size of ``group``).
        rank: This process's rank in ``group``.
        src: This rank's source tensors by name.
        group: The process group (``None``: the default group).
        dtype: The element type on the wire, the same on every rank (see [Note: wire dtype]); ``None``:
            the first source tensor's.
        out_dtype: The element type of the yielded tensors (a tensor the spec keeps in fp32 stays fp32
            where it is narrower); ``None``: the wire dtype. Cells are cast to it as they are copied in.
        stats: When given, one :class:`TransferStats` is appended to it at the end.
        deadline_s: Seconds from the call within which every collective must complete (see [Note:
            collective deadlines]); ``None``: no bound but the process group's own timeout.
        target: ``target(name, shape, dtype)`` gives the memory to build a tensor made of local cells alone
            in (a tensor of that shape and dtype, the caller's), or ``None`` for a new one; asked right
            before the tensor is built, which is then yielded next ([Note: layout streams]).
        borrow: Yield a tensor that is one whole local cell already in its destination dtype and element
            order as that source tensor (a view of it, the caller's to read only), where ``target`` gave
            no memory for it.

    Raises:
        ValueError: A source tensor is missing or has the wrong shape.
        CollectiveTimeoutError: A peer did not complete a bucket within ``deadline_s`` (stuck or dead).
        RuntimeError: The plan left a destination tensor incomplete (a bug in a plan; names the tensor).
    """
    start = time.perf_counter()
    _plain(plan, "iter_layout_tensors")
    bound = deadline_bound(deadline_s)
    dtype, device = _check_sources(plan, rank, src, dtype)
    held = dtype if out_dtype is None else out_dtype
    expected, remaining, cells, spans, order = _stream_books(plan, rank)
    in_flight: dict[str, torch.Tensor] = {}
    sent = received = peak = 0

    def first_touch(name: str, into: TargetFn | None = None, lend: bool = False) -> torch.Tensor:
        local = expected[name]
        padded = remaining[name] < local.numel
        out_dtype = held_dtype(plan.src.spec, local, held)
        tensor = None if into is None else into(name, tuple(local.shape), out_dtype)
        if tensor is None and lend and not padded:
            tensor = _lent(plan, cells.get(name, ()), local.shape, src, dtype, out_dtype)
            if tensor is not None:
                remaining[name] -= cells.pop(name)[0].numel
                return tensor
        if tensor is None:
            tensor = (torch.zeros if padded else torch.empty)(local.shape, dtype=out_dtype, device=device)
        else:
            if (tuple(tensor.shape), tensor.dtype, tensor.device) != (tuple(local.shape), out_dtype, device):
                raise ValueError(f"target({name!r}) gave a {tensor.dtype} tensor of shape "
                                 f"{tuple(tensor.shape)} on {tensor.device}, expected {out_dtype} "
                                 f"{tuple(local.shape)} on {device}")
            if padded:
                tensor.zero_()
        remaining[name] -= _copy_local(plan, cells.pop(name, ()), src, {name: tensor}, dtype)
        return tensor

    _warm_group(plan, group, device, bound)
    with torch.no_grad():
        for name in expected:
            if name not in spans:
                tensor = first_touch(name, target, borrow)
                _check_complete(plan, rank, [name], remaining)
                yield name, tensor
                del tensor  # before the next one is allocated
        for i in range(len(plan.buckets)):
            arrived, s, r = _exchange(plan, rank, i, src, group, dtype, device, bound)
            touched = {t.dst_name for t, _ in arrived}
            for name in touched - in_flight.keys():
                in_flight[name] = first_touch(name)
            _unpack(arrived, in_flight)
            sent, received, peak = sent + s, received + r, max(peak, s + r)
            for t, _ in arrived:
                remaining[t.dst_name] -= t.numel
            del arrived
            for name in sorted(touched, key=order.__getitem__):
                if remaining[name] == 0:
                    yield name, in_flight.pop(name)
    _check_complete(plan, rank, in_flight, remaining)
    if stats is not None:
        stats.append(TransferStats(num_tensors=len(expected), sent_nbytes=sent, received_nbytes=received,
                                   min_received_nbytes=plan.min_recv_nbytes(rank), temp_peak_nbytes=peak,
                                   seconds=time.perf_counter() - start))


def _check_complete(plan: ReshardPlan, rank: int, names: Iterable[str], remaining: Mapping[str, int]) -> None:
    left = {name: remaining[name] for name in names if remaining[name]}
    if left:
        name, num = next(iter(left.items()))
        raise RuntimeError(f"rank {rank}: the plan left {len(left)} {plan.dst.side.value} tensors "
                           f"incomplete, e.g. {name} ({num} data elements unwritten)")


def iter_full_tensors(plan: ReshardPlan, *, rank: int, src: Mapping[str, torch.Tensor],
                      group: Any = None, stats: list[TransferStats] | None = None,
                      dtype: torch.dtype | None = None,
                      deadline_s: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for this rank's pipeline stage, each as soon as it is complete.

    :func:`iter_layout_tensors` for engines that only take ``load_weights``: the plan's destination must be
    an HF layout (:func:`~hybridmem.reshard.layouts.hf_layout`); the tensors are in the wire dtype.

    Raises:
        ValueError: The plan's destination is not an HF layout, or a source tensor is wrong.
    """
    if plan.dst.side is not Side.HF:
        raise ValueError(f"iter_full_tensors needs an HF destination layout, got {plan.dst.side.value}")
    return iter_layout_tensors(plan, rank=rank, src=src, group=group, dtype=dtype, stats=stats,
                               deadline_s=deadline_s)
