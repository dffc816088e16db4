"""Ask the kernel for transparent huge pages for a CPU tensor's memory before it is first written.

[Note: huge pages for fresh tensors]
Copying into memory nobody has touched yet costs a page fault per 4 KiB page: for the tensors vLLM's reload
allocates at every weight update, on a CPU, that is about a third of the worker's copy time (cpu-2c: a 604 MiB
update's copies out of the buckets took 238-258 ms, 159-185 ms when the same pages came as 2 MiB ones).
PyTorch's own switch, ``THP_MEM_ALLOC_ENABLE=1``, is read once per process when its CPU allocator first runs,
so it helps a process started with it (``vllm serve``, whose environment hybridmem sets) and not one forked
from a trainer that already allocated (AsyncLLM's engine core). :func:`advise_huge_pages` asks for the same
pages for one tensor's memory (``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned part of its bytes, Linux's
own call), so the first write faults them in as huge pages wherever the kernel's THP mode is ``always`` or
``madvise``. A caller that set ``THP_MEM_ALLOC_ENABLE=0`` chose small pages: nothing is asked then
(:func:`wanted`). Memory already touched keeps its pages (the kernel may merge them later); nothing is moved
or copied, and a failed call changes nothing, so the advice never fails a copy.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import re
import sys
from pathlib import Path

import torch

__all__ = ["HUGE_PAGE_NBYTES", "MIN_ADVISED_NBYTES", "THP_MODE_PATH", "THP_VAR", "advise_huge_pages",
           "kernel_mode", "wanted"]

HUGE_PAGE_NBYTES = 2 << 20
"""A transparent huge page on x86-64 and arm64 with 4 KiB base pages."""
MIN_ADVISED_NBYTES = 2 * HUGE_PAGE_NBYTES
"""Smaller tensors are left alone (a system call for at most one huge page)."""
THP_VAR = "THP_MEM_ALLOC_ENABLE"
"""PyTorch's switch for transparent huge pages in its CPU allocator (``c10/core/alloc_cpu.cpp``)."""
THP_MODE_PATH = Path("/sys/kernel/mm/transparent_hugepage/enabled")
"""Where Linux says its THP mode."""
_MADV_HUGEPAGE = 14  # <asm-generic/mman-common.h>


def kernel_mode() -> str | None:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``), or ``None`` where it has none."""
    try:
        match = re.search(r"\[(\w+)\]", THP_MODE_PATH.read_text())
    except OSError:
        return None
    return match.group(1) if match else None


def wanted(environ: os._Environ[str] | dict[str, str] | None = None) -> bool:
    """Whether huge pages are asked for: on Linux, unless ``THP_MEM_ALLOC_ENABLE`` is ``0`` (see [Note: huge
    pages for fresh tensors])."""
    value = (os.environ if environ is None else environ).get(THP_VAR)
    return sys.platform.startswith("linux") and (value is None or value.strip() != "0")


@functools.cache
def _madvise():
    """libc's ``madvise``, or ``None`` where it cannot be loaded."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """Ask for huge pages for the memory of ``tensor``'s storage, before its first write.

    Returns:
        The bytes advised: 0 for a tensor not on a CPU, smaller than :data:`MIN_ADVISED_NBYTES`, without a
        2 MiB-aligned huge page inside its bytes, where huge pages are not :func:`wanted`, or where the call
        failed.
    """
    if tensor.device.type != "cpu" or not wanted():
        return 0
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes()
    if nbytes < MIN_ADVISED_NBYTES:
        return 0
    madvise = _madvise()
    if madvise is None:
        return 0
    start = storage.data_ptr()
    lo = -(-start // HUGE_PAGE_NBYTES) * HUGE_PAGE_NBYTES
    hi = (start + nbytes) // HUGE_PAGE_NBYTES * HUGE_PAGE_NBYTES
    if hi <= lo:
        return 0
    return hi - lo if madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0 else 0
