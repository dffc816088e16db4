"""Predict both switches of every rank of a cluster before renting it: bytes freed and moved, transient
buffers, peak device memory, time, and whether it fits (``hybridmem plan``).

[Note: cluster plan]
Nothing here has its own idea of a switch. For each rank, stand-ins answer the questions the runtime's
steps ask of real offloaders, engines and weight syncs (``live_nbytes``, ``planned_nbytes``,
``temp_nbytes``), with figures read from the same layouts the runtime reshards with; the runtime's
:func:`~hybridmem.steps.switch_steps` orders the steps and :func:`~hybridmem.memplan.plan_switch` walks
them, so a prediction and a run cannot drift apart. The weight sync's figures are the rank's own share
of the resharding plan (``build_plan(..., rank=r)``): bytes sent and received, peers (same node or not),
largest staging buffer. What the stand-ins hold per rank:

- training parameters: the source layout's tensors of the rank (Megatron: its shards; FSDP2: the
  storage ``fully_shard`` gives it, every rank padded to ``ceil(rows / shards)`` rows, see [Note: FSDP2
  shards] in :mod:`hybridmem.reshard.hf_source`), in the parameter dtype;
- gradients: as many elements as the parameters' storage in the gradient dtype (Megatron's main grads are
  fp32 by default; FSDP2 reduce-scatters into padded shards too);
- optimizer state: Megatron: ``optimizer_bytes_per_param`` (12: fp32 master, exp_avg, exp_avg_sq) per
  parameter of the rank, divided over the data-parallel ranks with the distributed optimizer; FSDP2:
  AdamW's two moments in the parameter dtype, shaped like the rank's shard (not padded), plus a 4-byte
  step per tensor;
- engine weights: the destination layout's tensors of the rank (padding rows included), in the
  inference dtype (a tensor the model keeps in fp32 counted in fp32);
- KV cache: given, or vLLM's rule: ``gpu_memory_utilization`` of the device minus the engine weights.

Times are bytes over bandwidths: offload and onload over the host link; the sync's local copies at the
device's copy bandwidth, and each resharding step's larger direction over the link to its peer (NVLink
within a node, the network across), plus a fixed latency per step. tests/test_cluster_plan.py runs the switches on gloo at 4 and 8 ranks and checks the
predicted steps and bytes equal the runtime's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

from hybridmem.config import ParallelLayout
from hybridmem.engines.protocol import WEIGHTS, EngineCapabilities
from hybridmem.kinds import StateKind
from hybridmem.memplan import MemoryPlan, plan_switch
from hybridmem.offload import OffloadState
from hybridmem.phase import Direction
from hybridmem.reshard import (
    DEFAULT_BUCKET_NBYTES,
    MegatronConvention,
    ModelSpec,
    ReshardPlan,
    build_plan,
    hf_source_layout,
    megatron_layout,
    vllm_layout,
)
from hybridmem.reshard.hf_source import hf_module_tensors
from hybridmem.steps import OffloadStep, OnloadStep, SwitchStep, ToInferOrder, WeightSyncStep, switch_steps

__all__ = ["AcceleratorFigures", "ACCELERATORS", "TrainingSetup", "RankPrediction", "ClusterPlan", "plan_cluster",
           "hf_buffer_nbytes"]

GB = 10**9


@dataclass(frozen=True, kw_only=True)
class AcceleratorFigures:
    """What a switch's time and fit depend on, per device."""

    name: str
    memory_nbytes: int
    """Device memory a process may use (the budget of a switch's peak)."""
    host_link_bps: float
    """Host <-> device copy bandwidth from pinned memory, bytes/s."""
    intra_node_bps: float
    """Device <-> device bandwidth to a peer in the same node, bytes/s, one direction."""
    inter_node_bps: float
    """Device <-> device bandwidth to a peer in another node, bytes/s, one direction."""
    devices_per_node: int
    device_copy_bps: float
    """Device-local copy bandwidth (half the memory bandwidth: a copy reads and writes), bytes/s."""
    step_latency_s: float = 50e-6
    """Fixed cost of one resharding step (posting, launching)."""

    def __post_init__(self) -> None:
        for name in ("memory_nbytes", "host_link_bps", "intra_node_bps", "inter_node_bps", "devices_per_node",
                     "device_copy_bps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{self.name}: {name}={getattr(self, name)} must be > 0")


ACCELERATORS: dict[str, AcceleratorFigures] = {
    # H100 SXM 80 GB: pinned host<->device measured at 52-54 GB/s on an H100 box (docs/benchmarks.md);
    # NVLink 4: 450 GB/s each way; one 400 Gb/s NIC per GPU; HBM3 at 3.35 TB/s.
    "h100": AcceleratorFigures(name="h100", memory_nbytes=80 * GB, host_link_bps=53 * GB, intra_node_bps=450 * GB,
                               inter_node_bps=50 * GB, devices_per_node=8, device_copy_bps=1675 * GB),
    # H200 141 GB: the H100's links, HBM3e at 4.8 TB/s.
    "h200": AcceleratorFigures(name="h200", memory_nbytes=141 * GB, host_link_bps=53 * GB, intra_node_bps=450 * GB,
                               inter_node_bps=50 * GB, devices_per_node=8, device_copy_bps=2400 * GB),
    # Ascend 910B (64 GB HBM): PCIe 4.0 x16 to the host, HCCS within the node, 200 Gb/s RoCE per NPU.
    "910b": AcceleratorFigures(name="910b", memory_nbytes=64 * 2**30, host_link_bps=25 * GB, intra_node_bps=196 * GB,
                               inter_node_bps=25 * GB, devices_per_node=8, device_copy_bps=800 * GB),
}
"""Defaults per known accelerator (vendor figures where not measured here); every field can be overridden."""


@dataclass(frozen=True, kw_only=True)
class TrainingSetup:
    """How training holds its state on a rank."""

    kind: str = "megatron"
    """``"megatron"`` (tp/pp/ep shards) or ``"fsdp2"`` (transformers' names, ``fully_shard`` over all ranks)."""
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    stage_layers: tuple[int, ...] | None = None
    """Layers per pipeline stage (Megatron), first to last; ``None``: even."""
    param_bytes: int = 2
    grad_bytes: int = 4
    optimizer_bytes_per_param: int = 12
    """Megatron: fp32 master + exp_avg + exp_avg_sq."""
    distributed_optimizer: bool = True
    """Megatron's ``use_distributed_optimizer``: optimizer state divided over the data-parallel ranks."""
    buffer_nbytes: int = 0
    """Module buffers every rank holds whole and offloads with the parameters (transformers' rotary
    ``inv_freq``; :func:`hf_buffer_nbytes` counts them)."""

    def __post_init__(self) -> None:
        if self.kind not in ("megatron", "fsdp2"):
            raise ValueError(f"training kind={self.kind!r}; expected 'megatron' or 'fsdp2'")
        for name in ("param_bytes", "grad_bytes"):
            if getattr(self, name) not in (1, 2, 4, 8):
                raise ValueError(f"{name}={getattr(self, name)} must be 1, 2, 4 or 8")


# Stand-ins answering what the runtime's steps ask ([Note: cluster plan]) -----------------------------


@dataclass
class _Offloader:
    kind: StateKind
    nbytes: int
    state: OffloadState = OffloadState.ON_DEVICE

    @property
    def owner(self) -> str:
        return self.kind.value

    def live_nbytes(self) -> int:
        return self.nbytes

    def rehome_nbytes(self) -> int:
        return 0


@dataclass
class _Engine:
    weights_nbytes: int
    kv_nbytes: int
    capabilities = EngineCapabilities(reports_residency=True)

    def planned_nbytes(self, tag: str) -> int:
        return self.weights_nbytes if tag == WEIGHTS else self.kv_nbytes

    resident_nbytes = planned_nbytes


@dataclass
class _Sync:
    temp: int

    def temp_nbytes(self) -> int:
        return self.temp


class _Accel:
    def empty_cache(self) -> None:  # pragma: no cover - a plan never runs its steps
        pass


class _Nothing:
    """The training adapter's own buffers (FSDP2's unsharded parameters, Megatron's workspaces): none
    between steps of a training loop (FSDP2 reshards after forward and backward), and unknown to a plan
    otherwise, so counted as 0 (a plan of Megatron may overstate the peak by its workspaces)."""

    def nbytes(self) -> int:
        return 0

    resident_nbytes = nbytes


def _adapter_steps(setup: TrainingSetup) -> list[tuple[int, SwitchStep]]:
    """The steps the training adapter registers, as the runtime orders them."""
    if setup.kind == "fsdp2":
        from hybridmem.adapters.fsdp.state import ReleaseFSDPBuffersStep  # noqa: PLC0415

        return [(ToInferOrder.OPTIMIZER - 5, ReleaseFSDPBuffersStep(_Nothing()))]
    from hybridmem.adapters.megatron.state import ReleaseWorkspacesStep  # noqa: PLC0415

    return [(ToInferOrder.EMPTY_CACHE - 1, ReleaseWorkspacesStep(_Nothing()))]


def hf_buffer_nbytes(config: Mapping, param_bytes: int) -> int:
    """Bytes of the buffers of transformers' model of ``config`` (built on the meta device, so nothing
    is allocated), with parameters of ``param_bytes``; 0 when transformers cannot build it."""
    try:
        import torch  # noqa: PLC0415
        import transformers  # noqa: PLC0415

        fields = {k: v for k, v in config.items() if k != "model_type"}
        cfg = transformers.AutoConfig.for_model(config["model_type"], **fields)
        dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[param_bytes]
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    except (ImportError, ValueError, KeyError, TypeError):
        return 0
    return sum(b.nelement() * b.element_size() for _, b in model.named_buffers())


# Per-rank figures ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepFigures:
    """One step of one switch on one rank."""

    name: str
    alloc_nbytes: int
    free_nbytes: int
    transient_nbytes: int
    peak_nbytes: int
    after_nbytes: int
    host_link_nbytes: int
    network_nbytes: int
    seconds: float


@dataclass(frozen=True)
class RankPrediction:
    """Both switches of one rank."""

    rank: int
    to_infer: tuple[StepFigures, ...]
    to_train: tuple[StepFigures, ...]
    start_nbytes: int
    peak_nbytes: int
    """The larger peak of the two switches."""
    sent_nbytes: int
    received_nbytes: int
    state_nbytes: dict[str, int]
    """Bytes per kind: params, grads, optimizer, engine weights, KV cache."""

    @property
    def seconds(self) -> dict[str, float]:
        return {"to_infer": sum(s.seconds for s in self.to_infer), "to_train": sum(s.seconds for s in self.to_train)}


@dataclass(frozen=True)
class ClusterPlan:
    """Every planned rank's prediction, the worst of them, and what would make a cluster that does not fit fit."""

    world_size: int
    accelerator: AcceleratorFigures
    budget_nbytes: int
    ranks: tuple[RankPrediction, ...]
    advice: tuple[Advice, ...]

    @property
    def worst(self) -> RankPrediction:
        """The planned rank with the highest predicted peak (ties: the slower)."""
        return max(self.ranks, key=lambda p: (p.peak_nbytes, sum(p.seconds.values())))

    @property
    def fits(self) -> bool:
        return self.worst.peak_nbytes <= self.budget_nbytes

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"world_size": self.world_size, "accelerator": asdict(self.accelerator),
                "budget_nbytes": self.budget_nbytes, "fits": self.fits, "worst_rank": self.worst.rank,
                "advice": [asdict(a) for a in self.advice],
                "ranks": [{**asdict(p), "seconds": p.seconds} for p in self.ranks]}


def _train_layout(spec: ModelSpec, setup: TrainingSetup, world: int):
    if setup.kind == "fsdp2":
        return hf_source_layout(spec, world, shard_size=world)
    conv = MegatronConvention(stage_layers=setup.stage_layers) if setup.stage_layers else None
    return megatron_layout(spec, setup.parallel, world, convention=conv)


def _train_elements(layout, setup: TrainingSetup, rank: int) -> int:
    """Elements of the rank's training parameters as the trainer stores them: its shards (Megatron), or
    every tensor's ``fully_shard`` storage, padded to ``ceil(rows / shards)`` rows on every rank ([Note:
    FSDP2 shards])."""
    if setup.kind != "fsdp2":
        return sum(t.numel for t in layout.tensors(rank).values())
    shards, total = layout.shard_size, 0
    for name, full in hf_module_tensors(layout.spec, layout.fused_experts).items():
        rows, per_row = full.shape[0], math.prod(full.shape[1:])
        total += (rows if shards == 1 or name in layout.replicated else -(-rows // shards)) * per_row
    return total


def predict_rank(spec: ModelSpec, setup: TrainingSetup, infer: ParallelLayout, world: int, rank: int, *,
                 accel: AcceleratorFigures, offload: Mapping[StateKind, bool], kv_nbytes: int | None,
                 gpu_memory_utilization: float, infer_bytes: int, bucket_nbytes: int) -> RankPrediction:
    """Both switches of ``rank`` (see [Note: cluster plan])."""
    src = _train_layout(spec, setup, world)
    dst = vllm_layout(spec, infer, world)
    plan = build_plan(src, dst, itemsize=infer_bytes, bucket_nbytes=bucket_nbytes, rank=rank)
    elements = _train_elements(src, setup, rank)
    params = elements * setup.param_bytes + setup.buffer_nbytes
    grads = elements * setup.grad_bytes
    if setup.kind == "fsdp2":  # AdamW's moments are shaped like the local shard, not its padded storage
        local = src.tensors(rank).values()
        optimizer = 2 * sum(t.numel for t in local) * setup.param_bytes + 4 * len(local)
    else:
        dp = world // (setup.parallel.tp * setup.parallel.pp)
        optimizer = elements * setup.optimizer_bytes_per_param // (dp if setup.distributed_optimizer else 1)
    weights = plan.dst_nbytes(rank)
    kv = kv_nbytes if kv_nbytes is not None else max(0, int(gpu_memory_utilization * accel.memory_nbytes) - weights)
    state = {"param": params, "grad": grads, "optimizer": optimizer, "engine_weights": weights, "kv_cache": kv}
    offloaders = {StateKind.PARAM: _Offloader(StateKind.PARAM, params), StateKind.GRAD: _Offloader(StateKind.GRAD, grads),
                  StateKind.OPTIMIZER: _Offloader(StateKind.OPTIMIZER, optimizer)}
    engine, sync = _Engine(weights, kv), _Sync(plan.peak_temp_nbytes(rank))
    start = params + grads + optimizer
    to_infer = _walk(Direction.TO_INFER, start, offloaders, offload, engine, sync, plan, rank, accel, setup)
    for o in offloaders.values():
        o.state = OffloadState.ON_HOST if offload.get(o.kind) else OffloadState.ON_DEVICE
    to_train = _walk(Direction.TO_TRAIN, to_infer[-1].after_nbytes if to_infer else start, offloaders, offload,
                     engine, sync, plan, rank, accel, setup)
    peak = max([start, *(s.peak_nbytes for s in (*to_infer, *to_train))])
    return RankPrediction(rank=rank, to_infer=to_infer, to_train=to_train, start_nbytes=start, peak_nbytes=peak,
                          sent_nbytes=plan.send_nbytes(rank), received_nbytes=plan.recv_nbytes(rank), state_nbytes=state)


def _walk(direction: Direction, start: int, offloaders, offload, engine, sync, plan: ReshardPlan, rank: int,
          accel: AcceleratorFigures, setup: TrainingSetup) -> tuple[StepFigures, ...]:
    steps: list[SwitchStep] = switch_steps(direction, offloaders=offloaders, enabled=offload, accel=_Accel(),
                                           engine=engine, weight_sync=sync,
                                           extra=_adapter_steps(setup) if direction is Direction.TO_INFER else ())
    memory: MemoryPlan = plan_switch(direction, start, [(s.name, s.estimate()) for s in steps],
                                     budget_nbytes=accel.memory_nbytes, budget_source=accel.name)
    out = []
    for step, planned in zip(steps, memory.steps):
        host = net = 0
        seconds = 0.0
        if isinstance(step, (OffloadStep, OnloadStep)):
            host = step.offloader.live_nbytes()
            seconds = host / accel.host_link_bps
        elif isinstance(step, WeightSyncStep):
            net = plan.send_nbytes(rank) + plan.recv_nbytes(rank)
            seconds = _sync_seconds(plan, rank, accel)
        e = planned.estimate
        out.append(StepFigures(step.name, e.alloc_nbytes, e.free_nbytes, e.transient_nbytes, planned.peak_nbytes,
                               planned.after_nbytes, host, net, seconds))
    return tuple(out)


def _sync_seconds(plan: ReshardPlan, rank: int, accel: AcceleratorFigures) -> float:
    """The rank's local copies at the device's copy bandwidth, then per step of its share ([Note: plan
    schedule]: one peer to send to, one to receive from) the slower of its two directions, each over the
    link to that peer (full-duplex links), plus the step latency."""
    node = rank // accel.devices_per_node
    total = sum(t.numel * plan.cell_itemsize(t.hf_name) for t in plan.local[rank]) / accel.device_copy_bps
    for bucket in plan.buckets:
        seconds = {}
        for t in bucket:
            peer, way = (t.dst_rank, "send") if t.src_rank == rank else (t.src_rank, "recv")
            bps = accel.intra_node_bps if peer // accel.devices_per_node == node else accel.inter_node_bps
            seconds[way] = seconds.get(way, 0.0) + t.numel * plan.cell_itemsize(t.hf_name) / bps
        total += accel.step_latency_s + max(seconds.values(), default=0.0)
    return total


def _elements_per_rank(layout) -> list[int]:
    """Elements each rank of ``layout`` holds, from one build per rank group ([Note: layout parts])."""
    out = [0] * layout.world_size
    for family in layout.part_families():
        for key, ranks in family.groups.items():
            n = sum(t.numel for t in family.build(key).values())
            for r in ranks:
                out[r] += n
    return out


def _ranks_to_plan(spec: ModelSpec, setup: TrainingSetup, infer: ParallelLayout, world: int, count: int,
                   infer_bytes: int) -> list[int]:
    """The ``count`` ranks holding the most training and engine bytes (every rank when ``count >= world``)."""
    if count >= world:
        return list(range(world))
    train = _elements_per_rank(_train_layout(spec, setup, world))
    engine = _elements_per_rank(vllm_layout(spec, infer, world))
    size = sorted(((train[r] * setup.param_bytes + engine[r] * infer_bytes, -r) for r in range(world)), reverse=True)
    return sorted(-r for _, r in size[:count])


def plan_cluster(spec: ModelSpec, setup: TrainingSetup, infer: ParallelLayout, world: int, *,
                 accel: AcceleratorFigures, offload: Mapping[StateKind, bool] | None = None,
                 kv_nbytes: int | None = None, gpu_memory_utilization: float = 0.9, infer_bytes: int = 2,
                 bucket_nbytes: int = DEFAULT_BUCKET_NBYTES, ranks: int = 4, advise: bool = True) -> ClusterPlan:
    """Predict both switches of the ``ranks`` ranks with the most bytes (all of them when ``ranks >= world``).

    Raises:
        ValueError: A layout that does not fit the model or the world (named by the layouts' checks),
            or a bad figure.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
    if ranks < 1:
        raise ValueError(f"ranks={ranks} must be >= 1")
    offload = dict(offload or {k: True for k in (StateKind.PARAM, StateKind.GRAD, StateKind.OPTIMIZER)})
    args = dict(accel=accel, offload=offload, kv_nbytes=kv_nbytes, gpu_memory_utilization=gpu_memory_utilization,
                infer_bytes=infer_bytes, bucket_nbytes=bucket_nbytes)
    chosen = _ranks_to_plan(spec, setup, infer, world, ranks, infer_bytes)
    predictions = tuple(predict_rank(spec, setup, infer, world, r, **args) for r in chosen)
    result = ClusterPlan(world, accel, accel.memory_nbytes, predictions, ())
    if advise and not result.fits:
        result = replace(result, advice=tuple(_advice(spec, setup, infer, world, result, args)))
    return result


@dataclass(frozen=True)
class Advice:
    """A change that makes the worst rank fit, checked by planning it again with the change."""

    knob: str
    """What to change, in the config's words."""
    options: tuple[str, ...]
    """The same change as ``hybridmem plan`` options."""
    peak_nbytes: int
    """The worst rank's peak with it."""


def _advice(spec: ModelSpec, setup: TrainingSetup, infer: ParallelLayout, world: int, result: ClusterPlan,
            args: dict) -> list[Advice]:
    """Knobs that make the worst rank fit: each alone, else all of them together."""
    worst, budget = result.worst, result.budget_nbytes
    if worst.start_nbytes > budget:
        return [Advice(f"none: the training state alone needs {worst.start_nbytes / GB:.1f} GB of "
                       f"{budget / GB:.1f} GB on rank {worst.rank}; use more ranks or more training parallelism",
                       (), worst.start_nbytes)]

    def peak(**change) -> int:
        return predict_rank(spec, setup, infer, world, worst.rank, **{**args, **change}).peak_nbytes

    def kv_fitting(**change) -> int | None:
        """The largest KV cache that fits with ``change`` (what the switch holds when the KV cache comes
        last, subtracted from the budget), checked; None when not even an empty one fits."""
        empty = predict_rank(spec, setup, infer, world, worst.rank, **{**args, **change, "kv_nbytes": 0})
        kv = budget - empty.to_infer[-1].after_nbytes
        return kv if empty.peak_nbytes <= budget and kv > 0 and peak(**change, kv_nbytes=kv) <= budget else None

    off, out = args["offload"], []
    names = {k: k.value for k in (StateKind.PARAM, StateKind.GRAD, StateKind.OPTIMIZER)}
    for kind in (StateKind.OPTIMIZER, StateKind.GRAD, StateKind.PARAM):
        if not off.get(kind):
            more = {**off, kind: True}
            if (p := peak(offload=more)) <= budget:
                listed = ",".join(names[k] for k in names if more.get(k))
                out.append(Advice(f"offload_train_{kind.value}: true", ("--offload", listed), p))
    small = 64 * 2**20
    if small < args["bucket_nbytes"] and (p := peak(bucket_nbytes=small)) <= budget:
        out.append(Advice(f"reshard_bucket_bytes: {small}", ("--bucket-mib", "64"), p))
    kv = kv_fitting()
    if kv is not None and kv > 0:
        out.append(Advice(f"a KV cache of at most {kv / GB:.2f} GB per rank", ("--kv-cache-bytes", str(kv)), budget))
    if out:
        return out
    everything = {k: True for k in names}
    kv = kv_fitting(offload=everything, bucket_nbytes=min(small, args["bucket_nbytes"]))
    if kv is not None and kv > 0:
        return [Advice(f"together: offload_train_param, offload_train_grad and offload_train_optimizer true, "
                       f"reshard_bucket_bytes: {min(small, args['bucket_nbytes'])}, a KV cache of at most "
                       f"{kv / GB:.2f} GB per rank",
                       ("--offload", "param,grad,optimizer", "--bucket-mib",
                        str(min(small, args["bucket_nbytes"]) // 2**20), "--kv-cache-bytes", str(kv)), budget)]
    return [Advice(f"none of offloading, a smaller bucket or a smaller KV cache: rank {worst.rank} peaks at "
                   f"{worst.peak_nbytes / GB:.1f} GB of {budget / GB:.1f} GB even with all of them; use more ranks "
                   f"or a larger inference tp/ep", (), worst.peak_nbytes)]

