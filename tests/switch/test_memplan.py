"""plan_switch against curves computed by hand."""

from __future__ import annotations

import pytest

from hybridmem import Direction
from hybridmem.switch.memplan import StepEstimate, plan_switch

STEPS = [
    ("resume weights", StepEstimate(alloc_nbytes=50, transient_nbytes=30)),
    ("offload params", StepEstimate(free_nbytes=120, transient_nbytes=10)),
    ("resume kv", StepEstimate(alloc_nbytes=20)),
]


def _plan(budget):
    return plan_switch(Direction.TO_INFER, 100, STEPS, budget_nbytes=budget, budget_source="test")


def test_transient_bytes_count_while_the_step_runs_and_not_after():
    plan = _plan(1000)
    # start 100; weights: 100 + 50 + 30 = 180 while running, 150 after; params: 150 + 10 = 160, then 30;
    # kv: 30 + 20 = 50, 50 after.
    assert [(s.peak_nbytes, s.after_nbytes) for s in plan.steps] == [(180, 150), (160, 30), (50, 50)]
    assert (plan.peak_nbytes, plan.peak_step, plan.end_nbytes) == (180, "resume weights", 50)


def test_a_budget_between_the_peak_without_and_with_transients_is_refused():
    assert not _plan(179).fits and _plan(180).fits
    assert "DOES NOT FIT" in str(_plan(179)) and "over budget" in str(_plan(179))


def test_a_switch_that_only_frees_peaks_at_the_start():
    plan = plan_switch(Direction.TO_TRAIN, 64, [("release", StepEstimate(free_nbytes=64))], budget_nbytes=64,
                       budget_source="test")
    assert (plan.peak_nbytes, plan.peak_step, plan.end_nbytes, plan.fits) == (64, "release", 0, True)


@pytest.mark.parametrize("field", ["alloc_nbytes", "free_nbytes", "transient_nbytes"])
def test_negative_estimates_are_refused(field):
    with pytest.raises(ValueError, match=f"StepEstimate.{field}=-1"):
        StepEstimate(**{field: -1})


HOST_STEPS = [
    ("offload optimizer", StepEstimate(free_nbytes=60, host_alloc_nbytes=60)),
    ("offload grad", StepEstimate(free_nbytes=30, host_alloc_nbytes=20)),
    ("resume kv", StepEstimate(alloc_nbytes=10)),
]


def test_the_host_curve_adds_each_steps_arena_growth_to_the_pool():
    plan = plan_switch(Direction.TO_INFER, 100, HOST_STEPS, budget_nbytes=1000, budget_source="test",
                       host_start_nbytes=5, host_budget_nbytes=85)
    # The pool holds 5; the optimizer's arena grows by 60 (65), the grads' by 20 (85); a resume adds none.
    assert [s.host_nbytes for s in plan.steps] == [65, 85, 85]
    assert (plan.host_peak_nbytes, plan.host_fits, plan.device_fits, plan.fits) == (85, True, True, True)
    data = plan.to_dict()
    assert (data["host_start_nbytes"], data["host_peak_nbytes"],
            data["steps"][1]["host_alloc_nbytes"]) == (5, 85, 20)


def test_a_host_peak_over_the_host_budget_does_not_fit_though_the_device_does():
    plan = plan_switch(Direction.TO_INFER, 100, HOST_STEPS, budget_nbytes=1000, budget_source="test",
                       host_start_nbytes=5, host_budget_nbytes=84)
    assert plan.device_fits and not plan.host_fits and not plan.fits
    text = str(plan)
    assert "host arenas: start 5 B, predicted peak 85 B, budget 84 B" in text and "DOES NOT FIT" in text
    # Without a host budget the host curve never refuses, and a plan without host bytes prints as before.
    assert plan_switch(Direction.TO_INFER, 100, HOST_STEPS, budget_nbytes=1000, budget_source="test").fits
    assert "host" not in str(_plan(1000))


@pytest.mark.parametrize("prewarm", [False, True])
def test_the_managers_host_plan_equals_what_the_pool_then_holds(tiny_setup, prewarm):
    """The host bytes a TRAIN->INFER switch's plan predicts equal what the pool holds after the switch,
    read from the pool's own arenas; with prewarmed arenas the plan starts from them and grows none."""
    from hybridmem import HybridConfig, ShardingManager
    from hybridmem.engines import TorchCopyEngine
    from hybridmem.testing.tiny import train_step

    model, opt = tiny_setup("cpu", "adamw")
    train_step(model, opt, 0)
    manager = ShardingManager(model, TorchCopyEngine(model, kv_cache_nbytes=1024), optimizer=opt,
                              config=HybridConfig(prewarm_host_buffers=prewarm, skip_zero_grads=False))
    if prewarm:
        manager.pool.wait_prewarmed()
    plan = manager.plan("to_infer")
    manager.to_infer()
    held = sum(a.nbytes for a in manager.pool.report())
    assert plan.host_peak_nbytes == held > 0 and plan.host_fits
    growth = [s.estimate.host_alloc_nbytes for s in plan.steps if s.name.startswith("offload ")]
    assert (plan.host_start_nbytes == held and not any(growth)) if prewarm else (plan.host_start_nbytes == 0)
    assert manager.plan("to_train").host_peak_nbytes == held  # onloads take no arena
    manager.to_train()
