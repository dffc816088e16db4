"""Module-level task for test_cluster_plan.py, run in WorkerPool processes (importable by spawn)."""

from __future__ import annotations

import torch.distributed as dist

from hybridmem import HybridConfig, ShardingManager
from hybridmem.engines import ReferenceEngine
from tests.distributed.fsdp_job import build_fsdp_model, train_step


def _steps(plan) -> list[dict]:
    return [{"name": s.name, "alloc": s.estimate.alloc_nbytes, "free": s.estimate.free_nbytes,
             "transient": s.estimate.transient_nbytes, "host_alloc": s.estimate.host_alloc_nbytes}
            for s in plan.steps]


def switch_task(ctx, model_dir: str, *, infer_tp: int, kv_blocks: int) -> dict:
    """A user's FSDP2 job: ``from_pretrained``, ``fully_shard`` per layer and model, one AdamW step, an
    embedded engine per tensor-parallel group, a manager with defaults but the inference tp; then one
    round trip. Returns the runtime's own memory plan of each switch (from its real offloaders, engine
    and weight sync), what each switch moved, and the host arenas the pool holds after the round trip
    (bytes per owner, from the pool's own tensors)."""
    model, opt = build_fsdp_model(model_dir)
    train_step(model, opt, seed=ctx.rank)
    tp_group, _ = dist.new_subgroups(infer_tp)
    engine = ReferenceEngine(model.config, group=tp_group, num_kv_blocks=kv_blocks)
    manager = ShardingManager(model, engine, optimizer=opt,
                              config=HybridConfig(infer_tensor_parallel_size=infer_tp))
    to_infer = manager.plan("to_infer")
    manager.to_infer()
    infer_report = manager.last_report
    to_train = manager.plan("to_train")
    manager.to_train()
    train_report = manager.last_report
    moved = {}
    for report in (infer_report, train_report):
        for step in report.steps:
            moved[step.name] = {"copied": step.copied_nbytes, "zero": step.zero_nbytes,
                                "extra": dict(step.extra)}
    arenas: dict[str, int] = {}
    for arena in manager.pool.report():
        arenas[arena.owner] = arenas.get(arena.owner, 0) + arena.nbytes
    return {"to_infer": _steps(to_infer), "to_train": _steps(to_train), "moved": moved,
            "kv_nbytes": engine.planned_nbytes("kv_cache"), "arenas": arenas,
            "pool_nbytes": manager.pool.held_nbytes(), "host_start": to_infer.host_start_nbytes}
