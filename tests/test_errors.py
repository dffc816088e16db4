"""Errors a user catches by the documented name, also when they happen inside a switch."""

from __future__ import annotations

import pytest
import torch

from hybridmem import (
    HostMemoryBudgetError,
    HostMemoryPlanError,
    HybridConfig,
    MemoryPlanError,
    Phase,
    ShardingManager,
    SwitchError,
    WeightSyncError,
)
from hybridmem.engines import TorchCopyEngine
from hybridmem.testing.tiny import assert_bitwise_equal, snapshot, train_step


def _trained(tiny_setup):
    model, opt = tiny_setup("cpu", "adamw")
    train_step(model, opt, 0)
    return model, opt


def _over_the_host_budget(tiny_setup):
    """A manager whose host budget holds the optimizer's arena and not the grads' as well."""
    model, opt = _trained(tiny_setup)
    numel = sum(p.numel() for p in model.parameters())
    # Adam state: exp_avg + exp_avg_sq (4 bytes each) and a 4-byte step per tensor.
    opt_nbytes = 8 * numel + 4 * len(list(model.parameters()))
    config = HybridConfig(host_memory_budget_bytes=opt_nbytes + 1024, skip_zero_grads=False)
    before = snapshot(model, opt)
    manager = ShardingManager(model, TorchCopyEngine(model, kv_cache_nbytes=1024), optimizer=opt,
                              config=config)
    # The arenas are prewarmed in a background thread from construction on: on a loaded machine it may still
    # be growing them when the test reads what the pool holds.
    assert manager.pool.wait_prewarmed(timeout=120), "the host arenas were not prewarmed in 120 s"
    return model, opt, manager, before, numel, opt_nbytes


def test_a_switch_over_the_host_budget_is_refused_before_its_first_step(tiny_setup):
    """The memory plan foresees the grads' arena (fp32, one element per parameter) over the budget: the
    switch is refused with the plan before anything moves, as a HostMemoryBudgetError too."""
    model, opt, manager, before, numel, opt_nbytes = _over_the_host_budget(tiny_setup)
    held = manager.pool.held_nbytes()
    with pytest.raises(HostMemoryBudgetError) as info:
        manager.to_infer()
    err = info.value
    assert isinstance(err, HostMemoryPlanError) and isinstance(err, MemoryPlanError)
    assert not isinstance(err, SwitchError)
    assert (err.key == "offload grad" and err.requested_nbytes == 4 * numel
            and err.budget_nbytes == opt_nbytes + 1024)
    assert not err.plan.host_fits and err.plan.device_fits and "offload grad" in str(err)
    assert "host_memory_budget_bytes" in str(err) and "DOES NOT FIT" in str(err)
    assert manager.phase is Phase.TRAIN and manager.pool.held_nbytes() == held
    assert not any(manager.pool.is_held(owner) for owner in ("optimizer", "grad", "param"))
    assert_bitwise_equal(before, snapshot(model, opt))


def test_host_budget_overflow_in_a_switch_is_a_host_memory_budget_error_naming_the_step(
        tiny_setup, monkeypatch):
    """When the plan misses the arenas' growth (here: forced to), the offload that overflows fails and the
    done steps are undone."""
    from hybridmem.offload import Offloader

    model, opt, manager, before, numel, opt_nbytes = _over_the_host_budget(tiny_setup)
    monkeypatch.setattr(Offloader, "arena_growth_nbytes", lambda self: 0)
    with pytest.raises(HostMemoryBudgetError) as info:
        manager.to_infer()
    err = info.value
    assert isinstance(err, SwitchError) and isinstance(err, MemoryError)
    assert err.step == "offload grad" and err.direction == "to_infer" and err.phase_after is Phase.TRAIN
    assert err.budget_nbytes == opt_nbytes + 1024 and err.requested_nbytes == 4 * numel
    assert "'offload grad' failed" in str(err) and "Rolled back (offload grad, offload optimizer)" in str(err)
    assert isinstance(err.__cause__, HostMemoryBudgetError) and not isinstance(err.__cause__, SwitchError)
    assert manager.phase is Phase.TRAIN
    assert_bitwise_equal(before, snapshot(model, opt))


def test_a_budget_overflow_outside_a_switch_is_the_plain_class():
    from hybridmem.accel import get_accelerator
    from hybridmem.offload.host_pool import HostBufferPool

    pool = HostBufferPool(get_accelerator("cpu"), budget_nbytes=16)
    with pytest.raises(HostMemoryBudgetError) as info:
        pool.arena("param", torch.float32, 5)
    assert type(info.value) is HostMemoryBudgetError and info.value.requested_nbytes == 20


def test_a_checksum_mismatch_in_a_switch_is_a_weight_sync_error(tiny_setup, monkeypatch):
    model, opt = _trained(tiny_setup)
    before = snapshot(model, opt)
    manager = ShardingManager(model, TorchCopyEngine(model, kv_cache_nbytes=1024), optimizer=opt)

    def mismatch():
        raise WeightSyncError("checksum of 'fc1.weight' differs")

    monkeypatch.setattr(manager.weight_sync, "sync", mismatch)
    with pytest.raises(WeightSyncError) as info:
        manager.to_infer()
    assert isinstance(info.value, SwitchError) and info.value.step == "weight sync"
    assert "fc1.weight" in str(info.value) and "Rolled back" in str(info.value)
    assert manager.phase is Phase.TRAIN
    assert_bitwise_equal(before, snapshot(model, opt))


def test_other_step_errors_stay_plain_switch_errors(tiny_setup, monkeypatch):
    model, opt = _trained(tiny_setup)
    manager = ShardingManager(model, TorchCopyEngine(model, kv_cache_nbytes=1024), optimizer=opt)

    def boom():
        raise RuntimeError("boom")

    monkeypatch.setattr(manager.weight_sync, "sync", boom)
    with pytest.raises(SwitchError) as info:
        manager.to_infer()
    assert type(info.value) is SwitchError and not isinstance(info.value, (MemoryError, WeightSyncError))


def test_unwritten_adapters_are_named_as_adapters_not_as_another_architecture():
    from hybridmem.errors import WeightCoverageError

    adapter = str(WeightCoverageError(
        ["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"]))
    assert "LoRA slots" in adapter and "another architecture" not in adapter
    assert "another architecture" in str(WeightCoverageError(["model.layers.0.mlp.down_proj.weight"]))
