"""A plan run into an FP8 engine's layout: :func:`iter_fp8_layout_tensors` yields one rank's tensors of an FP8
vLLM layout, each quantized weight as its e4m3 values and then its float32 block scales, made from the
cells that arrive quantized and the blocks the rank quantizes itself ([Note: quantized cells] in
:mod:`hybridmem.reshard.plan`).

[Note: fp8 assembly]
The plan is into the layout's unquantized twin (the same tensors without scales; ``weight_block_size``
unset), with ``quantized`` naming the checkpoint weights the layout holds in FP8. Per destination tensor the
rank keeps what it is building: for a quantized weight its e4m3 tensor and block scales, into which each
quantized cell's values and scales are copied as they come (a local one quantized here as its sender
would), and, only once a cell arrives cut inside a block, a tensor of the wire dtype that gathers such cells;
when the tensor is complete, the blocks those cells touch (whole blocks, none of them in a quantized cell) are
quantized from it. For another tensor, a tensor of the wire dtype, cast to the engine's dtype when yielded.
A tensor is yielded as soon as it is complete and dropped (the memory bound of [Note: layout streams] in
:mod:`hybridmem.reshard.execute`, with one byte an element held for a quantized weight where the wire dtype
has two or four). Checksums (``checks``) compare what arrived with what was sent, cell by cell: a quantized
cell as the float32 values its e4m3 values and scales stand for, computed alike on both ends
(:func:`~hybridmem.reshard.fp8.dequantize_block_fp8`), another as its wire values.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from hybridmem.reshard.checksum import CellChecksums
from hybridmem.reshard.deadline import deadline_bound
from hybridmem.reshard.execute import (
    Arrival,
    TransferStats,
    _check_complete,
    _check_sources,
    _data_numel,
    _exchange,
    _stream_books,
    _warm_group,
    held_dtype,
    pack_cell,
)
from hybridmem.reshard.fp8 import (
    FP8_DTYPE,
    SCALE_SUFFIX,
    block_cover,
    dequantize_block_fp8,
    quantize_block_fp8,
    scale_box,
    scale_name,
)
from hybridmem.reshard.plan import ReshardPlan, Transfer
from hybridmem.reshard.spec import ModelSpec
from hybridmem.reshard.transforms import LocalTensor, Piece, piece_view

__all__ = ["iter_fp8_layout_tensors"]


class _Unquantized:
    """A tensor vLLM does not quantize, built in the wire dtype ([Note: fp8 assembly])."""

    def __init__(self, name: str, local: LocalTensor, spec: ModelSpec, wire: torch.dtype,
                 out: torch.dtype | None, device: torch.device):
        self.name = name
        padded = _data_numel(local) < local.numel
        self.tensor = (torch.zeros if padded else torch.empty)(
            local.shape, dtype=held_dtype(spec, local, wire), device=device)
        self.out = None if out is None else held_dtype(spec, local, out)

    def place(self, t: Transfer, parts: tuple[torch.Tensor, ...]) -> None:
        target = piece_view(self.tensor, t.dst_piece, t.box)
        target.copy_(parts[0].reshape(target.shape))

    def finish(self, checks: CellChecksums | None) -> Iterator[tuple[str, torch.Tensor]]:
        if checks is not None:
            checks.add_destination(self.name, self.tensor)
        tensor, self.tensor = self.tensor, None
        yield self.name, tensor if self.out is None or tensor.dtype == self.out else tensor.to(self.out)


class _Quantized:
    """A weight vLLM holds in e4m3 with block scales, built from quantized cells and the blocks quantized here
    ([Note: fp8 assembly])."""

    def __init__(self, name: str, local: LocalTensor, weight: LocalTensor, scale: LocalTensor,
                 shapes: Mapping[str, tuple[int, ...]], wire: torch.dtype, device: torch.device,
                 checks: bool):
        if weight.pieces != local.pieces or weight.shape != local.shape:
            raise ValueError(f"{name}: the FP8 layout's tensor is not the plan's ({weight.shape} vs "
                             f"{local.shape}); plan into the FP8 layout's unquantized twin")
        self.name, self.wire, self.device, self.shapes = name, wire, device, shapes
        self.shape = local.shape
        self.values = torch.zeros(local.shape, dtype=FP8_DTYPE, device=device)
        self.scales = torch.zeros(scale.shape, dtype=torch.float32, device=device)
        self.scale_piece: dict[Piece, Piece] = dict(zip(weight.pieces, scale.pieces, strict=True))
        self.loose: dict[Piece, set[tuple[tuple[int, int], ...]]] = defaultdict(set)
        """Per piece, the whole blocks cells cut inside a block touch (quantized at :meth:`finish`)."""
        self.plain: torch.Tensor | None = None
        """The cells that came unquantized, in the wire dtype (allocated with the first)."""
        self.cells: list[tuple[Transfer, bool]] | None = [] if checks else None

    def place(self, t: Transfer, parts: tuple[torch.Tensor, ...]) -> None:
        if len(parts) == 2:
            piece_view(self.values, t.dst_piece, t.box).copy_(parts[0])
            piece_view(self.scales, self.scale_piece[t.dst_piece], scale_box(t.box)).copy_(parts[1])
        else:
            if self.plain is None:
                self.plain = torch.zeros(self.shape, dtype=self.wire, device=self.device)
            target = piece_view(self.plain, t.dst_piece, t.box)
            target.copy_(parts[0].reshape(target.shape))
            self.loose[t.dst_piece].add(block_cover(t.box, self.shapes[t.hf_name]))
        if self.cells is not None:
            self.cells.append((t, len(parts) == 2))

    def finish(self, checks: CellChecksums | None) -> Iterator[tuple[str, torch.Tensor]]:
        for piece, covers in self.loose.items():
            for cover in covers:
                values, blocks = quantize_block_fp8(piece_view(self.plain, piece, cover),
                                                    name=f"{self.name} ({piece.hf_name} {list(cover)})")
                piece_view(self.values, piece, cover).copy_(values)
                piece_view(self.scales, self.scale_piece[piece], scale_box(cover)).copy_(blocks)
        if checks is not None:
            checks.add_destination(self.name, self._image())
        self.plain = None
        values, scales, self.values, self.scales = self.values, self.scales, None, None
        yield self.name, values
        del values
        yield scale_name(self.name), scales

    def _image(self) -> torch.Tensor:
        """The tensor whose cells are what arrived: a quantized cell's values times their scales, another's
        wire values (float32; what the checksums compare)."""
        image = torch.zeros(self.shape, dtype=torch.float32, device=self.device)
        for t, quantized in self.cells or ():
            view = piece_view(image, t.dst_piece, t.box)
            if quantized:
                scales = piece_view(self.scales, self.scale_piece[t.dst_piece], scale_box(t.box))
                view.copy_(dequantize_block_fp8(piece_view(self.values, t.dst_piece, t.box), scales))
            else:
                view.copy_(piece_view(self.plain, t.dst_piece, t.box))
        return image


def _place(arrived: list[Arrival], building: dict[str, _Quantized | _Unquantized],
           touch: Callable[[str], _Quantized | _Unquantized], remaining: dict[str, int]) -> set[str]:
    """Place a bucket's cells into the tensors they belong to (begun with ``touch``); returns their names."""
    for t, parts in arrived:
        if t.dst_name not in building:
            building[t.dst_name] = touch(t.dst_name)
        building[t.dst_name].place(t, parts)
        remaining[t.dst_name] -= t.numel
    return {t.dst_name for t, _ in arrived}


def iter_fp8_layout_tensors(plan: ReshardPlan, tensors: Mapping[str, LocalTensor], *, rank: int,
                            src: Mapping[str, torch.Tensor], group: Any = None,
                            dtype: torch.dtype | None = None, out_dtype: torch.dtype | None = None,
                            stats: list[TransferStats] | None = None, deadline_s: float | None = None,
                            checks: CellChecksums | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for each of this rank's FP8 ``tensors``, complete, once: each weight they
    quantize as its e4m3 values and then its ``weight_scale_inv``, the others in ``out_dtype`` ([Note: fp8
    assembly]).

    Every rank of ``group`` runs it with its share of the same plan and exhausts it, as
    :func:`~hybridmem.reshard.execute.iter_layout_tensors`.

    Args:
        plan: A plan into ``tensors`` unquantized whose ``quantized`` names the weights ``tensors`` hold in
            FP8 ([Note: quantized cells] in :mod:`hybridmem.reshard.plan`).
        tensors: The rank's tensors of an FP8 vLLM layout (``VLLMConvention(weight_block_size=(128,
            128))``), or of an HF layout with the block scales of its quantized weights beside them (an FP8
            checkpoint's tensors), by name.
        rank: This process's rank in ``group``.
        src: This rank's source tensors by name.
        group: The process group (``None``: the default group).
        dtype: The element type on the wire, the same on every rank (a dtype the quantizer takes);
            ``None``: the first source tensor's.
        out_dtype: The element type of the tensors vLLM does not quantize (a tensor the spec keeps in fp32
            stays fp32); ``None``: the wire dtype.
        stats: When given, one :class:`~hybridmem.reshard.execute.TransferStats` is appended at the end.
        deadline_s: Seconds from the call within which every collective must complete.
        checks: When given, each destination cell's figures are added to it (compare after the end).

    Raises:
        ValueError: A source tensor is missing or has the wrong shape, or ``tensors`` are not the plan's
            destination's quantized.
        CollectiveTimeoutError: A peer did not complete a bucket within ``deadline_s``.
        RuntimeError: The plan left a destination tensor incomplete (names the tensor).
    """
    start = time.perf_counter()
    bound = deadline_bound(deadline_s)
    dtype, device = _check_sources(plan, rank, src, dtype)
    expected, remaining, cells, spans, order = _stream_books(plan, rank)
    missing = ([n for n in expected if n not in tensors]
               + [n for n in tensors if n not in expected and not n.endswith(SCALE_SUFFIX)])
    if missing:
        raise ValueError(f"rank {rank}: the FP8 layout and the plan's destination differ in {missing[:3]}")
    building: dict[str, _Quantized | _Unquantized] = {}
    shapes = plan.src.spec.full_shapes()
    sent = received = peak = 0

    def touch(name: str) -> _Quantized | _Unquantized:
        local = expected[name]
        scale = tensors.get(scale_name(name))
        built: _Quantized | _Unquantized
        if scale is None:
            built = _Unquantized(name, local, plan.src.spec, dtype, out_dtype, device)
        else:
            built = _Quantized(name, local, tensors[name], scale, shapes, dtype, device, checks is not None)
        for t in cells.pop(name, ()):
            built.place(t, pack_cell(plan, t, src, dtype))
            remaining[name] -= t.numel
        return built

    _warm_group(plan, group, device, bound)
    with torch.no_grad():
        for name in expected:
            if name not in spans:
                built = touch(name)
                _check_complete(plan, rank, [name], remaining)
                yield from built.finish(checks)
                del built
        for i in range(len(plan.buckets)):
            arrived, s, r = _exchange(plan, rank, i, src, group, dtype, device, bound)
            touched = _place(arrived, building, touch, remaining)
            del arrived  # the bucket's buffers
            sent, received, peak = sent + s, received + r, max(peak, s + r)
            for name in sorted(touched, key=order.__getitem__):
                if remaining[name] == 0:
                    yield from building.pop(name).finish(checks)
    _check_complete(plan, rank, building, remaining)
    if stats is not None:
        stats.append(TransferStats(num_tensors=len(tensors), sent_nbytes=sent, received_nbytes=received,
                                   min_received_nbytes=plan.min_recv_nbytes(rank), temp_peak_nbytes=peak,
                                   seconds=time.perf_counter() - start))
