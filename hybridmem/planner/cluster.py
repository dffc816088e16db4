"""Predict both switches of every rank of a cluster before renting it: bytes freed and moved, transient
buffers, peak device memory, time, and whether it fits (``hybridmem plan``).

[Note: cluster plan]
Nothing here has its own idea of a switch. For each rank, stand-ins answer the questions the runtime's
steps ask of real offloaders, engines and weight syncs (``live_nbytes``, ``planned_nbytes``,
``temp_nbytes``), with figures read from the same layouts the runtime reshards with; the runtime's
:func:`~hybridmem.switch.steps.switch_steps` orders the steps and
:func:`~hybridmem.switch.memplan.plan_switch` walks them, so a prediction and a run cannot drift apart. The
weight sync's figures are the rank's own share of the resharding plan (``build_plan(..., rank=r)``): bytes
sent and received, peers (same node or not), largest staging buffer. What the stand-ins hold per rank:

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
  inference dtype (a tensor the model keeps in fp32 counted in fp32); an FP8 engine (``infer_fp8``, the
  FP8 vLLM layout, [Note: fp8 block layout] in :mod:`hybridmem.reshard.fp8`): one byte a quantized weight
  element and four a 128x128 block's scale, the tensors vLLM does not quantize in the inference dtype;
- KV cache: given, or vLLM's rule: ``gpu_memory_utilization`` of the device minus the engine weights;
- an engine in its own process (``engine_process``, vLLM's ``AsyncLLM`` or ``vllm serve`` with hybridmem's
  bucket transport): its :data:`~hybridmem.contract.buckets.NUM_BUCKETS` transfer buckets on the rank's
  device, held in both phases, so every step of both switches counts them (the owner ``"engine
  buckets"``). Their size is given, or the engine's own default
  (:func:`~hybridmem.contract.buckets.default_bucket_nbytes`) of the device's memory less the rank's
  training state: the engine measures its free memory at construction, which anything else on the
  device then (a vLLM on the same device) makes smaller, so the plan's default is the largest the
  engine would take.

The optimizer state of Megatron's distributed optimizer is divided over the ranks holding the same
parameters: the data-parallel ranks for the dense part, the expert-data-parallel ranks (``world / (pp *
ep * expert tp)``) for the experts; both are the rank groups of the layout's part groups ([Note:
layout parts] in :mod:`hybridmem.reshard.layouts`).

Times are bytes over bandwidths: offload and onload over the host link; the sync's local copies at the
device's copy bandwidth, and each resharding step's larger direction over the link to its peer (NVLink
within the NVLink domain, the network across), plus a fixed latency per step; a level-1 engine sleep
copies the weights over the host link at its first release and back at the weights' resume.
tests/planner/test_cluster_plan.py runs the switches on gloo at 4 and 8 ranks and checks the predicted
steps and bytes equal the runtime's. Host memory per node: [Note: host plan] in :mod:`hybridmem.planner.host`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

import torch

from hybridmem.config import ParallelLayout
from hybridmem.contract.buckets import MIN_BUCKET_NBYTES, NUM_BUCKETS, default_bucket_nbytes
from hybridmem.contract.engine import EngineCapabilities
from hybridmem.contract.kinds import KV_CACHE, WEIGHTS, StateKind
from hybridmem.offload import OffloadState
from hybridmem.planner.advice import Advice, advice_for
from hybridmem.planner.host import SLEEP_LEVELS, NodeHost, node_hosts, rank_host_nbytes
from hybridmem.planner.presets import ACCELERATORS, GB, AcceleratorFigures
from hybridmem.reshard import (
    DEFAULT_BUCKET_NBYTES,
    MegatronConvention,
    ModelSpec,
    ReshardPlan,
    VLLMConvention,
    build_plan,
    hf_layout,
    hf_source_layout,
    megatron_layout,
    vllm_layout,
)
from hybridmem.reshard.fp8 import FP8_BLOCK, QUANTIZABLE_DTYPES, SCALE_SUFFIX
from hybridmem.reshard.hf_source import hf_module_tensors
from hybridmem.reshard.layouts import ShardLayout, fp8_quantized_names
from hybridmem.switch.agreement import AgreeStep
from hybridmem.switch.memplan import MemoryPlan, plan_switch
from hybridmem.switch.owners import ENGINE_BUFFERS_OWNER
from hybridmem.switch.phase import Direction
from hybridmem.switch.steps import (
    FSDP_BUFFERS,
    MEGATRON_WORKSPACES,
    EngineReleaseStep,
    EngineResumeStep,
    OffloadStep,
    OnloadStep,
    ReleaseBuffersStep,
    SwitchStep,
    WeightSyncStep,
    switch_steps,
)
from hybridmem.weight_sync.fp8 import Fp8Target

__all__ = ["AcceleratorFigures", "ACCELERATORS", "GB", "TrainingSetup", "RankPrediction", "ClusterPlan",
           "Advice", "plan_cluster", "hf_buffer_nbytes"]


@dataclass(frozen=True, kw_only=True)
class TrainingSetup:
    """How training holds its state on a rank."""

    kind: str = "megatron"
    """``"megatron"`` (tp/pp/ep shards) or ``"fsdp2"`` (transformers' names, ``fully_shard`` over all
    ranks)."""
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
    ``inv_freq``, fp32; :func:`hf_buffer_nbytes` counts them)."""
    host_buffer_nbytes: int = 0
    """The training framework's own host buffers per rank ([Note: host plan] in
    :mod:`hybridmem.planner.host`); 0: none known."""

    def __post_init__(self) -> None:
        if self.kind not in ("megatron", "fsdp2"):
            raise ValueError(f"training kind={self.kind!r}; expected 'megatron' or 'fsdp2'")
        if self.host_buffer_nbytes < 0:
            raise ValueError(f"host_buffer_nbytes={self.host_buffer_nbytes} must be >= 0")
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

    def arena_growth_nbytes(self) -> int:
        # the manager prewarms the arenas before the first switch ([Note: host plan] in
        # :mod:`hybridmem.planner.host`)
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



def _adapter_steps(setup: TrainingSetup) -> list[tuple[int, SwitchStep]]:
    """The steps the training adapter registers, as the runtime orders them."""
    placement = FSDP_BUFFERS if setup.kind == "fsdp2" else MEGATRON_WORKSPACES
    return [(placement.order, ReleaseBuffersStep(_Nothing(), placement))]


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
    """Bytes per kind: params, grads, optimizer, engine weights, KV cache, and with an engine in its own
    process its transfer buckets (``"engine buckets"``, both together)."""
    host_nbytes: dict[str, int]
    """Host bytes at the rank's host peak, by source ([Note: host plan] in :mod:`hybridmem.planner.host`)."""

    @property
    def seconds(self) -> dict[str, float]:
        return {"to_infer": sum(s.seconds for s in self.to_infer),
                "to_train": sum(s.seconds for s in self.to_train)}


@dataclass(frozen=True)
class ClusterPlan:
    """Every planned rank's prediction, the worst of them, every node's host memory, and what would make a
    cluster that does not fit fit."""

    world_size: int
    accelerator: AcceleratorFigures
    budget_nbytes: int
    """Device memory per rank."""
    ranks: tuple[RankPrediction, ...]
    advice: tuple[Advice, ...]
    nodes: tuple[NodeHost, ...] = ()
    """Every node's host bytes (all ranks, planned or not)."""
    host_budget_nbytes: int | None = None
    """Host memory per node; ``None``: not checked."""
    sleep_level: int = 2

    @property
    def worst(self) -> RankPrediction:
        """The planned rank with the highest predicted peak (ties: the slower)."""
        return max(self.ranks, key=lambda p: (p.peak_nbytes, sum(p.seconds.values())))

    @property
    def worst_node(self) -> NodeHost | None:
        """The node with the highest host peak (ties: the first)."""
        return max(self.nodes, key=lambda n: (n.peak_nbytes, -n.node), default=None)

    @property
    def device_fits(self) -> bool:
        return self.worst.peak_nbytes <= self.budget_nbytes

    @property
    def host_fits(self) -> bool:
        worst = self.worst_node
        budget = self.host_budget_nbytes
        return budget is None or worst is None or worst.peak_nbytes <= budget

    @property
    def fits(self) -> bool:
        return self.device_fits and self.host_fits

    def to_dict(self) -> dict:
        """JSON-ready form."""
        worst_node = self.worst_node
        return {"world_size": self.world_size, "accelerator": asdict(self.accelerator),
                "budget_nbytes": self.budget_nbytes, "fits": self.fits, "device_fits": self.device_fits,
                "worst_rank": self.worst.rank, "host_budget_nbytes": self.host_budget_nbytes,
                "host_fits": self.host_fits, "sleep_level": self.sleep_level,
                "worst_node": None if worst_node is None else worst_node.node,
                "host_peak_nbytes": None if worst_node is None else worst_node.peak_nbytes,
                "advice": [asdict(a) for a in self.advice],
                "nodes": [{**asdict(n), "peak_nbytes": n.peak_nbytes} for n in self.nodes],
                "ranks": [{**asdict(p), "seconds": p.seconds} for p in self.ranks]}


def _train_layout(spec: ModelSpec, setup: TrainingSetup, world: int):
    if setup.kind == "fsdp2":
        return hf_source_layout(spec, world, shard_size=world)
    conv = MegatronConvention(stage_layers=setup.stage_layers) if setup.stage_layers else None
    return megatron_layout(spec, setup.parallel, world, convention=conv)


def _fsdp2_storage_elements(layout) -> int:
    """Elements of every tensor's ``fully_shard`` storage on a rank, padded to ``ceil(rows / shards)`` rows
    on every rank ([Note: FSDP2 shards] in :mod:`hybridmem.reshard.hf_source`)."""
    shards, total = layout.shard_size, 0
    for name, full in hf_module_tensors(layout.spec, layout.fused_experts).items():
        rows, per_row = full.shape[0], math.prod(full.shape[1:])
        total += (rows if shards == 1 or name in layout.replicated else -(-rows // shards)) * per_row
    return total


@dataclass(frozen=True)
class RankState:
    """What one rank holds: bytes per kind and the host arenas its offloaders fill."""

    nbytes: dict[str, int]
    """``param``, ``grad``, ``optimizer``, ``engine_weights``."""
    arenas: dict[StateKind, tuple[int, ...]]
    """Per offloaded kind, the bytes of each of its arenas (one per dtype)."""


_DTYPES = {2: torch.bfloat16, 4: torch.float32}
"""The torch dtype of a training or inference element size, where the FP8 plan needs one."""


def _engine_layout(spec: ModelSpec, infer: ParallelLayout, world: int, fp8: bool) -> ShardLayout:
    """The engine's vLLM layout: FP8 with 128x128 blocks (``fp8``), else its plain one."""
    return vllm_layout(spec, infer, world, convention=VLLMConvention(weight_block_size=FP8_BLOCK) if fp8
                       else None)


def _engine_tensor_nbytes(spec: ModelSpec, local, infer_bytes: int, quantized: frozenset[str]) -> int:
    """Bytes of one engine tensor: a quantized weight one a element, its scales four, the rest
    ``infer_bytes`` (fp32 where the model keeps a tensor in fp32)."""
    if not local.pieces:
        return local.numel * infer_bytes
    hf = local.pieces[0].hf_name
    if hf in quantized:
        return local.numel
    if hf.endswith(SCALE_SUFFIX):
        return 4 * local.numel
    return local.numel * spec.wire_itemsize(hf, infer_bytes)


def _check_fp8(spec: ModelSpec, setup: TrainingSetup) -> None:
    """An FP8 engine's weights are quantized from the training weights: refuse a parameter dtype the
    quantizer cannot take (the layout refuses a family without an FP8 layout, by name)."""
    if _DTYPES.get(setup.param_bytes) not in QUANTIZABLE_DTYPES:
        raise ValueError(f"param_bytes={setup.param_bytes}: an FP8 engine's weights are quantized from the "
                         "training weights, which must be bf16/fp16 (2 bytes) or fp32 (4)")


def rank_states(spec: ModelSpec, setup: TrainingSetup, infer: ParallelLayout, world: int, *,
                infer_bytes: int, infer_fp8: bool = False) -> list[RankState]:
    """Every rank's :class:`RankState`, from one build per rank group of each layout ([Note: layout parts] in
    :mod:`hybridmem.reshard.layouts`); ``infer_fp8``: an FP8 engine, whose tensors vLLM does not quantize are
    in ``infer_bytes``."""
    src, dst = _train_layout(spec, setup, world), _engine_layout(spec, infer, world, infer_fp8)
    quantized = frozenset(fp8_quantized_names(spec)) if infer_fp8 else frozenset()
    local, num_tensors, optimizer, weights = [0] * world, [0] * world, [0] * world, [0] * world
    for part in src.part_groups():
        for key, ranks in part.groups.items():
            tensors = part.build(key).values()
            n = sum(t.numel for t in tensors)
            # Megatron's distributed optimizer divides a part's state over the ranks holding it ([Note:
            # cluster plan]).
            share = n * setup.optimizer_bytes_per_param // (len(ranks) if setup.distributed_optimizer else 1)
            for r in ranks:
                local[r] += n
                num_tensors[r] += len(tensors)
                optimizer[r] += share
    for part in dst.part_groups():
        for key, ranks in part.groups.items():
            n = sum(_engine_tensor_nbytes(spec, t, infer_bytes, quantized) for t in part.build(key).values())
            for r in ranks:
                weights[r] += n
    padded = _fsdp2_storage_elements(src) if setup.kind == "fsdp2" else 0  # the same on every rank
    out = []
    for r in range(world):
        elements = padded if setup.kind == "fsdp2" else local[r]
        # AdamW's moments, shaped like the local shard (not its padded storage), and steps
        if setup.kind == "fsdp2":
            moments, steps = 2 * local[r] * setup.param_bytes, 4 * num_tensors[r]
            opt_arenas = (moments + steps,) if setup.param_bytes == 4 else (moments, steps)
        else:
            opt_arenas = (optimizer[r],)
        weight_bytes = elements * setup.param_bytes
        param_arenas = (weight_bytes + setup.buffer_nbytes,) if setup.param_bytes == 4 else (weight_bytes,
                                                                                            setup.buffer_nbytes)
        nbytes = {"param": weight_bytes + setup.buffer_nbytes, "grad": elements * setup.grad_bytes,
                  "optimizer": sum(opt_arenas), "engine_weights": weights[r]}
        out.append(RankState(nbytes, {StateKind.PARAM: tuple(a for a in param_arenas if a),
                                      StateKind.GRAD: (nbytes["grad"],), StateKind.OPTIMIZER: opt_arenas}))
    return out


def _rank_host(state: RankState, setup: TrainingSetup, accel: AcceleratorFigures,
               offload: Mapping[StateKind, bool], sleep_level: int) -> dict[str, int]:
    return rank_host_nbytes(state.arenas, offload=offload, weights_nbytes=state.nbytes["engine_weights"],
                            sleep_level=sleep_level, framework_nbytes=setup.host_buffer_nbytes,
                            rounds_up=accel.pinned_rounds_up)


def predict_rank(spec: ModelSpec, setup: TrainingSetup, infer: ParallelLayout, world: int, rank: int, *,
                 accel: AcceleratorFigures, offload: Mapping[StateKind, bool], kv_nbytes: int | None,
                 gpu_memory_utilization: float, infer_bytes: int, bucket_nbytes: int, sleep_level: int = 2,
                 engine_process: bool = False, engine_bucket_nbytes: int | None = None,
                 state: RankState | None = None, infer_fp8: bool = False) -> RankPrediction:
    """Both switches of ``rank`` (see [Note: cluster plan]); ``state``: the rank's entry of
    :func:`rank_states` (computed when not given); ``engine_process``: the engine's transfer buckets held
    on the device throughout (``engine_bucket_nbytes`` each, ``None``: the engine's default); ``infer_fp8``:
    an FP8 engine, synced as ``ReshardSync`` syncs one ([Note: fp8 sync] in
    :mod:`hybridmem.weight_sync.fp8`): the plan into the rank's unquantized shards (an engine in its own
    process, which takes its own layout), or into its stage's full tensors (vLLM in the trainer's process,
    which takes the FP8 checkpoint's tensors), each cell of a weight vLLM quantizes that is whole blocks moved
    as e4m3 bytes and block scales, the others in the training dtype ([Note: quantized cells] in
    :mod:`hybridmem.reshard.plan`)."""
    src = _train_layout(spec, setup, world)
    if infer_fp8:
        _check_fp8(spec, setup)
        into = (_engine_layout(spec, infer, world, True) if engine_process
                else hf_layout(spec, infer, world))
        target = Fp8Target(into, rank, _DTYPES.get(infer_bytes))
        plan = build_plan(src, target.plan_layout(), itemsize=setup.param_bytes,
                          bucket_nbytes=bucket_nbytes, rank=rank, quantized=target.quantized_names())
        temp = target.sync_temp_nbytes(plan, _DTYPES[setup.param_bytes])
    else:
        dst = vllm_layout(spec, infer, world)
        plan = build_plan(src, dst, itemsize=infer_bytes, bucket_nbytes=bucket_nbytes, rank=rank)
        temp = plan.peak_temp_nbytes(rank)
    if state is None:
        state = rank_states(spec, setup, infer, world, infer_bytes=infer_bytes, infer_fp8=infer_fp8)[rank]
    params, grads, optimizer = (state.nbytes[k] for k in ("param", "grad", "optimizer"))
    weights = state.nbytes["engine_weights"]
    kv = (kv_nbytes if kv_nbytes is not None
          else max(0, int(gpu_memory_utilization * accel.memory_nbytes) - weights))
    figures = {**state.nbytes, "kv_cache": kv}
    start = params + grads + optimizer
    if engine_process:
        free = max(0, accel.memory_nbytes - start)
        each = (engine_bucket_nbytes if engine_bucket_nbytes is not None
                else default_bucket_nbytes(accel.device_type, free_nbytes=free))
        figures[ENGINE_BUFFERS_OWNER] = NUM_BUCKETS * each
        start += figures[ENGINE_BUFFERS_OWNER]
    offloaders = {StateKind.PARAM: _Offloader(StateKind.PARAM, params),
                  StateKind.GRAD: _Offloader(StateKind.GRAD, grads),
                  StateKind.OPTIMIZER: _Offloader(StateKind.OPTIMIZER, optimizer)}
    engine, sync = _Engine(weights, kv), _Sync(temp)
    walk = dict(offloaders=offloaders, offload=offload, engine=engine, sync=sync, plan=plan, rank=rank,
                accel=accel, setup=setup, sleep_level=sleep_level)
    to_infer = _walk(Direction.TO_INFER, start, **walk)
    for o in offloaders.values():
        o.state = OffloadState.ON_HOST if offload.get(o.kind) else OffloadState.ON_DEVICE
    to_train = _walk(Direction.TO_TRAIN, to_infer[-1].after_nbytes if to_infer else start, **walk)
    peak = max([start, *(s.peak_nbytes for s in (*to_infer, *to_train))])
    return RankPrediction(rank=rank, to_infer=to_infer, to_train=to_train, start_nbytes=start,
                          peak_nbytes=peak, sent_nbytes=plan.send_nbytes(rank),
                          received_nbytes=plan.recv_nbytes(rank), state_nbytes=figures,
                          host_nbytes=_rank_host(state, setup, accel, offload, sleep_level))


def _walk(direction: Direction, start: int, *, offloaders, offload, engine, sync, plan: ReshardPlan,
          rank: int, accel: AcceleratorFigures, setup: TrainingSetup,
          sleep_level: int) -> tuple[StepFigures, ...]:
    extra = _adapter_steps(setup) if direction is Direction.TO_INFER else ()
    steps: list[SwitchStep] = switch_steps(direction, offloaders=offloaders, enabled=offload, accel=_Accel(),
                                           engine=engine, weight_sync=sync, extra=extra,
                                           agree=AgreeStep(_VOTE_STAND_IN) if plan.world_size > 1 else None)
    memory: MemoryPlan = plan_switch(direction, start, [(s.name, s.estimate()) for s in steps],
                                     budget_nbytes=accel.memory_nbytes, budget_source=accel.name)
    out = []
    for step, planned in zip(steps, memory.steps, strict=False):
        host = net = 0
        seconds = 0.0
        if isinstance(step, (OffloadStep, OnloadStep)):
            host = step.offloader.live_nbytes()
            seconds = host / accel.host_link_bps
        elif isinstance(step, WeightSyncStep):
            net = plan.send_nbytes(rank) + plan.recv_nbytes(rank)
            seconds = _sync_seconds(plan, rank, accel)
        elif isinstance(step, AgreeStep):  # one all_reduce of a 4-byte flag per rank: a latency, no volume
            seconds = accel.step_latency_s
        elif sleep_level == 1 and (isinstance(step, EngineResumeStep) and step.tag == WEIGHTS
                                   or isinstance(step, EngineReleaseStep) and step.tag == KV_CACHE):
            # A level-1 sleep copies the weights out at the first release (the KV cache's) and back at the
            # weights' resume ([Note: host plan] in :mod:`hybridmem.planner.host`).
            host = engine.weights_nbytes
            seconds = host / accel.host_link_bps
        e = planned.estimate
        out.append(StepFigures(step.name, e.alloc_nbytes, e.free_nbytes, e.transient_nbytes,
                               planned.peak_nbytes, planned.after_nbytes, host, net, seconds))
    return tuple(out)


_VOTE_STAND_IN = None
"""The vote a plan's agreement step stands for (a plan never runs its steps)."""


def _sync_seconds(plan: ReshardPlan, rank: int, accel: AcceleratorFigures) -> float:
    """The rank's local copies at the device's copy bandwidth, then per step of its share ([Note: plan
    schedule] in :mod:`hybridmem.reshard.schedule`: one peer to send to, one to receive from) the slower of
    its two directions, each over the link to that peer (full-duplex links), plus the step latency."""
    domain = rank // accel.nvlink_domain
    total = sum(t.numel * plan.cell_itemsize(t.hf_name) for t in plan.local[rank]) / accel.device_copy_bps
    for bucket in plan.buckets:
        seconds = {}
        for t in bucket:
            peer, way = (t.dst_rank, "send") if t.src_rank == rank else (t.src_rank, "recv")
            bps = accel.intra_node_bps if peer // accel.nvlink_domain == domain else accel.inter_node_bps
            seconds[way] = seconds.get(way, 0.0) + t.numel * plan.cell_itemsize(t.hf_name) / bps
        total += accel.step_latency_s + max(seconds.values(), default=0.0)
    return total


def _elements_per_rank(layout) -> list[int]:
    """Elements each rank of ``layout`` holds, from one build per rank group ([Note: layout parts] in
    :mod:`hybridmem.reshard.layouts`)."""
    out = [0] * layout.world_size
    for part in layout.part_groups():
        for key, ranks in part.groups.items():
            n = sum(t.numel for t in part.build(key).values())
            for r in ranks:
                out[r] += n
    return out


def _ranks_to_plan(spec: ModelSpec, setup: TrainingSetup, infer: ParallelLayout, world: int, count: int,
                   infer_bytes: int, engine_nbytes: list[int] | None = None) -> list[int]:
    """The ``count`` ranks holding the most training and engine bytes (every rank when ``count >= world``);
    ``engine_nbytes``: each rank's engine bytes (default: its vLLM layout's elements in ``infer_bytes``)."""
    if count >= world:
        return list(range(world))
    train = _elements_per_rank(_train_layout(spec, setup, world))
    engine = engine_nbytes or [n * infer_bytes for n in _elements_per_rank(vllm_layout(spec, infer, world))]
    size = sorted(((train[r] * setup.param_bytes + engine[r], -r) for r in range(world)), reverse=True)
    return sorted(-r for _, r in size[:count])


def plan_cluster(spec: ModelSpec, setup: TrainingSetup, infer: ParallelLayout, world: int, *,
                 accel: AcceleratorFigures, offload: Mapping[StateKind, bool] | None = None,
                 kv_nbytes: int | None = None, gpu_memory_utilization: float = 0.9, infer_bytes: int = 2,
                 bucket_nbytes: int = DEFAULT_BUCKET_NBYTES, sleep_level: int = 2, ranks: int = 4,
                 engine_process: bool = False, engine_bucket_nbytes: int | None = None,
                 advise: bool = True, infer_fp8: bool = False) -> ClusterPlan:
    """Predict both switches of the ``ranks`` ranks with the most bytes (all of them when ``ranks >= world``),
    and every node's host bytes ([Note: host plan] in :mod:`hybridmem.planner.host`).

    Args:
        sleep_level: The engine's sleep level: 2 (weights discarded; hybridmem's vLLM adapter's default)
            or 1 (weights kept in host memory).
        engine_process: The engine runs in its own process with hybridmem's bucket transport: its
            transfer buckets stay on every rank's device ([Note: cluster plan]).
        engine_bucket_nbytes: Bytes per bucket (``VLLMServerEngine``'s ``bucket_nbytes``); ``None``: the
            engine's default.
        infer_fp8: The engine serves FP8 with 128x128 block scales (the tensors vLLM does not quantize in
            ``infer_bytes``), synced into the ranks' unquantized shards (``engine_process``) or their stages'
            full tensors ([Note: fp8 sync] in :mod:`hybridmem.weight_sync.fp8`).

    Raises:
        ValueError: A layout that does not fit the model or the world (named by the layouts' checks; an
            FP8 engine of a family without an FP8 layout among them), or a bad figure.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be in (0, 1]")
    if ranks < 1:
        raise ValueError(f"ranks={ranks} must be >= 1")
    if sleep_level not in SLEEP_LEVELS:
        raise ValueError(f"sleep_level={sleep_level!r}; expected one of {SLEEP_LEVELS}")
    if engine_process and accel.device_type != "cuda":
        raise ValueError(f"engine_process on accelerator {accel.name} ({accel.device_type}): an engine in "
                         "its own process moves weights through CUDA IPC only; an NPU engine runs in the "
                         "trainer's process (VLLMEngine)")
    if engine_bucket_nbytes is not None and not engine_process:
        raise ValueError(f"engine_bucket_nbytes={engine_bucket_nbytes} is for an engine in its own process "
                         "(engine_process)")
    if engine_bucket_nbytes is not None and engine_bucket_nbytes < MIN_BUCKET_NBYTES:
        raise ValueError(f"engine_bucket_nbytes={engine_bucket_nbytes}; expected at least "
                         f"{MIN_BUCKET_NBYTES} (one page), or None for the engine's default")
    offload = dict(offload or {k: True for k in (StateKind.PARAM, StateKind.GRAD, StateKind.OPTIMIZER)})
    args = dict(accel=accel, offload=offload, kv_nbytes=kv_nbytes,
                gpu_memory_utilization=gpu_memory_utilization,
                infer_bytes=infer_bytes, bucket_nbytes=bucket_nbytes, sleep_level=sleep_level,
                engine_process=engine_process, engine_bucket_nbytes=engine_bucket_nbytes, infer_fp8=infer_fp8)
    if infer_fp8:
        _check_fp8(spec, setup)
    states = rank_states(spec, setup, infer, world, infer_bytes=infer_bytes, infer_fp8=infer_fp8)
    chosen = _ranks_to_plan(spec, setup, infer, world, ranks, infer_bytes,
                            [s.nbytes["engine_weights"] for s in states] if infer_fp8 else None)
    return _plan(spec, setup, infer, world, states, chosen, args, advise=advise)


def _plan(spec: ModelSpec, setup: TrainingSetup, infer: ParallelLayout, world: int, states: list[RankState],
          chosen: list[int], args: dict, *, advise: bool) -> ClusterPlan:
    """:func:`plan_cluster` once every rank's state and the ranks to plan are known: none of the changes
    the advice tries (offload, bucket, KV cache, sleep level, pinned rounding) changes them, so its
    replans reuse them."""
    accel, offload, sleep_level = args["accel"], args["offload"], args["sleep_level"]
    predictions = tuple(predict_rank(spec, setup, infer, world, r, state=states[r], **args) for r in chosen)
    nodes = node_hosts([_rank_host(s, setup, accel, offload, sleep_level) for s in states],
                       accel.devices_per_node)
    result = ClusterPlan(world, accel, accel.memory_nbytes, predictions, (), nodes, accel.host_memory_nbytes,
                         sleep_level)
    if advise and not result.fits:
        def predict(rank: int | None = None, **change) -> RankPrediction:
            rank = result.worst.rank if rank is None else rank
            return predict_rank(spec, setup, infer, world, rank, state=states[rank], **{**args, **change})

        def host_peak(**change) -> int:
            a = {**args, **change}
            hosts = [_rank_host(s, setup, a["accel"], a["offload"], a["sleep_level"]) for s in states]
            return max(n.peak_nbytes for n in node_hosts(hosts, a["accel"].devices_per_node))

        def replan(**change) -> ClusterPlan:
            return _plan(spec, setup, infer, world, states, chosen, {**args, **change}, advise=False)

        result = replace(result, advice=tuple(advice_for(result, args, predict=predict, host_peak=host_peak,
                                                         replan=replan)))
    return result
