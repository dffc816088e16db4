"""ReshardSync: the TRAIN->INFER weight sync through the resharding engine.

ShardingManager calls :meth:`ReshardSync.sync` on every rank during the weight-sync step, after the
engine's weight storage is resumed. How the weights reach the engine is one :class:`ReshardRoute`, the first
the engine's capabilities allow: written in place into its own tensors, streamed as complete tensors of its
own (vLLM) layout, or streamed as full HF-named tensors of its pipeline stage.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

from hybridmem.accel.group import rank_and_size
from hybridmem.config import ParallelLayout
from hybridmem.contract.engine import capabilities_of
from hybridmem.reshard import (
    DEFAULT_BUCKET_NBYTES,
    CellChecksums,
    HFSourceLayout,
    MegatronConvention,
    ModelSpec,
    ReshardPlan,
    TransferStats,
    VLLMConvention,
    build_plan,
    hf_layout,
    hf_source_layout,
    iter_layout_tensors,
    megatron_layout,
    run_plan,
    stream_peak_nbytes,
    vllm_layout,
)
from hybridmem.reshard.deadline import deadline_bound
from hybridmem.reshard.fp8_stream import iter_fp8_layout_tensors
from hybridmem.reshard.hf_source import looks_hf_named
from hybridmem.weight_sync.base import (
    SyncStats,
    WeightSync,
    dominant_dtype,
    dtype_note,
    engine_dtypes,
    engine_unwritten,
)
from hybridmem.weight_sync.fp8 import Fp8Target, check_quantizable, engine_block

if TYPE_CHECKING:
    from hybridmem.contract.engine import InferenceEngine

__all__ = ["ReshardSync", "ReshardRoute", "default_deadline_s"]

DEADLINE_BASE_S = 120.0
"""Seconds every sync's deadline allows beyond its bytes: process start-up skew, the engine's own load."""
DEADLINE_SLOWEST_BPS = 100e6
"""The slowest link a default deadline allows for (bytes per second)."""


def default_deadline_s(plan: ReshardPlan, rank: int) -> float:
    """The deadline of a sync on ``rank`` when none is given: :data:`DEADLINE_BASE_S` plus the rank's plan
    bytes (sent and received) at :data:`DEADLINE_SLOWEST_BPS` (a 10 GiB sync: 227 s), far below the 30
    minutes a process group waits by default."""
    return DEADLINE_BASE_S + (plan.send_nbytes(rank) + plan.recv_nbytes(rank)) / DEADLINE_SLOWEST_BPS

SourceFn = Callable[[], Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]]


class ReshardRoute(Enum):
    """How a :class:`ReshardSync` hands the weights to the engine: the first its capabilities allow
    (:meth:`of`; [Note: engine capabilities] in :mod:`hybridmem.contract.engine`); into an FP8 engine, one of
    the streams, its layout's where it takes that, else the FP8 checkpoint's tensors of its stage, never in
    place ([Note: fp8 sync] in :mod:`hybridmem.weight_sync.fp8`)."""

    IN_PLACE = "written in place into the engine's own tensors"
    """``writes_in_place``: the plan's vLLM-layout cells are copied into ``named_parameters()``
    (:func:`~hybridmem.reshard.run_plan`); only the plan's staging buffers are extra memory."""
    LAYOUT_STREAM = "complete tensors of the engine's own layout, streamed"
    """``streams_layout``: this rank's vLLM-layout tensors, in the engine's dtype, into
    ``load_layout_weights`` (:func:`~hybridmem.reshard.iter_layout_tensors`); only the tensors in flight are
    extra memory."""
    HF_STREAM = "full HF-named tensors of its pipeline stage, streamed"
    """Neither: this rank's stage's full HF tensors, in the wire dtype, into ``load_weights``
    (:func:`~hybridmem.reshard.iter_full_tensors`); only the tensors in flight are extra memory."""

    @classmethod
    def of(cls, engine: InferenceEngine) -> ReshardRoute:
        """The route ``engine``'s declared capabilities allow, in the order of the members."""
        capabilities = capabilities_of(engine)
        if capabilities.writes_in_place:
            return cls.IN_PLACE
        return cls.LAYOUT_STREAM if capabilities.streams_layout else cls.HF_STREAM


class ReshardSync(WeightSync):
    """Reshard training weights (Megatron or HF-named) into an inference engine on every switch.

    Args:
        spec: The model's shapes.
        src: Training layout (e.g. ``HybridConfig.train_layout``), or a prebuilt source layout of
            ``group``'s size (an :class:`~hybridmem.reshard.hf_source.HFSourceLayout` for HF-named
            weights, replicated or FSDP2-sharded); ``megatron`` is then unused. A training layout with
            sources named as transformers names them (a plain or DDP model) means every rank holds them
            whole (:func:`~hybridmem.reshard.hf_source.hf_source_layout`); it must then be tp = pp = ep = 1.
        dst: Inference layout (e.g. ``HybridConfig.infer_layout``).
        group: The process group spanning both layouts (``None``: the default group).
        source: Returns this rank's training tensors by the source layout's names (a mapping or
            ``(name, tensor)`` pairs, e.g. ``model.named_parameters``); called on every sync.
        engine: The engine, written the first way its capabilities allow (:class:`ReshardRoute`). An engine
            with ``check_weights(tensors, what=...)`` (the vLLM adapter) checks this rank's tensors of the
            vLLM layout against its own parameters here, before anything moves. An engine that reports FP8
            with 128x128 blocks (``reports_quantization``) is handed its shard quantized, scales included
            ([Note: fp8 sync] in :mod:`hybridmem.weight_sync.fp8`).
        bucket_nbytes: Largest send+receive staging bytes per rank per bucket.
        verify: Compare per-slice checksums after each sync (raises ``WeightSyncError`` on mismatch).
        dtype: Element type on the wire, the same on every rank (see [Note: wire dtype] in
            :mod:`hybridmem.reshard.execute`); decides the plan's byte figures. ``None`` (default): the
            training weights' own, the one holding most of their bytes, so nothing is converted unless the
            engine holds another dtype (see [Note: no silent dtype change] in
            :mod:`hybridmem.weight_sync.base`).
        megatron: Megatron naming/padding options.
        vllm: vLLM padding options.
        deadline_s: Seconds within which each sync's collectives must complete on this rank, else
            ``CollectiveTimeoutError`` (see [Note: collective deadlines] in :mod:`hybridmem.reshard.execute`);
            ``None``: sized from the plan, :func:`default_deadline_s`.

    Raises:
        ValueError: Into an FP8 engine ([Note: fp8 sync] in :mod:`hybridmem.weight_sync.fp8`): another
            quantization, a family without an FP8 layout, a shard boundary inside a 128-block, a training
            dtype the quantizer cannot take; each named.
    """

    def __init__(self, spec: ModelSpec, src: ParallelLayout | HFSourceLayout, dst: ParallelLayout, group: Any,
                 source: SourceFn, engine: InferenceEngine, *, bucket_nbytes: int = DEFAULT_BUCKET_NBYTES,
                 verify: bool = False, dtype: torch.dtype | None = None,
                 megatron: MegatronConvention | None = None, vllm: VLLMConvention | None = None,
                 deadline_s: float | None = None):
        self.group = group
        self.rank, world = rank_and_size(group)
        self.source = source
        self.engine = engine
        self.verify = verify
        self.route = ReshardRoute.of(engine)
        """How the weights reach the engine."""
        block = engine_block(engine)
        if block is not None:  # FP8 is made on the ranks and streamed, never written in place
            self.route = (ReshardRoute.LAYOUT_STREAM if capabilities_of(engine).streams_layout
                          else ReshardRoute.HF_STREAM)
            vllm = dataclasses.replace(vllm or VLLMConvention(), weight_block_size=block)
        sources = self._sources_of(source)
        if isinstance(src, ParallelLayout) and looks_hf_named(sources):
            if (src.tp, src.pp, src.ep) != (1, 1, 1):
                raise ValueError(
                    f"the training weights have transformers' names (unsharded by tensor/pipeline/expert "
                    f"parallelism) but the training layout is {src}; its tp, pp and ep must be 1"
                )
            src = hf_source_layout(spec, world)
        if isinstance(src, ParallelLayout):
            src_layout = megatron_layout(spec, src, world, convention=megatron)
        else:
            if src.spec != spec or src.world_size != world:
                raise ValueError(f"source layout {src!r} is not of this model on {world} ranks")
            src_layout = src
        read = src_layout.tensors(self.rank)
        # [Note: no silent dtype change] in :mod:`hybridmem.weight_sync.base`: the trainer's own
        if dtype is None:
            dtype = dominant_dtype(t for n, t in sources.items() if n in read) or torch.float32
        self.dtype = dtype
        if block is not None:
            check_quantizable(dtype, engine)
        streams_hf = self.route is ReshardRoute.HF_STREAM
        checks_weights = capabilities_of(engine).checks_weights
        # the engine's own layout: what it holds, and what check_weights compares
        own = (vllm_layout(spec, dst, world, convention=vllm)
               if checks_weights or not streams_hf or block is not None else None)
        held = engine_dtypes(engine) if self.route is ReshardRoute.LAYOUT_STREAM else set()
        self.out_dtype: torch.dtype | None = held.pop() if held else None
        """The dtype the engine is handed its own layout in, its own (``describes_weights``; a cast the sync
        report names, [Note: no silent dtype change] in :mod:`hybridmem.weight_sync.base`); ``None``: the
        wire dtype. Into an FP8 engine: that of the tensors it does not quantize."""
        self.fp8: Fp8Target | None = None
        if block is not None:  # its own layout's FP8 tensors, or the stage's as an FP8 checkpoint has them
            target = own if not streams_hf else hf_layout(spec, dst, world, vllm_version=vllm.version)
            self.fp8 = Fp8Target(target, self.rank, self.out_dtype)
        """This rank's FP8 tensors, quantized from the plan's tensors ([Note: fp8 sync] in
        :mod:`hybridmem.weight_sync.fp8`); ``None``: the engine is not quantized."""
        if self.fp8 is not None:  # the rank's own shards unquantized, quantized on this rank
            dst_layout = self.fp8.plan_layout()
        else:
            dst_layout = (hf_layout(spec, dst, world, vllm_version=vllm.version if vllm is not None else None)
                          if streams_hf else own)
        itemsize = dtype.itemsize
        self.plan: ReshardPlan = build_plan(src_layout, dst_layout, itemsize=itemsize,
                                            bucket_nbytes=bucket_nbytes,
                                            # this rank's share only ([Note: plan schedule] in
                                            # :mod:`hybridmem.reshard.schedule`)
                                            rank=self.rank,
                                            # FP8 weights' cells move quantized ([Note: quantized cells]
                                            # in :mod:`hybridmem.reshard.plan`)
                                            quantized=self.fp8.quantized_names() if self.fp8 else frozenset())
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"deadline_s={deadline_s} must be > 0 or None")
        self.deadline_s = (default_deadline_s(self.plan, self.rank) if deadline_s is None
                           else float(deadline_s))
        """Seconds each sync's collectives have on this rank ([Note: collective deadlines] in
        :mod:`hybridmem.reshard.execute`)."""
        # the engine's own parameters vs the tensors this sync fills
        if checks_weights:
            engine.check_weights(own.tensors(self.rank),
                                 what=f"the vLLM layout {dst} this sync writes, rank {self.rank}")

    @property
    def in_place(self) -> bool:
        """The engine's own tensors are written (:attr:`ReshardRoute.IN_PLACE`)."""
        return self.route is ReshardRoute.IN_PLACE

    def temp_nbytes(self) -> int:
        """This rank's peak staging bytes in one bucket, and on a streamed route the destination tensors in
        flight (plan figures; [Note: layout streams] in :mod:`hybridmem.reshard.execute`)."""
        staging = self.plan.peak_temp_nbytes(self.rank)
        if self.route is ReshardRoute.IN_PLACE:
            return staging
        if self.fp8 is not None:
            return self.fp8.sync_temp_nbytes(self.plan, self.dtype, verify=self.verify)
        return staging + stream_peak_nbytes(self.plan, self.rank, self.out_dtype or self.dtype)

    def collective(self) -> tuple[Any, float] | None:
        """The group and deadline of a sync over several ranks ([Note: switch agreement] in
        :mod:`hybridmem.switch.agreement`)."""
        return (self.group, self.deadline_s) if self.plan.world_size > 1 else None

    def _sources(self) -> dict[str, torch.Tensor]:
        return self._sources_of(self.source)

    @staticmethod
    def _sources_of(source: SourceFn) -> dict[str, torch.Tensor]:
        got = source()
        return dict(got.items() if isinstance(got, Mapping) else got)

    def sync(self) -> SyncStats:
        start = time.perf_counter()
        bound = deadline_bound(self.deadline_s) if self.plan.world_size > 1 else None

        def left() -> float | None:
            return None if bound is None else max(0.001, bound[1] - time.monotonic())

        src = {k: v.detach() for k, v in self._sources().items()}
        checks = CellChecksums(self.plan, self.rank) if self.verify else None
        if checks is not None:
            checks.add_source(src, self.dtype)
        if self.route is ReshardRoute.IN_PLACE:
            params = {k: v.data for k, v in self.engine.named_parameters()}
            written: dict[str, int] = {}
            dst, stats = run_plan(self.plan, rank=self.rank, src=src, group=self.group, dst=params,
                                  dtype=self.dtype, deadline_s=left(),
                                  written=written)
            unwritten, checked = self._unwritten(params, written), True
            dst_dtypes = {p.dtype for p in params.values()}
            engine_nbytes = sum(n * params[name].element_size() for name, n in written.items())
            if checks is not None:
                checks.add_destinations(dst)
        else:
            stats, dst_dtypes, engine_nbytes = self._stream(src, checks, left())
            unwritten, checked = engine_unwritten(self.engine)
        if checks is not None:
            checks.compare(self.group, device=next(iter(src.values())).device, bound=bound)
        src_dtypes = {src[n].dtype for n in self.plan.src.tensors(self.rank) if n in src}
        note = dtype_note(src_dtypes, dst_dtypes, self.dtype)
        if self.fp8 is not None:
            stats = dataclasses.replace(stats, num_tensors=len(self.fp8.tensors()))
            note = _fp8_note(src_dtypes, dst_dtypes, self.dtype)
        return SyncStats(
            **{**asdict(stats), "seconds": time.perf_counter() - start},
            engine_nbytes=engine_nbytes,
            unwritten=unwritten,
            coverage_checked=checked,
            dtype_note=note,
        )

    def _stream(self, src: Mapping[str, torch.Tensor], checks: CellChecksums | None,
                deadline_s: float | None) -> tuple[TransferStats, set[torch.dtype], int]:
        """Stream the plan's complete destination tensors into the engine; returns the figures, the dtypes
        the engine was handed (what it holds, where it does not say; into an FP8 engine, those of the tensors
        it does not quantize) and the bytes of weight data handed (padding rows aside)."""
        collected: list[TransferStats] = []
        dtypes: set[torch.dtype] = set()
        layout = self.route is ReshardRoute.LAYOUT_STREAM
        # into an FP8 engine the plan's tensors are the unquantized layout's, quantized here, never built in
        # the engine's memory ([Note: fp8 sync] in :mod:`hybridmem.weight_sync.fp8`)
        fp8 = self.fp8
        offers = layout and fp8 is None and capabilities_of(self.engine).offers_layout_targets
        target = self.engine.layout_target if offers else None
        # the rank's tensors as the engine is handed them: of the plan, or of the FP8 layout they are made in
        expected = self.plan.dst.tensors(self.rank) if fp8 is None else fp8.tensors()
        handed = [0]

        def planned() -> Iterator[tuple[str, torch.Tensor]]:
            if fp8 is not None:  # [Note: fp8 assembly] in :mod:`hybridmem.reshard.fp8_stream`
                yield from iter_fp8_layout_tensors(
                    self.plan, fp8.tensors(), rank=self.rank, src=src, group=self.group, dtype=self.dtype,
                    out_dtype=self.out_dtype, stats=collected, deadline_s=deadline_s, checks=checks)
                return
            for name, tensor in iter_layout_tensors(self.plan, rank=self.rank, src=src, group=self.group,
                                                    dtype=self.dtype, out_dtype=self.out_dtype,
                                                    stats=collected, deadline_s=deadline_s, target=target,
                                                    borrow=target is not None):
                if checks is not None:
                    checks.add_destination(name, tensor)
                yield name, tensor
                del tensor

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in planned():
                if fp8 is None or not fp8.quantized_tensor(name):
                    dtypes.add(tensor.dtype)
                handed[0] += sum(p.numel for p in expected[name].pieces) * tensor.element_size()
                yield name, tensor
                del tensor  # the stream's memory bound: gone before the next one is made

        load = self.engine.load_layout_weights if layout else self.engine.load_weights
        tensors = stream()
        with torch.no_grad():
            load(tensors)
            # The other ranks wait in the plan's buckets until this one has run them all.
            left = [name for name, _ in tensors]
        if left:
            method = "load_layout_weights" if layout else "load_weights"
            raise RuntimeError(f"rank {self.rank}: {type(self.engine).__name__}.{method} returned before the "
                               f"end of its stream, leaving {len(left)} tensors, e.g. {left[0]}")
        return collected[0], (dtypes if layout else engine_dtypes(self.engine)), handed[0]

    def _unwritten(self, params: Mapping[str, torch.Tensor], written: Mapping[str, int]) -> tuple[str, ...]:
        """Engine tensors not written exactly once in every data element ([Note: weight coverage] in
        :mod:`hybridmem.weight_sync`).

        A tensor's data elements are its plan pieces; the rest is padding, zeroed by ``run_plan``. An
        engine tensor the plan does not know at all (a bias the training model lacks) is unwritten.
        """
        expected = self.plan.dst.tensors(self.rank)
        out = []
        for name, tensor in params.items():
            local = expected.get(name)
            data = sum(p.numel for p in local.pieces) if local is not None else 0
            if local is None or written.get(name, 0) != data or data > tensor.numel():
                out.append(name)
        return tuple(out)


def _fp8_note(sources: set[torch.dtype], handed: set[torch.dtype], wire: torch.dtype) -> str:
    """The sync note of an FP8 engine: the quantization, and any cast of the tensors it does not quantize
    (``handed``: their dtypes; [Note: no silent dtype change] in :mod:`hybridmem.weight_sync.base`)."""
    rest = dtype_note(sources, handed, wire)
    quantized = "weights quantized: trainer -> engine float8_e4m3fn, 128x128 block scales (float32)"
    return quantized + (f"; {rest.removeprefix('weights cast: ')}" if rest else "")
