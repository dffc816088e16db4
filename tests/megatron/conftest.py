"""Fixtures of the Megatron tests: spawned gloo workers, one pool at a time.

Megatron's ``initialize_model_parallel`` creates its groups with ``torch.distributed.new_group`` over
the whole default group, so a task's world size must equal the pool's. The fixture keeps one pool of
the size last asked for and replaces it when another size is needed (never more than 4 workers
alive); the test configurations are ordered so that each size is started once.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from hybridmem.testing.workers import WorkerPool  # noqa: E402


class _PoolBySize:
    def __init__(self) -> None:
        self.pool: WorkerPool | None = None

    def get(self, world_size: int) -> WorkerPool:
        if self.pool is None or self.pool.max_world_size != world_size:
            self.close()
            self.pool = WorkerPool(world_size, timeout_s=300.0)
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


@pytest.fixture(scope="session")
def megatron_pools():
    """``megatron_pools.get(world_size)``: a pool whose default group has exactly ``world_size`` ranks."""
    pools = _PoolBySize()
    yield pools
    pools.close()
