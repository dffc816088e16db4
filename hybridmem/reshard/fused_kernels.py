"""The numba kernel of [Note: fused figures] in :mod:`hybridmem.reshard.fused_checksum` (imported only where
numba is installed).

One kernel, compiled once per element type it is handed (numba's cache): float32 and float64 as they
are, bfloat16's bits as int16 and float16's as uint16 (widened by a shift and by ``fpext``), a float8
type's bits as uint8 (looked up in the 256 values ``table`` holds).
"""

from __future__ import annotations

from typing import Any

import llvmlite.ir as ir
import numba
import numpy as np
from numba.core import types
from numba.extending import intrinsic, overload

BLOCK = 4096
"""Elements per inner loop: the column weights of one block are one slice of a table ``BLOCK + cp`` long,
so the inner loop has no modulo and vectorizes."""


@intrinsic
def _bf16_value(typingctx: Any, bits: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        wide = builder.zext(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), ir.FloatType())
    return types.float32(types.int16), codegen


@intrinsic
def _f16_value(typingctx: Any, bits: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


def _value(x, table):  # unannotated: numba matches the overload's argument names, annotations included
    """The number one element (or its bits) stands for (typed by :func:`_value_impl`)."""
    raise NotImplementedError("compiled by numba only")


@overload(_value, inline="always")
def _value_impl(x, table):  # unannotated, as _value
    if isinstance(x, types.Float):
        return lambda x, table: x
    if x == types.int16:
        return lambda x, table: _bf16_value(x)
    if x == types.uint16:
        return lambda x, table: _f16_value(x)
    if x == types.uint8:
        return lambda x, table: table[x]
    return None


@numba.njit(nogil=True, fastmath=True, cache=True)
def copy_figures(src: Any, dst: Any, write: bool, lo: int, cols: int, rp: int, cp: int, vtab: Any,
                 table: Any) -> tuple[float, float]:
    """``dst[:] = src`` (where ``write``; else ``dst`` is not touched) and ``(sum, sum of u(row) v(col) x)``
    in float64 of the elements of ``src``, numbered from ``lo`` in rows of ``cols``:
    ``u = 1 + (row mod rp) / rp``, ``v = vtab[col mod cp]``."""
    n = src.shape[0]
    total = 0.0
    weighted = 0.0
    k = 0
    while k < n:
        index = lo + k
        row = index // cols
        col = index - row * cols
        length = min(cols - col, n - k)
        s = 0.0
        w = 0.0
        j = 0
        while j < length:
            b = min(BLOCK, length - j)
            phase = (col + j) % cp
            sv = src[k + j:k + j + b]
            dv = dst[k + j:k + j + b]
            vt = vtab[phase:phase + b]
            for q in range(b):
                x = sv[q]
                if write:
                    dv[q] = x
                xf = np.float64(_value(x, table))
                s += xf
                w += xf * vt[q]
            j += b
        total += s
        weighted += w * (1.0 + (row % rp) / rp)
        k += length
    return total, weighted
