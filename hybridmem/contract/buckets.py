"""How many transfer buckets an engine in its own process holds per trainer rank, and the default size of
each: one rule for the engine that allocates them ([Note: vllm buckets] in
:mod:`hybridmem.adapters.vllm.server.buckets`) and for the memory plan that counts them (``hybridmem plan
--engine-process``, :mod:`hybridmem.planner.cluster`)."""

from __future__ import annotations

__all__ = ["NUM_BUCKETS", "MIN_BUCKET_NBYTES", "CPU_BUCKET_NBYTES", "MAX_DEFAULT_BUCKET_NBYTES",
           "default_bucket_nbytes"]

NUM_BUCKETS = 2
"""Buckets per trainer rank: the trainer fills one while the worker copies the other."""
MIN_BUCKET_NBYTES = 4096
"""The smallest bucket taken: one page."""
CPU_BUCKET_NBYTES = 64 << 20
"""The default bucket on CPU."""
MAX_DEFAULT_BUCKET_NBYTES = 1 << 30
"""The largest default bucket on CUDA (``vllm/distributed/weight_transfer/packed_tensor.py``'s buffer)."""
_MIN_DEFAULT_NBYTES = 1 << 20


def default_bucket_nbytes(device_type: str, *, free_nbytes: int) -> int:
    """The bucket size ``bucket_nbytes=None`` takes (see [Note: vllm buckets] in
    :mod:`hybridmem.adapters.vllm.server.buckets`); ``free_nbytes``: the shared directory's free bytes (CPU)
    or the device's (CUDA)."""
    if device_type == "cpu":
        size = min(CPU_BUCKET_NBYTES, free_nbytes // 4)
    else:
        size = min(MAX_DEFAULT_BUCKET_NBYTES, free_nbytes // 16)
    return max(_MIN_DEFAULT_NBYTES, size // _MIN_DEFAULT_NBYTES * _MIN_DEFAULT_NBYTES)
