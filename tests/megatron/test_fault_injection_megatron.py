"""Fault injection at every point of a switch of a Megatron-core actor (CPU harness, one rank).

Configurations: fp32 params with the DistributedOptimizer (DDP ``param_data`` and ``grad_data`` buffers,
fp32 optimizer state) and bf16 params with fp32 main params (the mixed-precision DistributedOptimizer).
The worker task (``_fault_tasks.inject_everywhere``) dry-runs TRAIN->INFER, INFER->TRAIN and recover(),
injects ``Injected`` and ``KeyboardInterrupt`` at each point (the CI sample, or every point with
``HYBRIDMEM_FAULTS_FULL=1``) and checks what ``tests/test_fault_injection.py`` checks: phase TRAIN (or
FAILED then recover), every buffer, main param and optimizer tensor bitwise equal to the snapshot, the
next two losses equal to the uninterrupted run's. Before that, it checks that Megatron's optimizer
``step``/``zero_grad`` and the DDP model's forward raise ``PhaseError`` inside INFER.
"""

from __future__ import annotations

import _fault_tasks
import pytest
from _faults import FULL

from hybridmem.testing.megatron_models import TinyGPTSpec

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

CONFIGS = {
    "fp32-distopt": TinyGPTSpec(use_distributed_optimizer=True),
    "bf16-distopt": TinyGPTSpec(precision="bf16", use_distributed_optimizer=True),
}
DIRECTIONS = ("to_infer", "to_train", "recover")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_injection_point_loses_nothing(name, megatron_pools):
    (out,) = megatron_pools.get(1).run(_fault_tasks.inject_everywhere, CONFIGS[name], DIRECTIONS, FULL)
    assert out["leaf_optimizers"] == ["DistributedOptimizer"], out["leaf_optimizers"]
    for call, said in out["misuse"].items():  # the misuse guards on Megatron's optimizer and DDP model
        assert said.startswith("PhaseError") and "phase INFER" in said, (call, said)
    problems = []
    for direction in DIRECTIONS:
        got = out[direction]
        print(f"fault injection megatron {name} {direction}: {got['points']} points, {got['runs']} "
              "injected runs")
        assert got["points"] > 10, (direction, got)
        for kind in ("storage resize", "copy", "host arena"):
            assert kind in got["kinds"], (direction, got["kinds"])
        problems += got["problems"]
    assert not problems, "\n".join(problems[:10])
