from __future__ import annotations

import pytest
import torch

from hybridmem import HostMemoryBudgetError
from hybridmem.accel import get_accelerator
from hybridmem.host_pool import HostBufferPool


def test_arena_is_reused_while_large_enough():
    pool = HostBufferPool(get_accelerator("cpu"))
    a = pool.arena("param", torch.float32, 100)
    assert pool.arena("param", torch.float32, 100) is a
    assert pool.arena("param", torch.float32, 10) is a
    assert pool.held_nbytes() == 400


def test_arenas_are_keyed_by_owner_and_dtype():
    pool = HostBufferPool(get_accelerator("cpu"))
    pool.arena("param", torch.bfloat16, 8)
    pool.arena("param", torch.float32, 8)
    pool.arena("grad", torch.float32, 8)
    assert pool.held_nbytes() == 16 + 32 + 32
    assert pool.held_nbytes("param") == 48
    assert [(i.owner, i.dtype, i.nbytes) for i in pool.report()] == [
        ("grad", "torch.float32", 32), ("param", "torch.bfloat16", 16), ("param", "torch.float32", 32)]


def test_growth_replaces_and_counts():
    pool = HostBufferPool(get_accelerator("cpu"))
    a = pool.arena("optimizer", torch.float32, 4)
    b = pool.arena("optimizer", torch.float32, 40)
    assert b is not a and b.numel() == 40 and pool.held_nbytes() == 160
    assert pool.report()[0].num_grows == 2


def test_budget_error_names_figures_and_changes_nothing():
    pool = HostBufferPool(get_accelerator("cpu"), budget_nbytes=100)
    a = pool.arena("param", torch.float32, 20)  # 80 bytes
    with pytest.raises(HostMemoryBudgetError) as info:
        pool.arena("grad", torch.float32, 10)  # 40 more: 120 > 100
    msg = str(info.value)
    assert "grad/torch.float32" in msg and "40 bytes" in msg and "80 bytes" in msg and "=100" in msg
    assert pool.held_nbytes() == 80 and pool.arena("param", torch.float32, 20) is a
    # Growing an arena counts its own old bytes as released.
    assert pool.arena("param", torch.float32, 25).numel() == 25


def test_free_drops_arenas():
    pool = HostBufferPool(get_accelerator("cpu"))
    pool.arena("param", torch.float32, 4)
    pool.arena("grad", torch.float32, 4)
    assert pool.free("grad") == 16 and pool.held_nbytes() == 16
    assert pool.free() == 16 and pool.held_nbytes() == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_arenas_are_pinned():
    pool = HostBufferPool(get_accelerator("cuda"))
    assert pool.arena("param", torch.float32, 1024).is_pinned()
    assert pool.report()[0].pinned
