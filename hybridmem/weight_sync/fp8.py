"""The resharding sync's FP8 part: which engines take FP8 weights (:func:`engine_block`), and a rank's FP8
vLLM-layout tensors (:class:`Fp8Target`).

[Note: fp8 sync]
An engine that reports FP8 with 128x128 blocks (``reports_quantization``, read with
:func:`~hybridmem.reshard.fp8.block_from_hf_config`) holds each quantized weight in e4m3 beside its float32
``weight_scale_inv`` ([Note: fp8 block layout] in :mod:`hybridmem.reshard.fp8`). A block is quantized from
its own elements alone, and every piece of a checkpoint weight in an engine rank's FP8 tensor is whole
blocks of it (or ends where the weight ends: ``vllm_layout`` refuses a shard boundary inside a block), so
the rank's shard is the blocks of the quantized whole. The resharding sync therefore plans into the engine
rank's own tensors of the unquantized vLLM layout (:meth:`Fp8Target.plan_layout`: the plan of a bf16
engine, its minimum cells, from any source layout: one training rank, replicated, FSDP2 or Megatron
shards), with the weights vLLM quantizes named (:meth:`Fp8Target.quantized_names`): each cell of one that is
whole blocks is quantized by the rank that holds it, and its e4m3 values and block scales are what moves
between ranks, and what a rank copies of its own; a cell cut inside a block (a training shard boundary
inside one) moves in the trainer's dtype and the receiving rank quantizes its blocks ([Note: quantized
cells] in :mod:`hybridmem.reshard.plan`, [Note: fp8 assembly] in :mod:`hybridmem.reshard.fp8_stream`;
:func:`~hybridmem.reshard.fp8.quantize_block_fp8` is vLLM's ``per_block_cast_to_fp8`` bit for bit). An
engine that takes its own layout as a stream (``streams_layout``: vLLM in its own process) is handed its
shard quantized, scales included, under vLLM's names, and the tensors vLLM does not quantize (embeddings,
norms, head, routers) in the engine's dtype; any other (vLLM in the trainer's process) is handed through
``load_weights`` the full tensors of its stage as the FP8 checkpoint holds them (each quantized weight's e4m3
values and ``weight_scale_inv`` under the checkpoint's names, the rest in the wire dtype), which vLLM loads
and processes as it loads that checkpoint: never written in place, where vLLM's post-load processing may
have re-laid the weights and scales for its kernels. ``SyncStats.engine_nbytes`` counts the FP8 bytes
handed (one byte a quantized element, four a scale), ``sent_nbytes`` and ``received_nbytes`` what moved
between ranks. Refused by name when the sync is built (so when the manager is), before anything moves: any
other quantization, a family without an FP8 layout or a shard boundary inside a block (``vllm_layout``),
and a training dtype the quantizer cannot take.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from hybridmem.contract.engine import InferenceEngine, capabilities_of
from hybridmem.reshard import ReshardPlan, stream_peak_nbytes, vllm_layout
from hybridmem.reshard.conventions import Side
from hybridmem.reshard.execute import held_dtype
from hybridmem.reshard.fp8 import (
    FP8_BLOCK,
    FP8_DTYPE,
    QUANTIZABLE_DTYPES,
    SCALE_SUFFIX,
    block_from_hf_config,
    quantize_block_fp8,
    scale_name,
)
from hybridmem.reshard.layouts import ShardLayout, fp8_quantized_names, with_scales
from hybridmem.reshard.transforms import LocalTensor, Piece, piece_view

__all__ = ["engine_block", "Fp8Target", "check_quantizable"]


def engine_block(engine: InferenceEngine) -> tuple[int, int] | None:
    """The FP8 block an engine holds its weights in (``(128, 128)``), or ``None``: unquantized, or it does not
    say (``reports_quantization``).

    Raises:
        ValueError: The engine reports another quantization (another ``quant_method``, FP8 per tensor,
            another block, static activations), named (:func:`~hybridmem.reshard.fp8.block_from_hf_config`).
    """
    if not capabilities_of(engine).reports_quantization:
        return None
    return block_from_hf_config({"quantization_config": engine.quantization_config})


def check_quantizable(dtype: torch.dtype, engine: InferenceEngine) -> None:
    """Refuse a wire (training) dtype the FP8 quantizer cannot take, naming it and the engine.

    Raises:
        ValueError: ``dtype`` is not one of :data:`~hybridmem.reshard.fp8.QUANTIZABLE_DTYPES`.
    """
    if dtype not in QUANTIZABLE_DTYPES:
        raise ValueError(f"training dtype {dtype}: {type(engine).__name__} serves FP8 with 128x128 blocks, "
                         "quantized from the training weights, which the quantizer takes in "
                         f"{[str(d) for d in QUANTIZABLE_DTYPES]} only")


@dataclass(frozen=True, slots=True)
class Fp8Target:
    """One rank's tensors of an FP8 vLLM layout, or of an HF layout as an FP8 checkpoint holds them, made from
    its tensors of the same layout unquantized ([Note: fp8 sync]).

    Attributes:
        layout: The FP8 vLLM layout (``VLLMConvention(weight_block_size=(128, 128))``), or an HF layout (the
            full tensors of each stage: an engine that takes an FP8 checkpoint's tensors through
            ``load_weights``).
        rank: The engine rank.
        out_dtype: The dtype of the tensors vLLM does not quantize (the engine's); ``None``: as given.
    """

    layout: ShardLayout
    rank: int
    out_dtype: torch.dtype | None = None

    def plan_layout(self) -> ShardLayout:
        """What an FP8 sync plans into: :attr:`layout` unquantized (each rank's tensors, without scales)."""
        return self.layout if self.layout.side is Side.HF else _unquantized(self.layout)

    def tensors(self) -> dict[str, LocalTensor]:
        """The rank's tensors: each quantized weight followed by its ``weight_scale_inv``."""
        if self.layout.side is Side.HF:
            return _hf_fp8_tensors(self.layout, self.rank)
        return self.layout.tensors(self.rank)

    def quantized_names(self) -> frozenset[str]:
        """The checkpoint weights :attr:`layout` holds in e4m3 with block scales (an FP8 sync's plan moves
        their cells quantized where they are whole blocks)."""
        return frozenset(fp8_quantized_names(self.layout.spec))

    def stream(self, shards: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every tensor of the rank: ``shards`` (its tensors of :meth:`plan_layout`,
        each complete, in any order), each weight vLLM quantizes made e4m3 and followed by its
        ``weight_scale_inv``, the others cast to :attr:`out_dtype` (a tensor the spec keeps in fp32 stays
        fp32). Holds one tensor at a time. The offline cut (e.g. over
        :func:`~hybridmem.reshard.iter_shard` of full tensors); a sync runs
        :func:`~hybridmem.reshard.fp8_stream.iter_fp8_layout_tensors`, which makes the same tensors.

        Raises:
            ValueError: A weight of a dtype the quantizer cannot take, named, before it is quantized.
        """
        tensors = self.tensors()
        for name, tensor in shards:
            scale = scale_name(name)
            if scale in tensors:
                weight, scales = _quantize_pieces(name, tensor, tensors[name], tensors[scale])
                yield name, weight
                del weight
                yield scale, scales
                continue
            out = self.out_dtype
            if out is not None:
                out = held_dtype(self.layout.spec, tensors[name], out)
                if tensor.dtype != out:
                    tensor = tensor.to(out)
            yield name, tensor

    def quantized_tensor(self, name: str) -> bool:
        """Whether the rank's tensor ``name`` is an e4m3 weight or its scales."""
        tensors = self.tensors()
        return name.endswith(SCALE_SUFFIX) or scale_name(name) in tensors

    def sync_temp_nbytes(self, plan: ReshardPlan, wire: torch.dtype, *, verify: bool = False) -> int:
        """The rank's peak transient bytes of an FP8 sync over ``plan`` (into :meth:`plan_layout`): the plan's
        staging, its tensors in flight in the ``wire`` dtype, and what quantizing holds
        (:meth:`hold_nbytes`); with ``verify`` (``verify_weight_sync``), also what the checks of the
        largest quantized weight hold: the float32 image of its cells the receiver reads its figures
        from, and a float32 cell dequantized into it (8 bytes an element; [Note: fp8 assembly] in
        :mod:`hybridmem.reshard.fp8_stream`)."""
        check = 0
        if verify:
            tensors = self.tensors()
            check = max((8 * local.numel for name, local in tensors.items()
                         if not name.endswith(SCALE_SUFFIX) and scale_name(name) in tensors), default=0)
        return (plan.peak_temp_nbytes(self.rank) + stream_peak_nbytes(plan, self.rank, wire)
                + self.hold_nbytes(wire) + check)

    def hold_nbytes(self, wire: torch.dtype) -> int:
        """The most bytes :meth:`stream` holds beyond the tensor it is handed: for a quantized weight, its
        e4m3 tensor and scales, and the quantizer's working tensors for its largest piece (a padded copy in
        ``wire``, two float32 copies, the e4m3 result); for another tensor, its cast."""
        tensors = self.tensors()
        out = self.out_dtype or wire
        hold = 0
        for name, local in tensors.items():
            if name.endswith(SCALE_SUFFIX):
                continue
            scale = tensors.get(scale_name(name))
            if scale is None:
                hold = max(hold, local.numel * held_dtype(self.layout.spec, local, out).itemsize)
                continue
            piece = max((_padded_numel(p) for p in local.pieces), default=0)
            hold = max(hold, local.numel + 4 * scale.numel + piece * (wire.itemsize + 4 + 4 + 1))
        return hold


def _padded_numel(piece: Piece) -> int:
    """Elements of a piece's box padded to whole 128x128 blocks (the quantizer's working shape)."""
    (r0, r1), (c0, c1) = piece.src[-2:]
    return -(-(r1 - r0) // FP8_BLOCK[0]) * FP8_BLOCK[0] * -(-(c1 - c0) // FP8_BLOCK[1]) * FP8_BLOCK[1]


def _quantize_pieces(name: str, tensor: torch.Tensor, weight: LocalTensor,
                     scale: LocalTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The e4m3 tensor and block scales of one rank's weight ``name`` (``tensor``, of shape ``weight.shape``),
    each piece quantized alone: its box is whole 128-blocks of its checkpoint weight, or
    ends where the weight ends ([Note: fp8 sync]), and its scales land where ``scale``'s matching piece
    says."""
    if tuple(tensor.shape) != tuple(weight.shape):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the FP8 layout's is {weight.shape}")
    out = torch.zeros(weight.shape, dtype=FP8_DTYPE, device=tensor.device)
    scales = torch.zeros(scale.shape, dtype=torch.float32, device=tensor.device)
    for piece, scale_piece in zip(weight.pieces, scale.pieces, strict=True):
        values, blocks = quantize_block_fp8(piece_view(tensor, piece), name=f"{name} ({piece.hf_name})")
        piece_view(out, piece).copy_(values)
        piece_view(scales, scale_piece).copy_(blocks)
    return out, scales


@functools.lru_cache(maxsize=8)
def _hf_fp8_tensors(layout: ShardLayout, rank: int) -> dict[str, LocalTensor]:
    """A rank's HF-layout tensors as an FP8 checkpoint holds them (scales beside the quantized weights)."""
    tensors = layout.tensors(rank)
    quantized = set(fp8_quantized_names(layout.spec))
    return with_scales(layout.spec, tensors, [n for n in tensors if n in quantized])


@functools.lru_cache(maxsize=8)
def _unquantized(layout: ShardLayout) -> ShardLayout:
    conv = dataclasses.replace(layout.convention, weight_block_size=None)
    return vllm_layout(layout.spec, layout.parallel, layout.world_size, convention=conv)


