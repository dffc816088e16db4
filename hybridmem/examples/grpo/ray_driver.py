"""The demo's Ray driver (``hybridmem demo --launcher ray``): the GRPO loop held by one driver process over
worker actors (:class:`~hybridmem.examples.grpo.ray_worker.HybridActorWorker`), one per device, placed as
verl and OpenRLHF place theirs (see [Note: ray placement] in :mod:`hybridmem.integrations.ray`).

Per iteration the driver asks every worker for its rollouts (``generate_sequences``), joins the replicas'
rollouts in replica order, scores them (the task's rule here, or the co-resident reward model on the
workers, each scoring every ``world``-th sequence), computes the group advantages, and hands each worker its
data-parallel share for ``compute_ref_log_prob``, ``compute_log_prob`` and ``update``. The Ray cluster is
one started here (``--ray-nodes`` raylets on this machine: Ray's own test cluster, standing in for nodes)
or an existing one (``--ray-address``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from hybridmem.examples.grpo.algo import group_advantages
from hybridmem.examples.grpo.loop import DemoConfig, IterationStats, rule_rewards
from hybridmem.examples.grpo.topology import train_rows

__all__ = ["ray_cluster", "run_driver"]

OBJECT_STORE_BYTES = 128 * 2**20
"""Object store of each raylet the demo starts (its rollouts are kilobytes; Ray's default takes 30% of
RAM)."""


@contextlib.contextmanager
def ray_cluster(*, nodes: int, cpus: int, address: str | None = None) -> Iterator[None]:
    """A connected Ray for the body: the cluster at ``address``, or ``nodes`` raylets started on this machine
    with ``cpus`` logical CPUs over all of them (each raylet ``cpus / nodes``; a worker holds one)."""
    import ray  # noqa: PLC0415

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    per_node = -(-cpus // nodes)
    with contextlib.ExitStack() as stack:
        if address is not None:
            ray.init(address=address)
            stack.callback(ray.shutdown)
        elif nodes == 1:  # address="local": a Ray of its own, never one already running here
            ray.init(address="local", num_cpus=per_node, object_store_memory=OBJECT_STORE_BYTES,
                     include_dashboard=False)
            stack.callback(ray.shutdown)
        else:
            from ray.cluster_utils import Cluster  # noqa: PLC0415

            cluster = Cluster(initialize_head=True, connect=True,
                              head_node_args={"num_cpus": per_node, "object_store_memory": OBJECT_STORE_BYTES,
                                              "include_dashboard": False})
            stack.callback(cluster.shutdown)  # after ray.shutdown (callbacks run last first)
            stack.callback(ray.shutdown)
            for _ in range(nodes - 1):
                cluster.add_node(num_cpus=per_node, object_store_memory=OBJECT_STORE_BYTES)
            cluster.wait_for_nodes()
        yield


def run_driver(cfg: DemoConfig, world_size: int, *,
               on_iteration: Any = None) -> tuple[list[IterationStats], list[dict]]:
    """The demo's iterations over ``world_size`` worker actors on the connected Ray; returns rank 0's rows and
    where each worker ran.

    Raises:
        hybridmem.integrations.ray.WorkerGroupError: A worker raised or died (named, with its node and pid).
    """
    from hybridmem.examples.grpo.ray_worker import HybridActorWorker  # noqa: PLC0415
    from hybridmem.integrations.ray import HybridWorkerGroup  # noqa: PLC0415

    device = "cuda" if cfg.hybrid.device.startswith("cuda") else "cpu"
    env = {"OMP_NUM_THREADS": "1", **{k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "HF_"))}}
    with HybridWorkerGroup(HybridActorWorker, world_size, device=device, env_vars=env) as group:
        placements = group.call("setup", cfg)
        try:
            stats = [_iteration(cfg, group, it, on_iteration) for it in range(cfg.iters)]
        finally:
            with contextlib.suppress(Exception):  # a worker lost mid-run: the group's error says which
                group.call("teardown")
    return stats, placements


def _iteration(cfg: DemoConfig, group: Any, it: int, on_iteration: Any) -> IterationStats:
    start = time.perf_counter()
    world, train_tp, infer_tp = group.world_size, cfg.hybrid.train_layout.tp, cfg.hybrid.infer_layout.tp
    outs = group.call("generate_sequences", it)
    replicas = [outs[r * infer_tp] for r in range(world // infer_tp)]  # a replica's ranks return the same
    seqs = torch.cat([r["seqs"] for r in replicas])
    engine_lp = torch.cat([r["engine_lp"] for r in replicas])
    if cfg.reward == "model":
        rewards = torch.empty(len(seqs))
        for r, scores in enumerate(group.call_each("compute_rm_score",
                                                   [(seqs[r::world],) for r in range(world)])):
            rewards[r::world] = scores
    else:
        rewards = rule_rewards(cfg, seqs)
    adv = group_advantages(rewards, cfg.grpo.group_size)
    shares = [train_rows(r, world, train_tp) for r in range(world)]
    ref_lp = group.call_each("compute_ref_log_prob", [(seqs[s],) for s in shares])
    old_lp = group.call_each("compute_log_prob", [(seqs[s], engine_lp[s]) for s in shares])
    group.call_each("update", [(seqs[s], old_lp[r], ref_lp[r], adv[s]) for r, s in enumerate(shares)])
    row, samples = group.call_rank(0, "iteration_stats", it, float(rewards.mean()),
                                   time.perf_counter() - start)
    if on_iteration is not None:
        on_iteration(row, samples)
    return row
