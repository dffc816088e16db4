"""Fixtures of the Megatron tests: spawned gloo workers, one pool per world size.

Megatron's ``initialize_model_parallel`` creates its groups with ``torch.distributed.new_group`` over
the whole default group, so a task's world size must equal the pool's. The fixture keeps a pool of each
size asked for (1, 2 and 4: seven workers at most) for the whole session: the tests run in random order,
and a pool replaced at every change of size was started again and again (a 4-rank pool takes 10-20 s
on a 2-core machine). conftest.py runs every module of this folder on one xdist worker, so each size
starts once per run.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from hybridmem.testing.workers import WorkerPool


class _PoolBySize:
    def __init__(self) -> None:
        self.pools: dict[int, WorkerPool] = {}

    def get(self, world_size: int) -> WorkerPool:
        if world_size not in self.pools:
            self.pools[world_size] = WorkerPool(world_size, timeout_s=300.0)
        return self.pools[world_size]

    def close(self) -> None:
        while self.pools:
            self.pools.popitem()[1].close()


_POOLS = _PoolBySize()


@pytest.fixture(scope="session")
def megatron_pools():
    """``megatron_pools.get(world_size)``: a pool whose default group has exactly ``world_size`` ranks."""
    yield _POOLS
    _POOLS.close()


def pytest_runtest_teardown(item, nextitem) -> None:
    """Close the pools once the next test is not one of this folder's: seven idle processes holding
    Megatron's groups would otherwise stay to the end of the run beside the tests that follow."""
    here = item.path.parent
    if nextitem is None or nextitem.path.parent != here:
        _POOLS.close()
