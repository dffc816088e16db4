"""hybridmem in Ray actors, placed as RL stacks (verl, OpenRLHF, MindSpeed-RL, NeMo-RL) place their
co-located workers: one actor per device, each holding a trainer rank, its engine and its co-resident
models (``pip install 'hybridmem[ray]'``; importing ``hybridmem`` never imports Ray).

The driver builds a :class:`HybridWorkerGroup` of a :class:`HybridWorker` subclass; the group places the
actors, joins them in one ``torch.distributed`` process group and calls their methods on every rank at
once, raising :class:`WorkerGroupError` (or :class:`WorkerDiedError`, naming the actor that died) when a
rank fails.

[Note: ray placement]
One placement group per job with one bundle per device (:func:`placement_bundles`): ``{"GPU": 1, "CPU":
c}`` on GPUs (``{"NPU": 1, "CPU": c}`` on Ascend NPUs), ``{"CPU": c}`` on CPU, strategy ``PACK`` by default
(bundles on as few nodes as fit, as verl and OpenRLHF place theirs; ``STRICT_PACK`` for one node, ``SPREAD``
to test several). Rank ``r``'s actor is scheduled into bundle ``r`` (:func:`worker_options`), so the trainer
rank, its engine (in its process, or an engine process it starts) and its co-resident models share the one
device Ray gave the bundle.

What Ray sets: ``CUDA_VISIBLE_DEVICES`` (``ASCEND_RT_VISIBLE_DEVICES``) of each actor to its bundle's GPU
(NPU), so the actor's device is ``cuda:0`` (``npu:0``), and nothing of ``torch.distributed``. What hybridmem
sets (:func:`init_distributed`), as torchrun would: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (0: the one
device the actor sees), ``LOCAL_WORLD_SIZE`` (1), ``MASTER_ADDR`` and ``MASTER_PORT`` (rank 0's node address
and a port free there, asked of rank 0's actor before any rank joins:
:meth:`HybridWorker.rendezvous_address`), then the process group by ``init_method="env://"`` (NCCL on GPUs,
HCCL on NPUs, gloo on CPU), so code written for torchrun, hybridmem's managers and vLLM's
``external_launcher`` included, runs unchanged in the actor.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridmem.errors import HybridMemError

__all__ = [
    "DEVICES",
    "HybridWorker",
    "HybridWorkerGroup",
    "PlacementError",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerGroupError",
    "init_distributed",
    "placement_bundles",
    "worker_options",
]

DEVICES = ("cpu", "cuda", "npu")
"""The devices a worker may hold: a CPU share, one GPU (Ray's ``GPU`` resource) or one Ascend NPU
(``NPU``)."""

ACCELERATOR_RESOURCE = {"cuda": "GPU", "npu": "NPU"}
"""Ray's resource for one device of each kind; Ray sets ``CUDA_VISIBLE_DEVICES`` /
``ASCEND_RT_VISIBLE_DEVICES`` of an actor holding one to that device alone."""

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
"""The process group's backend on each device."""

STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")
"""Ray's placement strategies."""

CLOSE_WAIT_S = 10.0
"""How long :meth:`HybridWorkerGroup.close` lets the actors exit on their own before killing them."""


class PlacementError(HybridMemError, RuntimeError):
    """The placement group could not be placed: the cluster lacks the resources its bundles ask for."""

    def __init__(self, bundles: Sequence[dict[str, float]], strategy: str, available: dict[str, float],
                 waited_s: float):
        self.bundles, self.strategy, self.available = list(bundles), strategy, dict(available)
        super().__init__(
            f"Ray could not place {len(self.bundles)} bundles {self.bundles[:1]} (strategy {strategy}) "
            f"within {waited_s:.0f} s; the cluster has {self.available} available: start Ray with more "
            f"resources, or ask for fewer workers or CPUs per worker"
        )


class WorkerGroupError(HybridMemError, RuntimeError):
    """One or more ranks of a :class:`HybridWorkerGroup` call raised or did not answer.

    Attributes:
        call: The method called.
        errors: The exception each failed rank raised (hybridmem's errors arrive as their own classes).
        results: What the ranks that returned gave, by rank.
        missing: Ranks with no answer within the group's timeout.
    """

    def __init__(self, call: str, *, errors: dict[int, BaseException] | None = None,
                 results: dict[int, Any] | None = None, missing: Sequence[int] = (),
                 died: dict[int, str] | None = None):
        self.call = call
        self.errors = dict(errors or {})
        self.results = dict(results or {})
        self.missing = sorted(missing)
        self.died = dict(died or {})
        parts = [f"rank {r}'s actor died ({why})" for r, why in sorted(self.died.items())]
        parts += [f"rank {r} raised {type(e).__name__}: {_first_line(e)}"
                  for r, e in sorted(self.errors.items())]
        if self.missing:
            parts.append(f"ranks {self.missing} did not answer")
        done = sorted(self.results)
        super().__init__(f"{call} failed: " + "; ".join(parts) + (f"; ranks {done} returned" if done else ""))


class WorkerDiedError(WorkerGroupError):
    """A worker actor died (its process killed, its node lost) during a call.

    Attributes:
        died: Why each dead rank's actor died, with its node and pid, by rank.
    """


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


def placement_bundles(world_size: int, *, device: str = "cuda",
                      cpus_per_worker: float = 1) -> list[dict[str, float]]:
    """One bundle per worker: ``{"GPU": 1, "CPU": cpus_per_worker}`` on ``cuda``, ``{"NPU": 1, "CPU":
    cpus_per_worker}`` on ``npu``, ``{"CPU": cpus_per_worker}`` on ``cpu`` (see [Note: ray placement]).

    Raises:
        ValueError: ``world_size`` < 1, ``cpus_per_worker`` <= 0 or ``device`` not one of :data:`DEVICES`.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} is not allowed: expected an integer >= 1")
    if not cpus_per_worker > 0:
        raise ValueError(f"cpus_per_worker={cpus_per_worker} is not allowed: expected a number > 0")
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not allowed: expected one of {DEVICES}")
    bundle = {"CPU": float(cpus_per_worker)}
    if device in ACCELERATOR_RESOURCE:
        bundle[ACCELERATOR_RESOURCE[device]] = 1.0
    return [dict(bundle) for _ in range(world_size)]


def worker_options(group: Any, rank: int, *, device: str = "cuda",
                   cpus_per_worker: float = 1) -> dict[str, Any]:
    """``ActorClass.options(...)`` that schedule rank ``rank``'s actor into bundle ``rank`` of the
    placement group ``group``, holding that bundle's resources."""
    options: dict[str, Any] = {
        "num_cpus": cpus_per_worker,
        "num_gpus": 1 if device == "cuda" else 0,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=group,
                                                                placement_group_bundle_index=rank),
    }
    if device == "npu":
        options["resources"] = {"NPU": 1}
    return options


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, *, device: str = "cuda",
                     timeout_s: float = 600.0) -> None:
    """Set the variables torchrun would and join the process group (see [Note: ray placement]).

    Args:
        rank: This actor's rank.
        world_size: Number of actors.
        master_addr: Rank 0's address.
        master_port: A port free on rank 0's node.
        device: ``cuda``: NCCL on the one GPU Ray left visible; ``npu``: HCCL on the one NPU (needs
            ``torch_npu``); ``cpu``: gloo.
        timeout_s: The process group's timeout.
    """
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    if device == "cuda":
        torch.cuda.set_device(0)  # Ray's CUDA_VISIBLE_DEVICES leaves the bundle's GPU alone visible
    elif device == "npu":
        import torch_npu  # noqa: F401, PLC0415 - registers torch.npu

        torch.npu.set_device(0)  # Ray's ASCEND_RT_VISIBLE_DEVICES leaves the bundle's NPU alone visible
    dist.init_process_group(BACKENDS[device], init_method="env://", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


@dataclass(frozen=True)
class WorkerContext:
    """What a function run by :meth:`HybridWorkerGroup.run` gets as its first argument (the fields of
    :class:`hybridmem.testing.workers.WorkerContext`, so a task runs on either).

    Attributes:
        rank: The actor's rank.
        world_size: Number of actors.
        group: ``None``: the default process group.
        backend: ``"gloo"``, ``"nccl"`` or ``"hccl"``.
    """

    rank: int
    world_size: int
    group: Any = None
    backend: str = "gloo"


class HybridWorker:
    """Base class of a worker actor (subclass it with the job's methods; :class:`HybridWorkerGroup` makes it
    a Ray actor). The group joins the process group before any other call.

    Args:
        rank: This actor's rank (the group passes it).
        world_size: Number of actors.
        device: One of :data:`DEVICES`.
    """

    def __init__(self, *, rank: int, world_size: int, device: str = "cuda"):
        self.rank, self.world_size, self.device = rank, world_size, device

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a port free on it (asked of rank 0 for ``MASTER_ADDR``/``MASTER_PORT``)."""
        address = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((address, 0))
            return address, s.getsockname()[1]

    def join(self, master_addr: str, master_port: int, *, timeout_s: float = 600.0) -> dict[str, Any]:
        """Join the group's process group (:func:`init_distributed`); returns :meth:`placement`."""
        init_distributed(self.rank, self.world_size, master_addr, master_port, device=self.device,
                         timeout_s=timeout_s)
        return self.placement()

    def placement(self) -> dict[str, Any]:
        """Where this actor runs: rank, Ray node id, node address, pid, visible GPUs."""
        return {"rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(),
                "address": ray.util.get_node_ip_address(), "pid": os.getpid(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(WorkerContext, *args, **kwargs)`` in this actor."""
        ctx = WorkerContext(rank=self.rank, world_size=self.world_size, backend=BACKENDS[self.device])
        return fn(ctx, *args, **kwargs)

    def leave(self) -> None:
        """Destroy the process group (if it is still there)."""
        import torch.distributed as dist  # noqa: PLC0415

        if dist.is_initialized():
            dist.destroy_process_group()


class HybridWorkerGroup:
    """``world_size`` actors of ``worker_cls``, one per placement-group bundle, joined in one process group.

    Args:
        worker_cls: A :class:`HybridWorker` subclass (a plain class: the group makes it a Ray actor).
        world_size: Number of actors (devices).
        device: ``cuda`` (one GPU each), ``npu`` (one Ascend NPU each) or ``cpu``.
        cpus_per_worker: CPUs each bundle holds.
        strategy: Ray's placement strategy (one of :data:`STRATEGIES`).
        env_vars: Environment of every actor (Ray's ``runtime_env``).
        timeout_s: How long a call waits for every rank, and the process group's timeout.
        placement_timeout_s: How long to wait for the placement group to be placed.

    Raises:
        ValueError: A bad argument, named.
        PlacementError: The cluster cannot place the bundles.
        WorkerGroupError: An actor failed to start or to join.
    """

    def __init__(self, worker_cls: type, world_size: int, *, device: str = "cuda", cpus_per_worker: float = 1,
                 strategy: str = "PACK", env_vars: dict[str, str] | None = None, timeout_s: float = 600.0,
                 placement_timeout_s: float = 60.0):
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, HybridWorker)):
            raise ValueError(f"worker_cls={worker_cls!r} is not allowed: expected a subclass of HybridWorker")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r} is not allowed: expected one of {STRATEGIES}")
        bundles = placement_bundles(world_size, device=device, cpus_per_worker=cpus_per_worker)
        self.world_size, self.device, self.timeout_s = world_size, device, timeout_s
        self.actors: list[Any] = []
        self.placement_group = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([self.placement_group.ready()], timeout=placement_timeout_s)
        if not ready:
            available = ray.available_resources()
            self.close()
            raise PlacementError(bundles, strategy, available, placement_timeout_s)
        try:
            actor_cls = ray.remote(worker_cls)
            runtime_env = {"env_vars": dict(env_vars)} if env_vars else None
            self.actors = [
                actor_cls.options(**worker_options(self.placement_group, r, device=device,
                                                   cpus_per_worker=cpus_per_worker),
                                  runtime_env=runtime_env).remote(rank=r, world_size=world_size,
                                                                  device=device)
                for r in range(world_size)
            ]
            address, port = self._gather("rendezvous_address",
                                         [self.actors[0].rendezvous_address.remote()])[0]
            self.placements = self.call("join", address, port, timeout_s=timeout_s)
        except BaseException:
            self.close()
            raise

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` on every actor at once; their results by rank.

        Raises:
            WorkerDiedError: An actor died (the others' results and errors ride along).
            WorkerGroupError: A rank raised, or did not answer within ``timeout_s``.
        """
        return self._gather(method, [getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def call_each(self, method: str, args: Sequence[tuple]) -> list[Any]:
        """``method(*args[r])`` on each actor ``r`` at once (each rank its own share of the data)."""
        if len(args) != self.world_size:
            raise ValueError(f"call_each({method!r}) got {len(args)} argument tuples; expected "
                             f"{self.world_size}, one per rank")
        return self._gather(method, [getattr(a, method).remote(*a_args)
                                     for a, a_args in zip(self.actors, args)])

    def call_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method(*args, **kwargs)`` on rank ``rank``'s actor alone."""
        refs = [None] * self.world_size
        refs[rank] = getattr(self.actors[rank], method).remote(*args, **kwargs)
        return self._gather(method, refs)[rank]

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(ctx, *args, **kwargs)`` on every actor (``ctx``: a :class:`WorkerContext`); results by rank,
        as :meth:`hybridmem.testing.workers.WorkerPool.run` returns them."""
        return self._gather(getattr(fn, "__name__", str(fn)),
                            [a.run.remote(fn, *args, **kwargs) for a in self.actors])

    def _gather(self, call: str, refs: Sequence[Any]) -> list[Any]:
        pending = {ref: rank for rank, ref in enumerate(refs) if ref is not None}
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        died: dict[int, str] = {}
        give_up = time.monotonic() + self.timeout_s
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, give_up - time.monotonic()))
            if not ready:
                break
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
                died[rank] = self._why_died(rank, exc)
            except ray.exceptions.RayTaskError as exc:
                errors[rank] = getattr(exc, "cause", None) or exc
        if died or errors or pending:
            cls = WorkerDiedError if died else WorkerGroupError
            raise cls(call, errors=errors, results=results, missing=list(pending.values()), died=died)
        return [results.get(r) for r in range(len(refs))]

    def _why_died(self, rank: int, exc: BaseException) -> str:
        where = getattr(self, "placements", None)
        place = where[rank] if where else {}
        node = str(place.get("node_id", "?"))[:12]
        return f"node {node}, pid {place.get('pid', '?')}: {_first_line(exc)}"

    def close(self) -> None:
        """End the actors and remove the placement group (safe to call twice).

        Each actor is asked to exit first, as a process ends normally (its ``atexit`` handlers and finalizers
        run: vLLM's CPU communicator removes its shared-memory files, hybridmem's host pool its arenas);
        one still there after :data:`CLOSE_WAIT_S` (busy, or stuck in a collective) is killed."""
        if self.actors:
            with contextlib.suppress(Exception):
                ray.wait([a.__ray_terminate__.remote() for a in self.actors], num_returns=len(self.actors),
                         timeout=CLOSE_WAIT_S)
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self.actors = []
        if getattr(self, "placement_group", None) is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)
            self.placement_group = None

    def __enter__(self) -> HybridWorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
