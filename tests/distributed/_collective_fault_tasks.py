"""Module-level tasks for test_collective_faults.py, run in WorkerPool processes (importable by spawn).

Every rank builds what a user builds: ``from_pretrained`` of the same transformers checkpoint, FSDP2's
``fully_shard`` on each layer and on the model, AdamW, one training step, ``dist.new_subgroups(2)``, a
``ReferenceEngine`` over its tp=2 subgroup and a ``ShardingManager`` with
``HybridConfig(infer_tensor_parallel_size=2, collective_deadline_s=..., reshard_bucket_bytes=...,
verify_weight_sync=True)``; the checksum comparison adds the sync's ``all_reduce``, and it would also
catch a sync that wrote the engine from the wrong bytes (a message left over from a failed switch).

:class:`CollectiveCounter` patches the functions of ``torch.distributed`` that communicate, and
``Work.wait``: it counts this rank's calls per kind and can raise :class:`InjectedFaultError` before the
n-th call of one kind. :func:`reference_task` is the dry run (the calls of each switch, per kind) and the
losses of a run that never switches; :func:`collective_fault_task` runs one round per injection point.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import functools
import gc
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.tensor import DTensor

from hybridmem import CollectiveTimeoutError, HybridConfig, ShardingManager
from hybridmem.engines import ReferenceEngine
from hybridmem.errors import PeerAbortError
from tests.distributed.fsdp_job import build_fsdp_model, train_step

COLLECTIVES = (
    "batch_isend_irecv", "isend", "irecv", "send", "recv", "all_reduce", "all_reduce_coalesced", "reduce",
    "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "broadcast_object_list", "gather_object", "scatter_object_list",
)
"""The functions of ``torch.distributed`` that communicate; each is a kind of call counted."""

WAIT = ".wait"
"""Suffix of the kind of a ``Work.wait`` call: ``"isend.wait"`` waits for a work ``isend`` returned."""

ALL_RANKS = -1
"""The target of a point at which every rank faults (at its own n-th call of the kind, if it makes one)."""

Point = tuple[int, str, int]
"""``(rank or ALL_RANKS, kind, n)``: raise before the n-th call of ``kind`` on that rank (1-based)."""


class InjectedFaultError(Exception):
    """The fault raised before a collective call (a stand-in for any error on the way into one)."""


class CollectiveCounter:
    """Counts this rank's calls into :data:`COLLECTIVES` and ``Work.wait``, per kind, while :meth:`active`.

    Args:
        rank: This rank, named in the injected fault's message.
    """

    def __init__(self, rank: int):
        self.rank = rank
        self.counts: collections.Counter[str] = collections.Counter()
        self.target: tuple[str, int] | None = None
        self.fired: tuple[str, int] | None = None
        self._origin: dict[int, tuple[str, Any]] = {}
        self.buffers: list[weakref.ref] = []
        """Weak references to the tensors of every point-to-point operation posted while active."""

    def _tick(self, kind: str) -> None:
        self.counts[kind] += 1
        if self.target == (kind, self.counts[kind]):
            self.fired = self.target
            raise InjectedFaultError(
                f"injected on rank {self.rank} before call {self.counts[kind]} of {kind}")

    def _remember(self, kind: str, result: Any) -> Any:
        """Label the works ``result`` holds with the call that returned them (unless already labelled)."""
        for work in result if isinstance(result, list) else [result]:
            if isinstance(work, dist.Work) and id(work) not in self._origin:
                self._origin[id(work)] = (kind, work)  # the work is kept alive, so its id is not reused
        return result

    def _wrap(self, kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            self._tick(kind)
            if kind == "batch_isend_irecv":
                self.buffers += [weakref.ref(op.tensor)
                                 for op in (args[0] if args else kwargs["p2p_op_list"])]
            return self._remember(kind, original(*args, **kwargs))

        return call

    def _wrap_wait(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            self._tick(self._origin.get(id(work), ("work",))[0] + WAIT)
            return original(work, *args, **kwargs)

        return wait

    @contextlib.contextmanager
    def active(self, target: tuple[str, int] | None = None) -> Iterator[CollectiveCounter]:
        """Patch the functions (in ``torch.distributed`` and ``distributed_c10d``, which calls its own, e.g.
        ``batch_isend_irecv`` checks its ops against ``isend``) with counting wrappers; with ``target``
        ``(kind, n)``, raise :class:`InjectedFaultError` before the n-th call of ``kind``."""
        self.counts, self.target, self.fired, self._origin = collections.Counter(), target, None, {}
        self.buffers = []
        saved: list[tuple[Any, str, Any]] = []
        for name in COLLECTIVES:
            original = getattr(distributed_c10d, name, None)
            if original is None:
                continue
            wrapper = self._wrap(name, original)
            for module in (dist, distributed_c10d):
                if getattr(module, name, None) is original:
                    saved.append((module, name, original))
                    setattr(module, name, wrapper)
        saved.append((dist.Work, "wait", dist.Work.wait))
        dist.Work.wait = self._wrap_wait(dist.Work.wait)
        try:
            yield self
        finally:
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)
            self.target, self._origin = None, {}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Copies of this rank's shards of every param, grad and AdamW state tensor.

    Raises:
        AssertionError: A tensor's storage is smaller than the tensor (offloaded and not brought back).
    """
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
               *(v for state in opt.state.values() for v in state.values() if torch.is_tensor(v))]
    copies = []
    for i, t in enumerate(tensors):
        local = _local(t).detach()
        needed = (local.storage_offset() + local.numel()) * local.element_size() if local.numel() else 0
        held = local.untyped_storage().nbytes()
        assert held >= needed, (
            f"tensor {i} of {len(tensors)} {tuple(local.shape)}: {held} storage bytes, needs {needed}")
        copies.append(local.clone())
    return copies


def _differs(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> str | None:
    """Where ``after`` is not bitwise ``before``, or None."""
    if len(before) != len(after):
        return f"{len(after)} tensors, {len(before)} before"
    bad = [i for i, (a, b) in enumerate(zip(before, after)) if a.dtype != b.dtype or not torch.equal(a, b)]
    return f"tensors {bad} of {len(before)} differ" if bad else None


def _cause_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


class _Actor:
    """One rank's model, optimizer, engine and manager (none without ``config``), built as a user builds
    them, after one training step."""

    def __init__(self, ctx: Any, model_dir: str, config: HybridConfig | None):
        self.ctx, self.model_dir, self.config = ctx, model_dir, config
        self.model, self.opt = self._build()
        self.step(0)
        if config is not None:
            self.manager = self._new_manager()

    def _build(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        return build_fsdp_model(self.model_dir)

    def _new_manager(self) -> ShardingManager:
        tp_group, _ = dist.new_subgroups(2)
        self.engine = ReferenceEngine(self.model.config, group=tp_group)
        manager = ShardingManager(self.model, self.engine, optimizer=self.opt, config=self.config)
        manager.pool.wait_prewarmed()
        return manager

    def step(self, index: int) -> float:
        """One training step on batch ``index`` of this rank; returns its loss."""
        return train_step(self.model, self.opt, seed=1000 * index + self.ctx.rank)

    def recreate_group(self, init_method: str, timeout_s: float) -> None:
        """What the error advises: destroy the process group and initialise a new one. FSDP2 keeps the old
        group in the model, so the model is built again over the new one and given this rank's shards of
        the old model's params (copied into FSDP2's own storage), grads and AdamW state; the engine
        (its tp subgroup was in the old group) and the manager are new too.

        No garbage collection runs first: the failed switch dropped the works it posted and its staging
        buffers before its error left it (a group destroyed under live works now and then broke a
        connection of the next one, whose first exchange then failed with "Connection closed by peer").
        """
        self.manager.close()
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=init_method, rank=self.ctx.rank,
                                world_size=self.ctx.world_size, timeout=datetime.timedelta(seconds=timeout_s))
        model, opt = self._build()
        for old, new in zip(self.model.parameters(), model.parameters()):
            with torch.no_grad():
                _local(new).copy_(_local(old))
            new.grad = None if old.grad is None else _rebind(old.grad, new)
            if old in self.opt.state:
                opt.state[new] = {k: _rebind(v, new) for k, v in self.opt.state[old].items()}
        self.model, self.opt = model, opt
        self.manager = self._new_manager()


def _rebind(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard as a DTensor on ``like``'s mesh (``t`` itself when it is not a DTensor)."""
    if not isinstance(t, DTensor):
        return t
    return DTensor.from_local(t.to_local(), like.device_mesh, like.placements, run_check=False,
                              shape=t.shape, stride=t.stride())


def _switch(actor: _Actor, direction: str, counter: CollectiveCounter,
            target: tuple[str, int] | None) -> dict[str, Any]:
    """Run ``direction`` with ``target`` armed; what this rank saw."""
    record: dict[str, Any] = {"error": None, "group_usable": True}
    start = time.monotonic()
    gc.disable()  # what the switch leaves alive is what it keeps, not what a collection happened to miss
    with counter.active(target):
        try:
            getattr(actor.manager, direction)()
        except Exception as exc:  # what each rank saw is the result
            chain = list(_cause_chain(exc))
            timeout = next((e for e in chain if isinstance(e, CollectiveTimeoutError)), None)
            refused = next((e for e in chain if isinstance(e, PeerAbortError)), None)
            record.update(
                error=type(exc).__name__, message=str(exc),
                injected=any(isinstance(e, InjectedFaultError) for e in chain),
                collective=timeout is not None,
                peers=(sorted(timeout.peers) if timeout is not None
                       else sorted(refused.ranks) if refused is not None else []),
                group_usable=getattr(exc, "group_usable", True),
            )
    record["seconds"] = time.monotonic() - start
    record["buffers_alive"] = sum(ref() is not None for ref in counter.buffers)
    gc.enable()
    gc.collect()
    record["buffers_alive_after_gc"] = sum(ref() is not None for ref in counter.buffers)
    record["counts"] = dict(counter.counts)
    record["fired"] = counter.fired
    record["phase"] = actor.manager.phase.name
    return record


def _config(deadline_s: float, bucket_bytes: int) -> HybridConfig:
    return HybridConfig(infer_tensor_parallel_size=2, collective_deadline_s=deadline_s,
                        reshard_bucket_bytes=bucket_bytes, verify_weight_sync=True)


def reference_task(ctx: Any, model_dir: str, *, steps: int, deadline_s: float,
                   bucket_bytes: int) -> dict[str, Any]:
    """The dry run and the fault-free losses.

    Returns:
        ``to_infer`` and ``to_train``: this rank's calls per kind in one TRAIN->INFER and the INFER->TRAIN
        that follows; ``losses``: the losses of training steps ``1..steps`` of a model that never
        switches (what every round of :func:`collective_fault_task` must reproduce).
    """
    actor = _Actor(ctx, model_dir, _config(deadline_s, bucket_bytes))
    counter = CollectiveCounter(ctx.rank)
    to_infer = _switch(actor, "to_infer", counter, None)
    to_train = _switch(actor, "to_train", counter, None)
    for record in (to_infer, to_train):
        if record["error"] is not None:
            raise RuntimeError(f"rank {ctx.rank}: the fault-free switch failed: {record['message']}")
    actor.manager.close()
    plain = _Actor(ctx, model_dir, None)
    return {"to_infer": to_infer["counts"], "to_train": to_train["counts"],
            "losses": [plain.step(i) for i in range(1, steps + 1)]}


def collective_fault_task(ctx: Any, model_dir: str, *, points: Sequence[Point], deadline_s: float,
                          bucket_bytes: int, store_dir: str) -> list[dict[str, Any]]:
    """One round per point; round ``i`` injects at ``points[i]``.

    A round: a barrier; TRAIN->INFER with the point armed on this rank when it names it (its rank, or
    :data:`ALL_RANKS`); what this rank saw, and whether its training state is bitwise the snapshot taken
    before (after INFER->TRAIN where this rank's switch completed). Then, when any rank's error says the
    process group is no longer usable (the ranks agree through a ``FileStore`` under ``store_dir``), every
    rank destroys it and initialises a new one, and the state is checked again in the model rebuilt over
    it. Last, TRAIN->INFER, INFER->TRAIN and training step ``i + 1``, whose loss is recorded. A round
    whose group cannot be used any more ends the task (``next_error``). Each rank writes the index of the
    round it is in to ``store_dir/progress-<rank>`` (where a rank that died was).

    Returns:
        Per round: ``error``, ``message``, ``injected`` (the injected fault is in the error's causes),
        ``collective`` (a ``CollectiveTimeoutError`` is), ``peers``, ``group_usable``, ``seconds`` (the
        switch's), ``fired`` (the ``(kind, n)`` it was injected at on this rank, or None), ``phase`` (after
        the switch), ``state_intact``, ``state_problem``, ``recreated``, ``loss`` or ``next_error``.
    """
    actor = _Actor(ctx, model_dir, _config(deadline_s, bucket_bytes))
    counter = CollectiveCounter(ctx.rank)
    verdicts = dist.FileStore(f"{store_dir}/verdicts", ctx.world_size)
    verdicts.set_timeout(datetime.timedelta(seconds=60))
    rounds: list[dict[str, Any]] = []
    for i, (rank, kind, n) in enumerate(points):
        with open(f"{store_dir}/progress-{ctx.rank}", "w") as progress:
            progress.write(str(i))
        dist.barrier()  # every rank starts the switch together, so their deadlines start together
        before = _snapshot(actor.model, actor.opt)
        record = _switch(actor, "to_infer", counter, (kind, n) if rank in (ALL_RANKS, ctx.rank) else None)
        rounds.append(record)
        if actor.manager.phase.name == "INFER":  # this rank's switch completed
            actor.manager.to_train()
        record["state_problem"] = _differs(before, _snapshot(actor.model, actor.opt))
        verdicts.set(f"{i}/{ctx.rank}", "1" if record["group_usable"] else "0")
        record["recreated"] = not all(verdicts.get(f"{i}/{r}") == b"1" for r in range(ctx.world_size))
        try:
            if record["recreated"]:
                actor.recreate_group(f"file://{store_dir}/group-{i}", timeout_s=60.0)
                record["state_problem"] = (record["state_problem"]
                                           or _differs(before, _snapshot(actor.model, actor.opt)))
            record["state_intact"] = actor.manager.phase.name == "TRAIN" and record["state_problem"] is None
            dist.barrier()  # the round trip starts together too (a re-creation takes each rank its own time)
            actor.manager.to_infer()
            actor.manager.to_train()
            record["loss"] = actor.step(i + 1)
        except Exception:  # the rounds so far are the result; the next ones cannot run
            record["next_error"] = traceback.format_exc()[-6000:]
            break
    return rounds


class InjectedKVFaultError(RuntimeError):
    """The fault of :func:`local_fault_task`: no room for the KV cache on one rank, after its weight sync."""


def local_fault_task(ctx: Any, model_dir: str, *, rank: int, deadline_s: float, bucket_bytes: int,
                     store_dir: str) -> dict[str, Any]:
    """TRAIN->INFER with ``resume engine kv_cache`` failing on ``rank`` (after its weight sync completed);
    then, without re-creating the group, a round trip and training step 1.

    Returns:
        This rank's record as :func:`collective_fault_task` gives one.
    """
    del store_dir
    actor = _Actor(ctx, model_dir, _config(deadline_s, bucket_bytes))
    counter = CollectiveCounter(ctx.rank)
    if ctx.rank == rank:
        resume = actor.engine.resume

        def failing_resume(tags: Sequence[str]) -> None:
            if "kv_cache" in tags:
                raise InjectedKVFaultError(f"injected on rank {ctx.rank}: no room for the KV cache")
            resume(tags)

        actor.engine.resume = failing_resume
    dist.barrier()
    before = _snapshot(actor.model, actor.opt)
    record = _switch(actor, "to_infer", counter, None)
    if ctx.rank == rank:
        del actor.engine.resume
    if actor.manager.phase.name == "INFER":
        actor.manager.to_train()
    record["state_problem"] = _differs(before, _snapshot(actor.model, actor.opt))
    record["state_intact"] = actor.manager.phase.name == "TRAIN" and record["state_problem"] is None
    dist.barrier()
    actor.manager.to_infer()
    actor.manager.to_train()
    record["loss"] = actor.step(1)
    return record
