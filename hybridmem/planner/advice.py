"""What would make a cluster plan that does not fit fit: the knobs of the config, each checked by planning
again with it (``hybridmem plan`` prints them, and their command-line options).

Device: offloading another kind of training state, a smaller resharding bucket, a smaller KV cache, or
all of them together. Host (per node, [Note: host plan] in :mod:`hybridmem.planner.host`): pinned arenas
at their size rather than rounded up to a power of two (torch's ``pinned_max_round_threshold_mb``), the
engine's sleep level 2 instead of 1, or offloading fewer kinds (each kept on the device instead, so its
device peak is checked too, with a smaller KV cache when the default one no longer fits beside it). The
resharding bucket is no host knob: the weight sync stages on the device, never on the host. How many
ranks share a node is no knob either (the hardware decides); when nothing fits, the advice says so and
what would (more memory, more ranks).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from hybridmem.contract.kinds import StateKind
from hybridmem.planner.presets import GB

__all__ = ["Advice", "advice_for"]

KINDS = (StateKind.PARAM, StateKind.GRAD, StateKind.OPTIMIZER)
SMALL_BUCKET_NBYTES = 64 * 2**20
SLEEP_2 = "the engine's sleep level 2 (weights discarded: the vLLM adapter's default)"
NO_ROUNDING = ("PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:1 (pinned arenas at their size, not the "
               "next power of two)")


@dataclass(frozen=True)
class Advice:
    """A change that makes the plan fit, checked by planning it again with the change."""

    knob: str
    """What to change, in the config's words."""
    options: tuple[str, ...]
    """The same change as ``hybridmem plan`` options."""
    peak_nbytes: int
    """The worst rank's device peak with it."""
    host_peak_nbytes: int | None = None
    """The worst node's host peak with it (``None``: not checked)."""


def _offload_option(offload: Mapping[StateKind, bool]) -> tuple[str, str]:
    listed = ",".join(k.value for k in KINDS if offload.get(k))
    return "--offload", listed or "none"


def advice_for(result: Any, args: Mapping[str, Any], *, predict: Callable[..., Any],
               host_peak: Callable[..., int], replan: Callable[..., Any]) -> list[Advice]:
    """The changes that make ``result`` (a :class:`~hybridmem.planner.cluster.ClusterPlan` that does not
    fit) fit.

    Args:
        result: The plan.
        args: The options it was planned with (``offload``, ``bucket_nbytes``, ``sleep_level``, ...).
        predict: ``predict(rank=None, **change)``: the prediction of ``rank`` (default: the worst) with
            ``change`` to ``args``.
        host_peak: ``host_peak(**change)``: the worst node's host peak with it.
        replan: ``replan(**change)``: the whole plan with it, without advice.
    """
    if not result.device_fits:
        return _device_advice(result, args, predict, host_peak)
    return _host_advice(result, args, predict, host_peak, replan)


def _kv_fitting(predict: Callable[..., Any], budget: int, rank: int | None = None, **change) -> int | None:
    """The largest KV cache that fits ``rank`` with ``change`` (what the switch holds when the KV cache comes
    last, subtracted from the budget), checked; None when not even an empty one fits."""
    empty = predict(rank=rank, **change, kv_nbytes=0)
    kv = budget - empty.to_infer[-1].after_nbytes
    if (empty.peak_nbytes <= budget and kv > 0
            and predict(rank=rank, **change, kv_nbytes=kv).peak_nbytes <= budget):
        return kv
    return None


def _weights_over(result) -> str:
    """``"need <N> GB of <M> GB on rank <r>"`` for the planned rank whose engine weights alone exceed the
    device (the most such bytes), ``""`` when none does: no offload, bucket or KV cache brings those under."""
    over = [p for p in result.ranks if p.state_nbytes.get("engine_weights", 0) > result.budget_nbytes]
    if not over:
        return ""
    rank = max(over, key=lambda p: (p.state_nbytes["engine_weights"], -p.rank))
    weights = rank.state_nbytes["engine_weights"]
    return f"need {weights / GB:.1f} GB of {result.budget_nbytes / GB:.1f} GB on rank {rank.rank}"


def _device_advice(result, args, predict, host_peak) -> list[Advice]:
    """Knobs that make the worst rank fit the device and keep every node within its host memory: each
    alone, else all of them together; with a level-1 sleep, each also with level 2 when the host needs it."""
    worst, budget, host_budget = result.worst, result.budget_nbytes, result.host_budget_nbytes
    weights = _weights_over(result)
    if worst.start_nbytes > budget:
        also = f", and the engine's weights alone {weights}" if weights else ""
        fix = ", and a larger inference tp/ep" if weights else ""
        return [Advice(f"none: the training state alone needs {worst.start_nbytes / GB:.1f} GB of "
                       f"{budget / GB:.1f} GB on rank {worst.rank}{also}; use more ranks or more training "
                       f"parallelism{fix}",
                       (), worst.start_nbytes)]
    if weights:
        return [Advice(f"none: the engine's weights alone {weights}; use more ranks or a larger "
                       f"inference tp/ep", (), worst.peak_nbytes)]

    def host_ok(change: dict) -> tuple[dict, int] | None:
        """``change``, with sleep level 2 added when the host needs it and that helps, and its host peak; None
        when the host cannot hold it."""
        for extra in ({}, {"sleep_level": 2}):
            if extra and args["sleep_level"] == 2:
                break
            peak = host_peak(**change, **extra)
            if host_budget is None or peak <= host_budget:
                return {**change, **extra}, peak
        return None

    def checked(knob: str, options: tuple[str, ...], change: dict, peak: int) -> Advice | None:
        host = host_ok(change)
        if host is None:
            return None
        full, host_peak_nbytes = host
        if "sleep_level" in full and "sleep_level" not in change:
            knob, options = f"{knob}, and {SLEEP_2}", (*options, "--sleep-level", "2")
        return Advice(knob, options, peak, host_peak_nbytes)

    def kv_fitting(**change) -> int | None:
        return _kv_fitting(predict, budget, **change)

    off, out = args["offload"], []
    for kind in (StateKind.OPTIMIZER, StateKind.GRAD, StateKind.PARAM):
        if not off.get(kind):
            more = {**off, kind: True}
            if (p := predict(offload=more).peak_nbytes) <= budget:
                out.append(checked(f"offload_train_{kind.value}: true", _offload_option(more),
                                   {"offload": more}, p))
    if SMALL_BUCKET_NBYTES < args["bucket_nbytes"] and (
            p := predict(bucket_nbytes=SMALL_BUCKET_NBYTES).peak_nbytes) <= budget:
        out.append(checked(f"reshard_bucket_bytes: {SMALL_BUCKET_NBYTES}", ("--bucket-mib", "64"),
                           {"bucket_nbytes": SMALL_BUCKET_NBYTES}, p))
    kv = kv_fitting()
    if kv is not None and kv > 0:
        out.append(checked(f"a KV cache of at most {kv / GB:.2f} GB per rank", ("--kv-cache-bytes", str(kv)),
                           {"kv_nbytes": kv}, budget))
    out = [a for a in out if a is not None]
    if out:
        return out
    everything = {k: True for k in KINDS}
    bucket = min(SMALL_BUCKET_NBYTES, args["bucket_nbytes"])
    kv = kv_fitting(offload=everything, bucket_nbytes=bucket)
    if kv is not None and kv > 0:
        together = checked(f"together: offload_train_param, offload_train_grad and offload_train_optimizer "
                           f"true, reshard_bucket_bytes: {bucket}, a KV cache of at most {kv / GB:.2f} GB "
                           f"per rank",
                           ("--offload", "param,grad,optimizer", "--bucket-mib", str(bucket // 2**20),
                            "--kv-cache-bytes", str(kv)),
                           {"offload": everything, "bucket_nbytes": bucket, "kv_nbytes": kv}, budget)
        if together is not None:
            return [together]
        return [Advice(f"none: the device fits only with every kind offloaded, and then a node's host memory "
                       f"({host_budget / GB:.0f} GB) cannot hold the arenas even with the engine's sleep "
                       f"level 2; use more ranks (less state per rank) or nodes with more host memory",
                       (), worst.peak_nbytes, host_peak(offload=everything, sleep_level=2))]
    return [Advice(f"none of offloading, a smaller bucket or a smaller KV cache: rank {worst.rank} peaks at "
                   f"{worst.peak_nbytes / GB:.1f} GB of {budget / GB:.1f} GB even with all of them; use more "
                   f"ranks or a larger inference tp/ep", (), worst.peak_nbytes)]


def _host_advice(result, args, predict, host_peak, replan) -> list[Advice]:
    """Changes that bring every node within its host memory while the device still fits: the fewest
    changes that do, each set checked by planning the whole cluster again; state kept on the device with
    a smaller KV cache where the default one no longer fits beside it."""
    budget, node = result.host_budget_nbytes, result.worst_node
    off = args["offload"]
    offloaded = [k for k in KINDS if off.get(k)]
    # (change, knob, options) of each knob alone; a set of them is tried with the fewest first.
    single = []
    if args["accel"].pinned_rounds_up:
        single.append(({"accel": replace(args["accel"], pinned_rounds_up=False)}, NO_ROUNDING,
                       ("--no-pinned-rounding",)))
    if args["sleep_level"] == 1:
        single.append(({"sleep_level": 2}, SLEEP_2, ("--sleep-level", "2")))
    changes: list[tuple[int, dict, str, tuple[str, ...]]] = []
    for keep in range(len(offloaded) + 1):
        for kept in itertools.combinations(offloaded, keep):
            fewer = {**off, **{k: False for k in kept}}
            for num in range(len(single) + 1):
                for others in itertools.combinations(single, num):
                    if not kept and not others:
                        continue
                    change = {k: v for c, _, _ in others for k, v in c.items()}
                    if kept:
                        change["offload"] = fewer
                    knob = ", ".join([*(f"offload_train_{k.value}: false" for k in kept),
                                      *(k for _, k, _ in others)])
                    options = (*(_offload_option(fewer) if kept else ()),
                               *(o for _, _, opts in others for o in opts))
                    changes.append((len(kept) + num, change, knob, options))
    out: list[Advice] = []
    for size in sorted({c[0] for c in changes}):
        for _, change, knob, options in (c for c in changes if c[0] == size):
            if host_peak(**change) > budget:
                continue
            plan = replan(**change)
            if not plan.device_fits and "offload" in change and args["kv_nbytes"] is None:
                kv = _kv_fitting(predict, plan.budget_nbytes, rank=plan.worst.rank, **change)
                if kv is not None:
                    change = {**change, "kv_nbytes": kv}
                    knob = f"{knob}, a KV cache of at most {kv / GB:.2f} GB per rank"
                    options = (*options, "--kv-cache-bytes", str(kv))
                    plan = replan(**change)
            if plan.fits:
                out.append(Advice(knob, options, plan.worst.peak_nbytes, plan.worst_node.peak_nbytes))
        if out:
            return out
    return [Advice(f"none of unrounded pinned arenas, the engine's sleep level 2 or offloading fewer kinds "
                   f"(with a smaller KV cache): node {node.node} needs {node.peak_nbytes / GB:.1f} GB of "
                   f"{budget / GB:.1f} GB of host memory, and the devices cannot keep enough state to "
                   f"bring it under; use nodes with more host memory, or more ranks (less state per rank)",
                   (), result.worst.peak_nbytes, node.peak_nbytes)]
