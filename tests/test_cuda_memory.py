"""CUDA versions of the memory tests: allocator byte counts and mem_get_info (skipped without a GPU)."""

from __future__ import annotations

import gc

import pytest
import torch

from hybridmem import HybridConfig, ShardingManager
from hybridmem.accel import get_accelerator
from hybridmem.offload import ParamOffloader
from hybridmem.offload.host_pool import HostBufferPool
from hybridmem.testing.tiny import assert_bitwise_equal, snapshot

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _clean_device():
    """Each test starts from an empty caching allocator: a model an earlier test left in a reference cycle
    (or in a failed test's traceback) is freed by the collector at an unknown time otherwise, in the middle
    of this test's figures."""
    gc.collect()
    torch.cuda.empty_cache()
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _model_with_state(num_layers: int = 8, dim: int = 2048):
    """``num_layers`` bias-free ``dim x dim`` fp32 layers with grads and one AdamW step. At the default
    ``dim`` each tensor is 16 MiB: the caching allocator gives every tensor over 10 MiB a segment of its
    own, so freeing the tensors gives whole segments back to the device. (Tensors of 1-10 MiB share 20 MiB
    segments, which go back only once every tensor in them is freed: a live tensor of another owner in the
    last segment keeps the segment's offloaded tensors' bytes from ``mem_get_info``.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(dim, dim, bias=False) for _ in range(num_layers))).cuda()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # step counters stay on the CPU (capturable=False)
    opt.step()
    torch.cuda.synchronize()
    return model, opt


def test_offload_frees_exactly_the_formula_and_returns_it_to_the_device():
    torch.cuda.empty_cache()
    model, opt = _model_with_state()
    before = snapshot(model, opt)
    per_tensor = 2048 * 2048 * 4
    expected = 8 * per_tensor * (1 + 1 + 2)  # params, grads, exp_avg + exp_avg_sq
    mgr = ShardingManager(model, optimizer=opt, accel=get_accelerator("cuda"),
                          config=HybridConfig(skip_zero_grads=False))
    alloc0 = torch.cuda.memory_allocated()
    free0 = torch.cuda.mem_get_info()[0]
    report = mgr.to_infer()
    assert alloc0 - torch.cuda.memory_allocated() == expected == report.copied_nbytes
    freed = torch.cuda.mem_get_info()[0] - free0
    assert freed >= 0.99 * expected, (
        f"only {freed / MIB:.1f} MiB of {expected / MIB:.1f} MiB returned to the device")
    assert report.peak_source == "allocator" and report.device_peak_nbytes <= alloc0
    mgr.to_train()
    assert torch.cuda.memory_allocated() == alloc0
    assert_bitwise_equal(before, snapshot(model, opt))


def test_cycles_keep_allocator_figures_flat():
    model, opt = _model_with_state(num_layers=4)
    mgr = ShardingManager(model, optimizer=opt, accel=get_accelerator("cuda"))
    mgr.to_infer()
    mgr.to_train()
    alloc, reserved, host = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(),
                             mgr.pool.held_nbytes())
    for _ in range(50):
        mgr.to_infer()
        mgr.to_train()
        assert (torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), mgr.pool.held_nbytes()) == (
            alloc, reserved, host)


def test_offload_waits_for_pending_writes_on_the_compute_stream():
    accel = get_accelerator("cuda")
    p = torch.nn.Parameter(torch.zeros(1 << 22, device="cuda"))
    module = torch.nn.Module()
    module.p = p
    off = ParamOffloader(module, accel, HostBufferPool(accel))
    torch.cuda._sleep(200_000_000)  # keep the compute stream busy so a racing copy would read zeros
    with torch.no_grad():
        p.fill_(7.0)
    off.offload()
    off.onload()
    assert bool((p == 7.0).all()), "the device->host copy ran before the pending write"


def test_host_arenas_are_pinned_and_reused():
    model, opt = _model_with_state(num_layers=2)
    mgr = ShardingManager(model, optimizer=opt, accel=get_accelerator("cuda"))
    for _ in range(3):
        mgr.to_infer()
        mgr.to_train()
    infos = mgr.pool.report()
    assert infos and all(i.pinned and i.num_grows == 1 for i in infos)


def test_residency_shows_device_memory_outside_the_allocator_as_unexplained():
    """Bytes taken with ``cudaMalloc`` behind torch's back appear in ``unexplained_nbytes``, not in an owner.

    The reference is the allocation itself: its size is known independently of hybridmem's accounting.
    """
    model, opt = _model_with_state(num_layers=2)
    mgr = ShardingManager(model, optimizer=opt, accel=get_accelerator("cuda"))
    mgr.to_infer()
    base = mgr.residency()
    assert base.device_used_nbytes is not None and base.unexplained_nbytes is not None
    assert 0 < base.unexplained_nbytes < 4 << 30, (
        f"CUDA context and friends: {base.unexplained_nbytes / MIB:.0f} MiB")
    outside = 256 * MIB
    driver = pytest.importorskip("cuda.bindings.driver")
    err, ptr = driver.cuMemAlloc(outside)  # in torch's current (primary) context, outside its allocator
    assert err == driver.CUresult.CUDA_SUCCESS, err
    try:
        grown = mgr.residency()
        delta = grown.unexplained_nbytes - base.unexplained_nbytes
        assert outside <= delta <= outside + 4 * MIB, (
            f"{delta / MIB:.1f} MiB appeared for a {outside / MIB:.0f} MiB malloc")
        assert grown.owned_nbytes == base.owned_nbytes
    finally:
        driver.cuMemFree(ptr)
    mgr.to_train()
