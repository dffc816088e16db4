"""The same switch loop on a GPU (nccl, one rank, no CPU harness); skipped without CUDA.

Run on the GPU box: ``pytest -m "megatron and cuda" tests/megatron``.
"""

from __future__ import annotations

import _megatron_tasks as tasks
import pytest
import torch

from hybridmem.testing.megatron_models import TinyGPTSpec
from hybridmem.testing.workers import WorkerPool

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(
    "spec",
    [TinyGPTSpec(), TinyGPTSpec(precision="bf16", use_distributed_optimizer=True)],
    ids=["fp32", "bf16-distopt"],
)
def test_switches_on_cuda(spec, megatron_pools):
    megatron_pools.close()  # a gloo pool must not hold the GPU test's ranks
    with WorkerPool(1, backend="nccl", timeout_s=150.0) as pool:
        (switched,) = pool.run(tasks.train_with_switches, spec, 3, True, use_engine=True, device="cuda")
        (plain,) = pool.run(tasks.train_with_switches, spec, 3, False, device="cuda")
    assert switched["losses"] == plain["losses"]
    for checks in switched["infer"]:
        assert all(p == 0 and g == 0 for p, g in checks["buffer_storage_nbytes"]), checks
        assert checks["max_optimizer_storage_nbytes"] == 0 and checks["leftovers"] == {}, checks
        assert checks["engine_diffs"] == [], checks["engine_diffs"]
    assert switched["round_trip_diffs"] == [[]] * 3
