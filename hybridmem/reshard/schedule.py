"""When each transfer of a plan runs: its step, a rule both of its ranks compute alone.

[Note: plan schedule]
A plan's transfers run in steps keyed ``(window, shift, chunk)``, in ascending key order on every rank:

- **window**: the model is laid end to end in wire elements (checkpoint tensors in HF order, a tensor
  the spec keeps in fp32 counted twice on a 2-byte wire) and cut into windows of one bucket's elements;
  a transfer belongs to the window of its rows (a transfer spanning windows is cut between rows). Steps
  go through the model front to back, so a destination tensor completes as its window passes (the
  streaming path yields it then) rather than at the end.
- **shift**: ``(dst - src) % world``: in one step a rank sends to one peer (``rank + shift``) and
  receives from one (``rank - shift``).
- **chunk**: the transfers of one (source, destination, window) in a fixed order (tensor, box,
  destination name), cut between rows and packed in that order into chunks of at most half a bucket,
  so a rank's sends plus receives in one step stay within ``bucket_nbytes`` (unless one row is larger).

A weight whose cells travel quantized ([Note: quantized cells] in :mod:`hybridmem.reshard.plan`) is cut
only between 128-row blocks (a window's cut moved on to the next block edge, a chunk a whole number of
blocks), so a cell made of whole blocks stays so in every part, each part still one byte an element where
the bucket counts it in the wire dtype.

Everything about a step of a pair of ranks follows from that pair's transfers, which sender and receiver
each know, so a rank schedules its own share without the rest of the plan and both ends of every
transfer agree on its step and its place in the step. Ascending keys cannot deadlock: the smallest step
not yet done has every rank in it ready to post it. tests/reshard/test_rank_plan.py checks a rank's
share equals its part of the whole plan.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import replace

from hybridmem.reshard.fp8 import FP8_BLOCK
from hybridmem.reshard.spec import ModelSpec

__all__ = ["StepKey", "schedule", "model_offsets", "transfer_key"]

StepKey = tuple[int, int, int]
"""``(window, shift, chunk)``, see [Note: plan schedule]."""


@functools.lru_cache(maxsize=64)
def model_offsets(spec: ModelSpec, itemsize: int) -> dict[str, tuple[int, int, int]]:
    """``{checkpoint name: (index in HF order, first wire element, wire elements per axis-0 index)}``."""
    out, offset = {}, 0
    widened = spec.has_router_bias and itemsize < 4  # else no tensor is widened: skip asking per tensor
    for i, (name, shape) in enumerate(spec.full_shapes().items()):
        row = spec.wire_itemsize(name, itemsize) // itemsize if widened and name.endswith("_bias") else 1
        for s in shape[1:]:
            row *= s
        out[name] = (i, offset, row)
        offset += row * (shape[0] if shape else 1)
    return out


def _cut(t, axis: int, lo: int, hi: int):
    box = list(t.box)
    box[axis] = (lo, hi)
    return replace(t, box=tuple(box))


def _windows(t, offsets: dict[str, tuple[int, int, int]], window: int,
             block: int = 1) -> Iterator[tuple[int, object]]:
    """``(window, part of t)`` for the runs of ``t``'s axis-0 rows that fall in one window each, cut only at
    rows that are multiples of ``block``."""
    _, offset, row = offsets[t.hf_name]
    (lo, hi) = t.box[0] if t.box else (0, 1)
    w_lo = (offset + lo * row) // window
    w_hi = (offset + (hi - 1) * row) // window
    if w_lo == w_hi or not t.box:
        yield w_lo, t
        return
    start = lo
    for w in range(w_lo, w_hi + 1):
        stop = -(-((w + 1) * window - offset) // row)  # first row of the next window
        stop = min(hi, -(-stop // block) * block)
        if stop > start:
            yield w, _cut(t, 0, start, stop)
            start = stop


def _rows(t, max_numel: int, scale: int, block: int = 1) -> list:
    """``t`` cut along its first axis longer than 1 into parts of at most ``max_numel`` wire elements,
    rows kept whole; a quantized weight (``block`` 128) only along axis 0, in whole blocks of rows."""
    n = t.numel * scale
    axis = next((i for i, (a, b) in enumerate(t.box) if b - a > 1), None)
    if block > 1:
        axis = 0 if t.box[0][1] - t.box[0][0] > block else None
    if n <= max_numel or axis is None:
        return [t]
    lo, hi = t.box[axis]
    row = n // (hi - lo)
    step = max(block, max_numel // row // block * block)
    return [_cut(t, axis, s, min(hi, s + step)) for s in range(lo, hi, step)]


def _block(t, quantized: frozenset[str]) -> int:
    """The rows a cut of ``t`` must fall between multiples of: 128 for a quantized weight, else 1."""
    return FP8_BLOCK[0] if t.hf_name in quantized else 1


def transfer_key(t, offsets: dict[str, tuple[int, int, int]]) -> tuple:
    """The sort key that puts transfers in model order (``offsets``: :func:`model_offsets`), the same on
    every rank."""
    return (offsets[t.hf_name][0], t.box, t.dst_name, t.dst_piece.dst_prefix, t.dst_piece.dst_start,
            t.src_name)


def schedule(remote: Iterable, spec: ModelSpec, world: int, itemsize: int,
             bucket_nbytes: int, quantized: frozenset[str] = frozenset()
             ) -> tuple[tuple[StepKey, ...], tuple[tuple, ...]]:
    """Cut and order transfers between different ranks into steps (see [Note: plan schedule]).

    Every transfer between two ranks must be given with all others between the same two ranks (a
    rank's own share is enough for the steps it takes part in). Transfers of ``quantized`` weights are cut
    between 128-row blocks only.

    Returns:
        The step keys, ascending, and per step its transfers ordered by source, destination, then
        their order in the chunk.
    """
    window = max(1, bucket_nbytes // itemsize)
    half = max(1, window // 2)
    offsets = model_offsets(spec, itemsize)
    pairs: dict[tuple[int, int, int], list] = {}
    for t in remote:
        for w, part in _windows(t, offsets, window, _block(t, quantized)):
            pairs.setdefault((t.src_rank, t.dst_rank, w), []).append(part)
    steps: dict[StepKey, list] = {}
    for (s, d, w), ts in pairs.items():
        ts.sort(key=lambda t: transfer_key(t, offsets))
        chunk, load = 0, 0
        for t in ts:
            scale = spec.wire_itemsize(t.hf_name, itemsize) // itemsize
            for part in _rows(t, half, scale, _block(t, quantized)):
                n = part.numel * scale
                if load and load + n > half:
                    chunk, load = chunk + 1, 0
                steps.setdefault((w, (d - s) % world, chunk), []).append(part)
                load += n
    keys = tuple(sorted(steps))
    # Within a step, transfers of one pair keep their chunk order (sorted() is stable).
    return keys, tuple(tuple(sorted(steps[k], key=lambda t: (t.src_rank, t.dst_rank))) for k in keys)
