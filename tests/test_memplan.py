"""plan_switch against curves computed by hand."""

from __future__ import annotations

import pytest

from hybridmem import Direction
from hybridmem.memplan import StepEstimate, plan_switch

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
