from __future__ import annotations

import pytest
import torch

from hybridmem import HostMemoryBudgetError, ShardingManager
from hybridmem.accel import get_accelerator
from hybridmem.engines import TorchCopyEngine
from hybridmem.offload.host_pool import HostBufferPool
from hybridmem.testing.tiny import assert_bitwise_equal, snapshot, train_step


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


# [Note: offload journal] in :mod:`hybridmem.offload.base`: a held arena holds the only copy of offloaded
# bytes, so a request that would replace it (a larger one) must be refused, not served with a fresh arena.
def test_a_held_arena_is_not_replaced_by_a_larger_request():
    pool = HostBufferPool(get_accelerator("cpu"))
    arena = pool.arena("param", torch.float32, 4)
    arena.copy_(torch.tensor([1.0, -0.0, float("nan"), 3.5]))
    kept = arena.clone()
    pool.hold("param")
    with pytest.raises(RuntimeError, match=r"param/torch.float32 holds the only copy.*8 elements"):
        pool.arena("param", torch.float32, 8)
    assert pool.arena("param", torch.float32, 4) is arena, "the held arena was replaced"
    assert torch.equal(arena.view(torch.uint8), kept.view(torch.uint8)), "the held bytes changed"
    assert pool.held_nbytes() == 16 and pool.report()[0].num_grows == 1
    # Other owners still grow; once released, the owner's arena grows as usual.
    assert pool.arena("grad", torch.float32, 8).numel() == 8
    pool.unhold("param")
    assert pool.arena("param", torch.float32, 8).numel() == 8


def test_inside_infer_held_arenas_refuse_to_grow_and_onload_restores_bitwise(tiny_setup, device):
    model, opt = tiny_setup(device)
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    mgr = ShardingManager(model, TorchCopyEngine(model, kv_cache_nbytes=1 << 16), optimizer=opt)
    mgr.to_infer()
    held = [(info.owner, getattr(torch, info.dtype.removeprefix("torch."))) for info in mgr.pool.report()
            if mgr.pool.is_held(info.owner)]
    assert {owner for owner, _ in held} >= {"param", "optimizer"}, mgr.pool.report()
    for owner, dtype in held:
        arena = mgr.pool.arena(owner, dtype, 0)
        kept = arena.clone()
        with pytest.raises(RuntimeError, match="only copy of offloaded bytes"):
            mgr.pool.arena(owner, dtype, arena.numel() + 1)
        assert mgr.pool.arena(owner, dtype, 0) is arena, f"held arena {owner}/{dtype} was replaced"
        assert torch.equal(arena.view(torch.uint8), kept.view(torch.uint8)), f"{owner}/{dtype} bytes changed"
    mgr.to_train()
    assert_bitwise_equal(before, snapshot(model, opt))


def test_an_arena_being_prewarmed_counts_for_the_memory_plan():
    """What a switch's host plan starts from: held arenas plus those being prewarmed; an owner's arena is
    the larger of the two."""
    import threading

    from hybridmem.accel import CpuAccelerator

    release = threading.Event()

    class Slow(CpuAccelerator):
        def alloc_host(self, numel, dtype, *, pin):
            if threading.current_thread().name == "hybridmem-prewarm":
                release.wait(5)
            return super().alloc_host(numel, dtype, pin=pin)

    pool = HostBufferPool(Slow())
    pool.arena("grad", torch.float32, 10)  # 40 bytes held
    pool.prewarm([("param", torch.float32, 100)])  # 400 bytes pending
    assert (pool.arena_nbytes("param", torch.float32), pool.arena_nbytes("grad", torch.float32)) == (400, 40)
    assert (pool.reserved_nbytes(), pool.held_nbytes(),
            pool.arena_nbytes("param", torch.bfloat16)) == (440, 40, 0)
    release.set()
    pool.wait_prewarmed(5)
    assert pool.reserved_nbytes() == pool.held_nbytes() == 440
