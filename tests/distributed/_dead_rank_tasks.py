"""Module-level task for test_dead_rank.py, run in WorkerPool processes (importable by spawn).

Every rank loads the same transformers checkpoint with ``from_pretrained``, applies FSDP2's
``fully_shard`` (so each rank holds a quarter of every tensor and the weight sync must exchange them),
trains one AdamW step and builds the manager with the user's code: ``new_subgroups(2)``,
``ReferenceEngine(model.config, group=tp_group)``, ``ShardingManager(model, engine, optimizer=opt,
config=HybridConfig(infer_tensor_parallel_size=2, collective_deadline_s=...))``. One rank then misbehaves
during a switch: it stalls or dies (SIGKILL) at a chosen call. Every other rank returns what it saw.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridmem import CollectiveTimeoutError, HybridConfig, ShardingManager
from hybridmem.engines import ReferenceEngine
from hybridmem.offload import optimizer_state_tensors
from hybridmem.reshard import execute
from tests.distributed.fsdp_job import build_fsdp_model, train_step


def _local(t):
    return t._local_tensor if isinstance(t, DTensor) else t


def _snapshot(model, opt) -> list[torch.Tensor]:
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
               *optimizer_state_tensors(opt)]
    return [_local(t).detach().clone() for t in tensors]


def _misbehave(how: str, seconds: float):
    def act(*_, **__):
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "raise":  # before anything is posted: an allocation failing on the way into the collective
            raise MemoryError("injected before the collective")
        time.sleep(seconds)
    return act


def bad_rank_task(ctx, model_dir: str, *, bad_rank: int, how: str, where: str, call: int,
                  direction: str, deadline_s: float, stall_s: float, bucket_bytes: int = 512 * 2**20,
                  at_key: tuple | None = None) -> dict:
    """Switch with rank ``bad_rank`` stalling ``stall_s`` s or dying (``how``) at its ``call``-th call of
    ``where`` (``"resume"``: the engine taking its memory back, before the weight sync; ``"exchange"``: the
    ``call``-th bucket of the resharding plan, before anything of it is posted; ``"release"``: the engine
    giving its memory back) during ``direction`` (``"to_infer"`` or ``"to_train"``). ``bad_rank=-1``: every
    rank; ``how="raise"``: an exception before the call; ``how="none"``: no fault (the reference run). When
    the group is still usable after the switch, one more round trip and one more training step follow;
    their loss is recorded, and so is the number of exchanges the switch made (``exchanges``)."""
    model, opt = build_fsdp_model(model_dir)
    train_step(model, opt, seed=ctx.rank)
    tp_group, _ = dist.new_subgroups(2)
    engine = ReferenceEngine(model.config, group=tp_group)
    manager = ShardingManager(model, engine, optimizer=opt,
                              config=HybridConfig(infer_tensor_parallel_size=2,
                                                  collective_deadline_s=deadline_s,
                                                  reshard_bucket_bytes=bucket_bytes))
    manager.pool.wait_prewarmed()
    before = _snapshot(model, opt)
    if direction == "to_train":
        manager.to_infer()
    real = execute._exchange
    calls = {"n": 0}
    faulty = how != "none" and (ctx.rank == bad_rank or bad_rank == -1)
    act = _misbehave(how, stall_s)
    keys: list = []
    if where == "exchange":  # each rank goes through the steps of its share of the plan, in order
        def exchange(plan, rank, index, *args, **kwargs):
            calls["n"] += 1
            keys.append(plan.keys[index])
            # at_key: the first step at or after that key of the plan (the same moment on every rank)
            hit = calls["n"] == call if at_key is None else (tuple(plan.keys[index]) >= tuple(at_key)
                                                              and not calls.get("hit"))
            if faulty and hit:
                calls["hit"] = True
                act()
            return real(plan, rank, index, *args, **kwargs)

        execute._exchange = exchange
    elif faulty:
        real_method = getattr(engine, where)

        def method(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == call:
                act()
            return real_method(*args, **kwargs)

        setattr(engine, where, method)
    record = {"rank": ctx.rank, "error": None}
    start = time.monotonic()
    try:
        getattr(manager, direction)()
    except Exception as exc:  # what each rank saw is the result
        record.update(error=type(exc).__name__, message=str(exc),
                      collective=isinstance(exc, CollectiveTimeoutError),
                      peers=list(getattr(exc, "peers", ())), group_usable=getattr(exc, "group_usable", None))
    record["seconds"] = time.monotonic() - start
    record["exchanges"] = calls["n"]
    record["keys"] = [list(k) for k in keys]
    record["phase"] = manager.phase.name
    if manager.phase.name == "INFER":
        manager.to_train()
    after = _snapshot(model, opt)
    record["state_intact"] = manager.phase.name == "TRAIN" and len(before) == len(after) and all(
        torch.equal(a, b) for a, b in zip(before, after))
    if how == "none" or (how == "raise" and bad_rank == -1):  # the group is usable: the job goes on
        if where == "exchange":
            execute._exchange = real
        else:
            vars(engine).pop(where, None)
        manager.to_infer()
        manager.to_train()
        record["next_loss"] = train_step(model, opt, seed=100 + ctx.rank)
    return record
