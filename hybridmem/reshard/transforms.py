"""Pieces and the composable transforms that build one rank's tensor from HF-full tensors.

[Note: pieces]
Every tensor a rank holds, in any layout, is a set of rectangular blocks of HF-full tensors placed at
known offsets; rows no block covers are padding and hold zeros (vocab padding). A :class:`Piece` says
"the box ``src`` of HF tensor ``hf_name`` sits at ``dst_start`` inside ``local[dst_prefix]``", where
``dst_prefix`` indexes leading stacking axes the HF tensor lacks (the expert axis of vLLM's
``w13_weight``). Megatron's per-group interleaved QKV, fused gate/up halves, padded vocab and stacked
experts are all just lists of pieces, so sharding, unsharding and the transfer plan are each written
once, over pieces, and never per model. Two more things a piece may say, for checkpoints that store a
tensor other than the engine holds it (gpt-oss's experts): its box may have leading axes of extent 1
the local block lacks (one expert of a checkpoint tensor stacked over experts), and it may be
``transposed`` (the box's last two axes swapped in the local tensor). Every copy goes through
:func:`piece_view`, a view of the local tensor shaped like the box.

The transforms below each return a :class:`LocalTensor` and are composed by the layout tables in
:mod:`hybridmem.reshard.layouts`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

__all__ = [
    "Box",
    "box_numel",
    "box_intersection",
    "Piece",
    "LocalTensor",
    "replicate",
    "split",
    "block",
    "chunk",
    "concat",
    "pad_rows",
    "stack",
    "build_local",
    "scatter_local",
    "piece_view",
]

Box = tuple[tuple[int, int], ...]
"""Half-open ``(start, stop)`` ranges, one per axis of the HF-full tensor."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One block of an HF-full tensor inside a local tensor (see [Note: pieces])."""

    hf_name: str
    src: Box
    dst_prefix: tuple[int, ...]
    dst_start: tuple[int, ...]
    """Where the block starts in the local tensor (after ``dst_prefix``), one entry per local axis; fewer
    than ``src`` has axes when the box's leading axes (extent 1) are dropped in the local tensor."""
    transposed: bool = False
    """The box's last two axes are swapped in the local tensor."""

    @property
    def numel(self) -> int:
        return box_numel(self.src)


@dataclass(frozen=True, slots=True)
class LocalTensor:
    """Shape of one rank's tensor and the pieces that fill it."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def box_numel(box: Box) -> int:
    """Elements of ``box``."""
    n = 1
    for a, b in box:
        n *= b - a
    return n


def box_intersection(a: Box, b: Box) -> Box | None:
    """The box both ``a`` and ``b`` cover, or ``None`` when they do not meet."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def _full_box(shape: Sequence[int]) -> Box:
    return tuple((0, s) for s in shape)


def replicate(hf_name: str, shape: Sequence[int]) -> LocalTensor:
    """The whole HF tensor, unchanged (norms, routers, TP-size-1 tensors)."""
    return LocalTensor(tuple(shape), (Piece(hf_name, _full_box(shape), (), (0,) * len(shape)),))


def chunk(size: int, rank: int, num: int, *, what: str = "dim") -> tuple[int, int]:
    """``[start, stop)`` of chunk ``rank`` of ``num`` equal chunks of ``size``.

    Raises:
        ValueError: ``size`` is not divisible by ``num`` (the message names both).
    """
    if size % num:
        raise ValueError(f"{what}={size} is not divisible by {num}")
    step = size // num
    return rank * step, (rank + 1) * step


def split(hf_name: str, shape: Sequence[int], *, axis: int, rank: int, num: int) -> LocalTensor:
    """Equal chunk ``rank`` of ``num`` along ``axis`` (column-parallel: axis 0; row-parallel: axis 1)."""
    start, stop = chunk(shape[axis], rank, num, what=f"{hf_name} dim {axis}")
    box = list(_full_box(shape))
    box[axis] = (start, stop)
    local = list(shape)
    local[axis] = stop - start
    return LocalTensor(tuple(local), (Piece(hf_name, tuple(box), (), (0,) * len(shape)),))


def block(hf_name: str, shape: Sequence[int], start: int, stop: int) -> LocalTensor:
    """Rows ``[start, stop)`` of an HF tensor (one query group's q, k or v rows)."""
    if not 0 <= start < stop <= shape[0]:
        raise ValueError(f"rows [{start}, {stop}) outside {hf_name} of {shape[0]} rows")
    box = ((start, stop), *_full_box(shape[1:]))
    return LocalTensor((stop - start, *shape[1:]), (Piece(hf_name, box, (), (0,) * len(shape)),))


def concat(parts: Sequence[LocalTensor], *, axis: int = 0) -> LocalTensor:
    """Concatenate local tensors along ``axis`` (QKV groups, [gate_r; up_r] halves)."""
    if not parts:
        raise ValueError("concat of no parts")
    ndim = len(parts[0].shape)
    pieces: list[Piece] = []
    offset = 0
    for part in parts:
        if len(part.shape) != ndim or any(
            a != b for i, (a, b) in enumerate(zip(part.shape, parts[0].shape)) if i != axis
        ):
            raise ValueError(f"concat along axis {axis}: shape {part.shape} does not match {parts[0].shape}")
        for p in part.pieces:
            if p.dst_prefix:
                raise ValueError("concat of stacked parts is not supported; concat first, then stack")
            start = list(p.dst_start)
            start[axis - len(p.dst_prefix)] += offset
            pieces.append(replace(p, dst_start=tuple(start)))
        offset += part.shape[axis]
    shape = list(parts[0].shape)
    shape[axis] = offset
    return LocalTensor(tuple(shape), tuple(pieces))


def pad_rows(hf_name: str, shape: Sequence[int], *, padded_rows: int, rank: int, num: int) -> LocalTensor:
    """Chunk ``rank`` of the vocab padded to ``padded_rows`` and split ``num`` ways; padded rows are zero."""
    if padded_rows < shape[0]:
        raise ValueError(f"padded_rows={padded_rows} < rows={shape[0]} of {hf_name}")
    start, stop = chunk(padded_rows, rank, num, what=f"padded vocab of {hf_name}")
    local = (stop - start, *shape[1:])
    real = (min(start, shape[0]), min(stop, shape[0]))
    if real[0] == real[1]:
        return LocalTensor(local, ())
    box = ((real[0], real[1]), *_full_box(shape[1:]))
    return LocalTensor(local, (Piece(hf_name, box, (), (0,) * len(shape)),))


def stack(parts: Sequence[LocalTensor]) -> LocalTensor:
    """Stack equal-shaped local tensors along a new leading axis (vLLM FusedMoE experts)."""
    if not parts:
        raise ValueError("stack of no parts")
    pieces = []
    for i, part in enumerate(parts):
        if part.shape != parts[0].shape:
            raise ValueError(f"stack: shape {part.shape} of part {i} differs from {parts[0].shape}")
        pieces.extend(replace(p, dst_prefix=(i, *p.dst_prefix)) for p in part.pieces)
    return LocalTensor((len(parts), *parts[0].shape), tuple(pieces))


def src_index(src: Box) -> tuple[slice, ...]:
    """The slice of the HF-full tensor a box names."""
    return tuple(slice(a, b) for a, b in src)


def piece_view(local: torch.Tensor, piece: Piece, box: Box | None = None) -> torch.Tensor:
    """The part of ``local`` (a tensor of the piece's layout) holding ``box``, a sub-box of ``piece.src``
    (default: all of it), as a view shaped like ``box``: the HF tensor's ``[box]`` reads and writes
    through it, whatever the piece's dropped axes and transposition.

    Raises:
        ValueError: A dropped leading axis of the piece's box is longer than 1.
    """
    box = piece.src if box is None else box
    dropped = len(piece.src) - len(piece.dst_start)
    if any(b - a != 1 for a, b in piece.src[:dropped]):
        raise ValueError(f"{piece.hf_name}: box {piece.src} drops {dropped} leading axes, which must have "
                         "extent 1")
    inner, origin = list(box[dropped:]), list(piece.src[dropped:])
    if piece.transposed:
        inner[-2:], origin[-2:] = inner[:-3:-1], origin[:-3:-1]
    view = local[(*piece.dst_prefix,
                  *(slice(s + a - pa, s + b - pa)
                    for s, (a, b), (pa, _) in zip(piece.dst_start, inner, origin)))]
    if piece.transposed:
        view = view.transpose(-1, -2)
    return view[(None,) * dropped] if dropped else view  # a view still: writes reach ``local``


def build_local(local: LocalTensor, full: Mapping[str, torch.Tensor], *,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """Materialise one local tensor from HF-full tensors (padding zero).

    Args:
        local: The local tensor's pieces.
        full: HF-full tensors by name.
        dtype: The result's dtype; ``None``: that of its first piece's source, or of any tensor in
            ``full`` for a tensor that is all padding (e.g. the last TP rank's vocab rows). Required when
            ``local`` is all padding and ``full`` is empty.
    """
    if local.pieces:
        first = full[local.pieces[0].hf_name]
    else:
        first = next(iter(full.values()), None)
        if first is None and dtype is None:
            raise ValueError(f"{local.shape} is all padding and no tensor gives its dtype; pass dtype=")
    out = torch.zeros(local.shape, dtype=dtype or first.dtype,
                      device=first.device if first is not None else None)
    for p in local.pieces:
        piece_view(out, p).copy_(full[p.hf_name][src_index(p.src)])
    return out


def scatter_local(local: LocalTensor, tensor: torch.Tensor, full: Mapping[str, torch.Tensor]) -> None:
    """Write a local tensor's pieces back into the HF-full tensors (the inverse of :func:`build_local`)."""
    if tuple(tensor.shape) != local.shape:
        raise ValueError(f"tensor shape {tuple(tensor.shape)} != layout shape {local.shape}")
    for p in local.pieces:
        full[p.hf_name][src_index(p.src)] = piece_view(tensor, p)
