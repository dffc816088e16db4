from __future__ import annotations

import time

import pytest
import torch

from hybridmem import HostMemoryBudgetError
from hybridmem.accel import get_accelerator
from hybridmem.offload import (
    GradOffloader,
    OffloadState,
    OptimizerStateOffloader,
    ParamOffloader,
)
from hybridmem.offload.host_pool import HostBufferPool
from hybridmem.testing.tiny import assert_bitwise_equal, snapshot, train_step


def _offloaders(model, opt, device, *, budget=None):
    accel = get_accelerator(device)
    pool = HostBufferPool(accel, budget_nbytes=budget)
    return pool, [OptimizerStateOffloader(opt, accel, pool), GradOffloader(model, accel, pool),
                  ParamOffloader(model, accel, pool)]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_round_trip_is_bitwise_and_frees_every_storage(tiny_setup, device, optimizer):
    model, opt = tiny_setup(device, optimizer)
    for step in range(2):
        train_step(model, opt, step)
    before = snapshot(model, opt)
    assert any(k.startswith("opt:") for k in before) and any(k.startswith("grad:") for k in before)
    pool, offs = _offloaders(model, opt, device)
    ids = {k: id(t) for k, t in [*model.named_parameters(), *model.named_buffers()]}
    for o in offs:
        o.offload()
        assert o.state is OffloadState.ON_HOST
    for t in [*model.parameters(), *model.buffers()]:
        assert t.untyped_storage().nbytes() == 0
        assert t.grad is None or t.grad.untyped_storage().nbytes() == 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.device.type == device:
                assert v.untyped_storage().nbytes() == 0
    for o in reversed(offs):
        o.onload()
    assert_bitwise_equal(before, snapshot(model, opt))
    assert ids == {k: id(t) for k, t in [*model.named_parameters(), *model.named_buffers()]}, (
        "tensor objects replaced")


def test_tied_weight_and_views_move_once():
    accel = get_accelerator("cpu")
    pool = HostBufferPool(accel)
    base = torch.nn.Parameter(torch.randn(8, 4))
    view = base[2:5]
    module = torch.nn.Module()
    module.w = base

    class Holder(ParamOffloader):
        def tensors(self):
            yield from (base, view, base)

    off = Holder(module, accel, pool)
    stats = off.offload()
    assert stats.num_storages == 1 and stats.copied_nbytes == 8 * 4 * 4
    assert view.untyped_storage().nbytes() == 0
    off.onload()
    assert torch.equal(view, base[2:5])


def test_zero_and_none_grads_cost_no_copy():
    accel = get_accelerator("cpu")
    pool = HostBufferPool(accel)
    a, b, c = (torch.nn.Parameter(torch.randn(16)) for _ in range(3))
    a.grad = torch.zeros(16)
    b.grad = torch.randn(16)
    c.grad = None
    off = GradOffloader([a, b, c], accel, pool)
    s = off.offload()
    assert (s.num_storages, s.copied_nbytes, s.zero_nbytes) == (2, 64, 64)
    assert pool.held_nbytes("grad") == 64  # the zero grad takes no host bytes
    assert a.grad.untyped_storage().nbytes() == 0 and b.grad.untyped_storage().nbytes() == 0
    b_host = pool.arena("grad", torch.float32, 16).clone()
    s = off.onload()
    assert (s.copied_nbytes, s.zero_nbytes) == (64, 64)
    assert torch.equal(a.grad, torch.zeros(16)) and torch.equal(b.grad, b_host) and c.grad is None


def test_negative_zero_grad_is_copied_not_rezeroed():
    accel = get_accelerator("cpu")
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), -0.0)
    off = GradOffloader([p], accel, HostBufferPool(accel))
    assert off.offload().copied_nbytes == 16
    off.onload()
    assert torch.signbit(p.grad).all(), "-0.0 must come back as -0.0"


def test_skip_zero_off_copies_zero_grads():
    accel = get_accelerator("cpu")
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.zeros(4)
    off = GradOffloader([p], accel, HostBufferPool(accel), skip_zero=False)
    assert off.offload().copied_nbytes == 16


def test_offload_and_onload_twice_are_noops(tiny_setup):
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    accel = get_accelerator("cpu")
    off = ParamOffloader(model, accel, HostBufferPool(accel))
    assert off.onload().copied_nbytes == 0  # already on device
    first = off.offload()
    assert first.copied_nbytes > 0 and off.offload().copied_nbytes == 0
    assert off.onload().copied_nbytes == first.copied_nbytes and off.onload().copied_nbytes == 0


def test_budget_error_leaves_device_state_intact(tiny_setup):
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    _, (opt_off, _, _) = _offloaders(model, opt, "cpu", budget=100)
    with pytest.raises(HostMemoryBudgetError):
        opt_off.offload()
    assert opt_off.state is OffloadState.ON_DEVICE
    assert_bitwise_equal(before, snapshot(model, opt))


def test_onload_oom_halfway_frees_what_it_took_and_keeps_host_copy(tiny_setup, monkeypatch):
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    _, (_, _, param_off) = _offloaders(model, opt, "cpu")
    param_off.offload()
    real_resize = torch.UntypedStorage.resize_
    calls = {"n": 0}

    def flaky_resize(self, nbytes):
        if nbytes > 0:
            calls["n"] += 1
            if calls["n"] == 3:
                raise torch.OutOfMemoryError("injected OOM on the third storage")
        return real_resize(self, nbytes)

    monkeypatch.setattr(torch.UntypedStorage, "resize_", flaky_resize)
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        param_off.onload()
    assert param_off.state is OffloadState.ON_HOST
    assert param_off.resident_nbytes() == 0, "storages allocated before the failure were not freed"
    monkeypatch.setattr(torch.UntypedStorage, "resize_", real_resize)
    param_off.onload()
    assert_bitwise_equal(before, snapshot(model, opt))


def test_stats_split_the_time_between_copies_and_device_memory(tiny_setup, monkeypatch):
    """An offload's ``device_memory_s`` is its frees and an onload's its allocations, ``copy_s`` its copies:
    with each ``resize_`` made 20 ms slower on purpose, the slowdown lands in ``device_memory_s`` alone."""
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    _, (_, _, param_off) = _offloaders(model, opt, "cpu")
    real_resize = torch.UntypedStorage.resize_
    delay = 0.02

    def slow_resize(self, nbytes):
        time.sleep(delay)
        return real_resize(self, nbytes)

    monkeypatch.setattr(torch.UntypedStorage, "resize_", slow_resize)
    for stats in (param_off.offload(), param_off.onload()):
        floor = delay * stats.num_storages
        assert stats.num_storages > 1 and stats.device_memory_s >= floor, stats
        assert stats.copy_s < floor / 2 and stats.copy_s + stats.device_memory_s <= stats.seconds, stats


def test_optimizer_state_created_after_first_offload_grows_arena(tiny_setup):
    model, opt = tiny_setup(optimizer="adamw")
    accel = get_accelerator("cpu")
    pool = HostBufferPool(accel)
    off = OptimizerStateOffloader(opt, accel, pool)
    assert off.offload().copied_nbytes == 0  # no state before the first step
    off.onload()
    train_step(model, opt, 0)
    moved = off.offload().copied_nbytes
    num_params = sum(p.numel() for p in model.parameters())
    # AdamW: exp_avg + exp_avg_sq (fp32) per element, plus a 4-byte step per parameter tensor.
    assert moved == num_params * 8 + 4 * len(list(model.parameters()))
    off.onload()
    assert pool.held_nbytes("optimizer") == moved
