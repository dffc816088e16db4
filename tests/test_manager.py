from __future__ import annotations

import gc
import json

import pytest
import torch

from hybridmem import (
    Direction,
    HybridConfig,
    MemoryPlanError,
    Phase,
    PhaseError,
    RollbackError,
    ShardingManager,
    SwitchError,
)
from hybridmem.accel import CpuAccelerator
from hybridmem.engines import TorchCopyEngine
from hybridmem.offload import OffloadState
from hybridmem.testing.tiny import (
    TinyNet,
    assert_bitwise_equal,
    make_batch,
    snapshot,
    train_step,
)

KV_NBYTES = 1 << 16


def _manager(model, opt, *, config=None, kv=KV_NBYTES, accel=None):
    engine = TorchCopyEngine(model, kv_cache_nbytes=kv)
    return ShardingManager(model, engine, optimizer=opt, config=config, accel=accel), engine


def _device_storages(model, opt):
    """The storages of the model's and optimizer's tensors on the model's device (AdamW's ``step`` stays
    on the CPU beside CUDA parameters, where it is no device memory to free)."""
    device = next(model.parameters()).device
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    for state in opt.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    yield from (t.untyped_storage() for t in tensors if t.device == device)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_three_switches_round_trip_bitwise(tiny_setup, device, optimizer):
    model, opt = tiny_setup(device, optimizer)
    for step in range(2):
        train_step(model, opt, step)
    before = snapshot(model, opt)
    mgr, _ = _manager(model, opt)
    for _ in range(3):
        with mgr.inference():
            assert mgr.phase is Phase.INFER
        assert mgr.phase is Phase.TRAIN
    assert_bitwise_equal(before, snapshot(model, opt))


def test_inside_inference_every_offloaded_storage_is_empty(tiny_setup, device):
    model, opt = tiny_setup(device)
    train_step(model, opt, 0)
    mgr, engine = _manager(model, opt)
    with mgr.inference() as eng:
        assert eng is engine
        storages = list(_device_storages(model, opt))
        assert storages and all(s.nbytes() == 0 for s in storages)
        assert set(mgr.offload_states().values()) == {OffloadState.ON_HOST}
    assert mgr.phase is Phase.TRAIN and all(s.nbytes() > 0 for s in _device_storages(model, opt))


def test_engine_output_equals_training_model_output(tiny_setup):
    model, opt = tiny_setup()
    for step in range(3):
        train_step(model, opt, step)
    tokens, _ = make_batch(7, "cpu")
    with torch.no_grad():
        expected = model(tokens)
    mgr, _ = _manager(model, opt)
    with mgr.inference() as engine:
        got = engine(tokens)
    assert torch.equal(got, expected)


def test_training_with_a_switch_between_every_step_matches_training_without(tiny_setup, device):
    def run(switch: bool) -> list[float]:
        model, opt = tiny_setup(device, "adamw", seed=3)
        mgr, _ = _manager(model, opt)
        losses = []
        for step in range(8):
            losses.append(train_step(model, opt, step))
            if switch:
                with mgr.inference() as engine:
                    engine(make_batch(step, device)[0])
        return losses

    plain, switched = run(False), run(True)
    assert switched == plain, "losses differ bit for bit"
    assert plain[-1] < plain[0]


def _rss_nbytes() -> int:
    """Resident set size of this process as the kernel reports it (VmRSS, /proc/self/status)."""
    line = next(entry for entry in open("/proc/self/status") if entry.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_cycles_do_not_grow_process_or_device_memory(tiny_setup, device):
    # Measured by the OS, not by hybridmem's counters: process RSS, and on CUDA the driver's free bytes.
    # TinyNet's params + grads + Adam state are about 0.1 MiB, so keeping one host or device copy per
    # cycle would grow these figures by 30 MiB over the 300 cycles.
    model, opt = tiny_setup(device)
    train_step(model, opt, 0)
    mgr, _ = _manager(model, opt)
    state_nbytes = sum(4 * p.numel() for p in model.parameters()) * 4
    assert 300 * state_nbytes > 24 << 20, (
        "the model is too small for the bound below to catch a per-cycle leak")
    for _ in range(20):  # warm-up: arenas, allocator caches, lazily imported code
        mgr.to_infer()
        mgr.to_train()
    gc.collect()
    rss0 = _rss_nbytes()
    free0 = torch.cuda.mem_get_info()[0] if device == "cuda" else None
    for _ in range(300):
        mgr.to_infer()
        mgr.to_train()
    gc.collect()
    growth = _rss_nbytes() - rss0
    assert growth < 4 << 20, f"RSS grew by {growth / 2**20:.1f} MiB over 300 cycles"
    if free0 is not None:
        drop = free0 - torch.cuda.mem_get_info()[0]
        assert drop <= 2 << 20, f"device free memory dropped by {drop / 2**20:.1f} MiB over 300 cycles"
    assert all(a.num_grows == 1 for a in mgr.pool.report()), "an arena was reallocated after the first switch"


def test_bytes_moved_and_freed_match_formulas(tiny_setup):
    model, opt = tiny_setup(optimizer="adamw")
    train_step(model, opt, 0)
    mgr, _ = _manager(model, opt)
    unique = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
              for t in [*model.parameters(), *model.buffers()]}
    param_nbytes = sum(unique.values())
    n_tensors = len(list(model.parameters()))
    grad_nbytes = sum(p.numel() * 4 for p in model.parameters())
    # exp_avg, exp_avg_sq, step
    opt_nbytes = 2 * sum(p.numel() * 4 for p in model.parameters()) + 4 * n_tensors
    report = mgr.to_infer()
    assert report.bytes_by_kind["param"] == param_nbytes
    assert report.bytes_by_kind["grad"] == grad_nbytes
    assert report.bytes_by_kind["optimizer"] == opt_nbytes
    # The engine's copy holds the same unique storages as the training model.
    before, after = param_nbytes + grad_nbytes + opt_nbytes, param_nbytes + KV_NBYTES
    assert (report.device_before_nbytes, report.device_after_nbytes) == (before, after)
    # Peak: the start, or training params + engine weights during the weight sync, or the end.
    assert report.device_peak_nbytes == max(before, 2 * param_nbytes, after)
    assert report.host_nbytes == param_nbytes + grad_nbytes + opt_nbytes
    assert report.plan.peak_nbytes == report.device_peak_nbytes, str(report.plan)
    back = mgr.to_train()
    assert back.device_after_nbytes == report.device_before_nbytes
    assert back.bytes_by_kind == {"param": param_nbytes, "grad": grad_nbytes, "optimizer": opt_nbytes,
                                  "kv_cache": 0, "engine_weights": 0}


def test_zero_grads_are_not_copied(tiny_setup):
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    opt.zero_grad(set_to_none=False)
    mgr, _ = _manager(model, opt)
    report = mgr.to_infer()
    grad_step = next(s for s in report.steps if s.name == "offload grad")
    assert grad_step.copied_nbytes == 0 and grad_step.zero_nbytes == sum(
        p.numel() * 4 for p in model.parameters())
    mgr.to_train()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def test_residency_report_in_infer(tiny_setup):
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    mgr, engine = _manager(model, opt, config=HybridConfig(offload_train_grad=False))
    report = mgr.to_infer()
    res = report.residency
    assert res.phase is Phase.INFER
    assert res.by_owner["train param"] == 0 and res.by_owner["optimizer"] == 0
    assert res.by_owner["train grad"] == sum(p.numel() * 4 for p in model.parameters())  # not offloaded: kept
    assert res.by_owner["engine weights"] == engine.planned_nbytes("weights")
    assert res.by_owner["kv cache"] == KV_NBYTES
    assert res.leftovers == {}, "grads were not asked to be offloaded, so they are no leftover"
    assert "train grad" in str(res)
    assert res.device_used_nbytes is None and res.unexplained_nbytes is None, "CPU cannot read a device"
    mgr.to_train()


def test_report_prints_as_table_and_serialises_to_json(tiny_setup):
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    mgr, _ = _manager(model, opt)
    with mgr.inference():
        pass
    to_infer, to_train = mgr.last_reports[Direction.TO_INFER], mgr.last_reports[Direction.TO_TRAIN]
    assert mgr.last_report is to_train
    text = str(to_infer)
    for name in ("offload optimizer", "offload grad", "resume engine weights", "weight sync", "offload param",
                 "resume engine kv_cache", "TRAIN -> INFER"):
        assert name in text
    assert text.isascii()
    data = json.loads(to_infer.to_json())
    assert [s["name"] for s in data["steps"]] == [s.name for s in to_infer.steps]
    assert data["bytes_by_kind"]["optimizer"] > 0 and data["residency"]["phase"] == "INFER"
    assert json.loads(to_train.to_json())["direction"] == "to_train"


def test_step_order_is_declared(tiny_setup):
    model, opt = tiny_setup()
    mgr, _ = _manager(model, opt)
    assert [s.name for s in mgr.steps(Direction.TO_INFER)] == [
        "offload optimizer", "offload grad", "resume engine weights", "weight sync", "offload param",
        "empty cache", "resume engine kv_cache"]
    assert [s.name for s in mgr.steps(Direction.TO_TRAIN)] == [
        "release engine kv_cache", "release engine weights", "onload param", "onload grad",
        "onload optimizer"]
    mgr.close()  # one manager per model: let the model go before building another on it
    off = ShardingManager(model, optimizer=opt, config=HybridConfig(offload_train_param=False))
    assert [s.name for s in off.steps(Direction.TO_INFER)] == [
        "offload optimizer", "offload grad", "empty cache"]


def test_a_dropped_manager_in_train_lets_its_model_go_without_the_cycle_collector(tiny_setup):
    """The claim must not wait for gc: another thread's collection makes the main thread's gc.collect() a
    no-op on CPython 3.11 (tests/users/programs/rebuilds_a_dropped_manager.py shows it in a program)."""
    import weakref

    model, opt = tiny_setup()
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    enabled = gc.isenabled()
    gc.disable()
    try:
        first, _ = _manager(model, opt)
        with first.inference():
            pass
        dropped = weakref.ref(first)
        del first
        assert dropped() is None, "a manager in TRAIN sits in a reference cycle"
        second, engine = _manager(model, opt)
        second.to_infer()
        kept = weakref.ref(second)
        del second
        gc.collect()
        # Outside TRAIN the manager holds the only copy of the model's bytes: the model keeps it.
        assert kept() is not None and kept().phase is Phase.INFER
        with pytest.raises(ValueError, match=r"already managed by ShardingManager\(phase=INFER"):
            ShardingManager(model, engine, optimizer=opt)
        kept().to_train()
    finally:
        if enabled:
            gc.enable()
    assert_bitwise_equal(before, snapshot(model, opt))


# Illegal use ---------------------------------------------------------------------------------------
def test_nested_and_out_of_order_use_names_the_phase(tiny_setup):
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    mgr, _ = _manager(model, opt)
    with pytest.raises(PhaseError, match="switch to TRAIN: the manager is in phase TRAIN"):
        mgr.to_train()
    with pytest.raises(PhaseError, match="recover: the manager is in phase TRAIN"):
        mgr.recover()
    with pytest.raises(PhaseError, match="switch to INFER: the manager is in phase INFER"):
        with mgr.inference():
            with mgr.inference():
                pass
    assert mgr.phase is Phase.TRAIN
    mgr.to_infer()
    with pytest.raises(PhaseError, match="phase INFER"):
        mgr.to_infer()
    with pytest.raises(PhaseError, match="close: the manager is in phase INFER"):
        mgr.close()
    mgr.to_train()
    assert_bitwise_equal(before, snapshot(model, opt))


def test_engine_refuses_work_outside_infer_naming_the_managers_phase(tiny_setup):
    model, opt = tiny_setup()
    mgr, engine = _manager(model, opt)
    with pytest.raises(PhaseError, match=r"phase TRAIN.*inside `with manager.inference\(\)`") as info:
        engine(make_batch(0, "cpu")[0])
    assert info.value.current is Phase.TRAIN
    with mgr.inference():
        pass
    with pytest.raises(PhaseError, match="phase TRAIN"):  # used after the block
        engine(make_batch(0, "cpu")[0])
    standalone = TorchCopyEngine(model)  # no manager: the engine's own state is named
    with pytest.raises(PhaseError, match="RELEASED"):
        standalone(make_batch(0, "cpu")[0])


def test_bad_arguments():
    model = TinyNet()
    with pytest.raises(TypeError, match="missing"):
        ShardingManager(model, engine=object())
    with pytest.raises(TypeError, match="HybridConfig"):
        ShardingManager(model, config={"offload_train_param": True})
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ShardingManager("model")


# Failures ------------------------------------------------------------------------------------------
def _inject(mgr, direction, index, exc):
    real = mgr.steps

    def steps(d):
        out = real(d)
        if Direction(d) is direction:
            step = out[index]

            def boom():
                raise exc

            step.run = boom
        return out

    mgr.steps = steps


@pytest.mark.parametrize("index", range(7))
def test_failure_in_each_to_infer_step_rolls_back_with_nothing_lost(tiny_setup, index):
    model, opt = tiny_setup()
    for step in range(2):
        train_step(model, opt, step)
    before = snapshot(model, opt)
    mgr, engine = _manager(model, opt)
    name = mgr.steps(Direction.TO_INFER)[index].name
    _inject(mgr, Direction.TO_INFER, index, RuntimeError("injected"))
    with pytest.raises(SwitchError) as info:
        mgr.to_infer()
    assert info.value.step == name and info.value.phase_after is Phase.TRAIN and "injected" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert mgr.phase is Phase.TRAIN
    assert_bitwise_equal(before, snapshot(model, opt))
    assert engine.resident_nbytes("weights") == 0 and engine.resident_nbytes("kv_cache") == 0
    assert set(mgr.offload_states().values()) == {OffloadState.ON_DEVICE}
    # The manager still works afterwards.
    del mgr.steps
    with mgr.inference():
        pass
    assert_bitwise_equal(before, snapshot(model, opt))


def test_keyboard_interrupt_mid_switch_rolls_back_and_propagates(tiny_setup):
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    mgr, _ = _manager(model, opt)
    _inject(mgr, Direction.TO_INFER, 4, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        mgr.to_infer()
    assert mgr.phase is Phase.TRAIN
    assert_bitwise_equal(before, snapshot(model, opt))


def test_user_exception_inside_inference_switches_back_and_propagates(tiny_setup):
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    mgr, _ = _manager(model, opt)

    class UserBugError(Exception):
        pass

    with pytest.raises(UserBugError, match="in generate"):
        with mgr.inference():
            raise UserBugError("in generate")
    assert mgr.phase is Phase.TRAIN
    assert_bitwise_equal(before, snapshot(model, opt))
    assert mgr.last_report.direction is Direction.TO_TRAIN


def test_failed_switch_back_is_noted_on_the_user_exception_and_recoverable(tiny_setup):
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    mgr, _ = _manager(model, opt)
    _inject(mgr, Direction.TO_TRAIN, 3, torch.OutOfMemoryError("injected OOM"))  # onload grad
    with pytest.raises(ValueError, match="user") as info:
        with mgr.inference():
            raise ValueError("user")
    assert any("switch back to TRAIN failed" in n for n in getattr(info.value, "__notes__", []))
    assert mgr.phase is Phase.FAILED
    del mgr.steps
    mgr.recover()
    assert mgr.phase is Phase.TRAIN
    assert_bitwise_equal(before, snapshot(model, opt))


def test_to_train_failure_goes_to_failed_then_recover(tiny_setup):
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    mgr, _ = _manager(model, opt)
    mgr.to_infer()
    _inject(mgr, Direction.TO_TRAIN, 4, torch.OutOfMemoryError("injected"))  # onload optimizer
    with pytest.raises(SwitchError, match="recover") as info:
        mgr.to_train()
    assert info.value.phase_after is Phase.FAILED and mgr.phase is Phase.FAILED
    with pytest.raises(PhaseError, match="FAILED"):
        mgr.to_infer()
    del mgr.steps
    report = mgr.recover()
    assert mgr.phase is Phase.TRAIN
    # The params were already back.
    assert report.bytes_by_kind["optimizer"] > 0 and report.bytes_by_kind["param"] == 0
    assert_bitwise_equal(before, snapshot(model, opt))


def test_failed_rollback_goes_to_failed_then_recover(tiny_setup, monkeypatch):
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    mgr, _ = _manager(model, opt)
    _inject(mgr, Direction.TO_INFER, 4, RuntimeError("step fails"))  # offload param
    real = mgr.offloaders
    grad_off = real[next(k for k in real if k.value == "grad")]
    real_onload = grad_off.onload

    def broken_onload():
        raise torch.OutOfMemoryError("undo fails")

    grad_off.onload = broken_onload
    with pytest.raises(RollbackError, match="undo fails") as info:
        mgr.to_infer()
    assert mgr.phase is Phase.FAILED and info.value.phase_after is Phase.FAILED
    grad_off.onload = real_onload
    del mgr.steps
    mgr.recover()
    assert_bitwise_equal(before, snapshot(model, opt))


def test_memory_plan_refuses_a_switch_that_cannot_fit(tiny_setup):
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    engine_kv = 1 << 24  # 16 MiB KV cache on a "device" of 8 MiB
    mgr, engine = _manager(model, opt, kv=engine_kv, accel=CpuAccelerator(capacity_nbytes=8 << 20))
    with pytest.raises(MemoryPlanError) as info:
        mgr.to_infer()
    plan = info.value.plan
    assert not plan.fits and plan.peak_step == "resume engine kv_cache"
    assert "DOES NOT FIT" in str(info.value) and "resume engine kv_cache" in str(info.value)
    assert mgr.phase is Phase.TRAIN and engine.resident_nbytes("kv_cache") == 0
    assert_bitwise_equal(before, snapshot(model, opt))
    # The configured budget overrides the device figure.
    mgr.close()
    roomy = ShardingManager(model, TorchCopyEngine(model, kv_cache_nbytes=engine_kv), optimizer=opt,
                            config=HybridConfig(device_memory_budget_bytes=64 << 20))
    roomy.to_infer()
    roomy.to_train()


def test_plan_predicts_the_tracked_curve(tiny_setup):
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    mgr, _ = _manager(model, opt)
    plan = mgr.plan(Direction.TO_INFER)
    report = mgr.to_infer()
    ran = [s for s in report.steps]
    assert [p.name for p in plan.steps] == [s.name for s in ran]
    assert [p.after_nbytes for p in plan.steps] == [s.allocated_after_nbytes for s in ran]
    back_plan = mgr.plan(Direction.TO_TRAIN)
    back = mgr.to_train()
    assert [p.after_nbytes for p in back_plan.steps] == [s.allocated_after_nbytes for s in back.steps]



class _WakesOnSecondTry(TorchCopyEngine):
    """An engine whose first ``resume`` fails (as an engine failing to wake once would)."""

    def __init__(self, *args, failures: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.failures = failures

    def resume(self, tags):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("engine failed to wake")
        super().resume(tags)


def test_inference_retries_a_switch_that_rolled_back(tiny_setup):
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    manager = ShardingManager(model, _WakesOnSecondTry(model, failures=1), optimizer=opt)
    with manager.inference(retries=1) as engine:
        assert manager.phase is Phase.INFER and engine.resident_nbytes("weights") > 0
    assert manager.last_rollbacks == 1 and manager.phase is Phase.TRAIN
    assert_bitwise_equal(before, snapshot(model, opt))
    with manager.inference():  # no failure: nothing rolled back
        pass
    assert manager.last_rollbacks == 0


def test_inference_raises_once_its_retries_are_spent(tiny_setup):
    model, opt = tiny_setup()
    train_step(model, opt, 0)
    before = snapshot(model, opt)
    manager = ShardingManager(model, _WakesOnSecondTry(model, failures=2), optimizer=opt)
    with pytest.raises(SwitchError, match="engine failed to wake"):
        with manager.inference(retries=1):
            pytest.fail("the body must not run")
    assert manager.last_rollbacks == 1 and manager.phase is Phase.TRAIN
    assert_bitwise_equal(before, snapshot(model, opt))
    with pytest.raises(ValueError, match="retries=-1"):
        with manager.inference(retries=-1):
            pass


def test_a_failed_step_leaves_nothing_to_the_garbage_collector(tiny_setup):
    """A failed sync's staging buffers (and, in a multi-rank sync, its posted works) live in the frames its
    error carries; they are dropped before the error leaves the switch, not when the cycle collector runs."""
    import weakref

    from hybridmem.weight_sync import WeightSync

    staged: list[weakref.ref] = []

    class FailingSync(WeightSync):
        def sync(self):
            staging = torch.empty(1 << 16)
            staged.append(weakref.ref(staging))
            raise RuntimeError("the sync failed with its staging buffer allocated")

    model, opt = tiny_setup()
    train_step(model, opt, 0)
    mgr = ShardingManager(model, TorchCopyEngine(model, kv_cache_nbytes=KV_NBYTES), optimizer=opt,
                          weight_sync=FailingSync())
    gc.disable()
    try:
        with pytest.raises(SwitchError, match="the sync failed") as info:
            mgr.to_infer()
        assert staged[0]() is None, "the staging buffer waits for the garbage collector"
        lines = "".join(__import__("traceback").format_exception(info.value.__cause__))
        # Where it failed still shows.
        assert 'raise RuntimeError("the sync failed' in lines and "in sync" in lines
    finally:
        gc.enable()
    assert mgr.phase is Phase.TRAIN
