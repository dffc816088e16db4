"""The resharding sync's FP8 part: which engines take FP8 weights (:func:`engine_block`), and a rank's FP8
vLLM-layout tensors made from full tensors (:class:`Fp8Target`).

[Note: fp8 sync]
An engine that reports FP8 with 128x128 blocks (``reports_quantization``, read with
:func:`~hybridmem.reshard.fp8.block_from_hf_config`) holds each quantized weight in e4m3 beside its float32
``weight_scale_inv`` ([Note: fp8 block layout] in :mod:`hybridmem.reshard.fp8`). A block is quantized whole,
from the full tensor, so a plan that moves slices of the training tensors straight into the engine's layout
cannot make it (``build_plan`` refuses an FP8 destination). The resharding sync therefore plans into the full
HF tensors of the engine rank's pipeline stage (``hf_layout``: the plan of the ``load_weights`` route, from
any source layout: one training rank, replicated, FSDP2 or Megatron shards), quantizes each weight vLLM
quantizes as soon as it is complete (``quantize_stream``, vLLM's ``per_block_cast_to_fp8`` bit for bit), and
cuts the engine rank's shard of the quantized tensors (``iter_shard`` into the FP8 vLLM layout): the engine's
``load_layout_weights`` is handed its shard already quantized, scales included, under vLLM's names, and the
tensors vLLM does not quantize (embeddings, norms, head, routers) in the engine's dtype. Between ranks moves
what each rank lacks of its stage's full tensors, in the trainer's dtype (more than a plan of slices moves at
TP > 1); what reaches the engine is the FP8 bytes (``SyncStats.engine_nbytes``: one byte a quantized element,
four a scale). Refused by name when the sync is built (so when the manager is), before anything moves: any
other quantization, a family without an FP8 layout or a shard boundary inside a block (``vllm_layout``), an
engine that does not take its own layout as a stream (its tensors written in place take slices; one that
loads only HF tensors is not checked), and a training dtype the quantizer cannot take.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from hybridmem.config import ParallelLayout
from hybridmem.contract.engine import InferenceEngine, capabilities_of
from hybridmem.reshard import ModelSpec, ReshardPlan, hf_layout, iter_shard, stream_peak_nbytes
from hybridmem.reshard.execute import held_dtype
from hybridmem.reshard.fp8 import QUANTIZABLE_DTYPES, SCALE_SUFFIX, block_from_hf_config, quantize_stream
from hybridmem.reshard.layouts import ShardLayout, fp8_quantized_names, layout_full_shapes

__all__ = ["engine_block", "Fp8Target", "check_quantizable"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


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
    """One rank's tensors of an FP8 vLLM layout, made from its stage's full tensors ([Note: fp8 sync]).

    Attributes:
        layout: The FP8 vLLM layout (``VLLMConvention(weight_block_size=(128, 128))``).
        rank: The engine rank.
        out_dtype: The dtype of the tensors vLLM does not quantize (the engine's); ``None``: as given.
    """

    layout: ShardLayout
    rank: int
    out_dtype: torch.dtype | None = None

    @property
    def quantized(self) -> frozenset[str]:
        """The checkpoint tensors quantized (:func:`~hybridmem.reshard.layouts.fp8_quantized_names`)."""
        return _quantized(self.layout.spec)

    def stream(self, full: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every tensor of the rank, as each completes: ``full`` (the stage's HF
        tensors, in any order) quantized where vLLM quantizes, and cut; the others cast to :attr:`out_dtype`
        (a tensor the spec keeps in fp32 stays fp32). A tensor of ``full`` is kept until every tensor cut from
        it is made (a fused one waits for its parts), so it must not be a buffer ``full`` reuses."""
        spec = self.layout.spec
        pieceless = {n: self.out_dtype or torch.float32 for n, t in self.layout.tensors(self.rank).items()
                     if not t.pieces}
        for name, tensor in iter_shard(quantize_stream(full, self.quantized), self.layout, self.rank,
                                       dtypes=pieceless):
            out = self.out_dtype
            if out is not None and not self.quantized_tensor(name) and tensor.dtype != out:
                tensor = tensor.to(held_dtype(spec, self.layout.tensors(self.rank)[name], out))
            yield name, tensor

    def quantized_tensor(self, name: str) -> bool:
        """Whether the rank's tensor ``name`` is an e4m3 weight or its scales."""
        local = self.layout.tensors(self.rank)[name]
        return bool(local.pieces) and (local.pieces[0].hf_name in self.quantized
                                       or name.endswith(SCALE_SUFFIX))

    def stage_layout(self, dst: ParallelLayout) -> ShardLayout:
        """What an FP8 sync plans into: the full HF tensors of each engine rank's pipeline stage (``dst``:
        the engine's parallel layout), stages as :attr:`layout` cuts them."""
        conv = self.layout.convention
        return hf_layout(self.layout.spec, dst, self.layout.world_size, vllm_version=conv.version,
                         stage_layers=conv.stage_layers)

    def sync_temp_nbytes(self, plan: ReshardPlan, wire: torch.dtype) -> int:
        """The rank's peak transient bytes of an FP8 sync over ``plan`` (into :meth:`stage_layout`): the
        plan's staging, its full tensors in flight in the ``wire`` dtype, and what quantizing and cutting
        hold (:meth:`hold_nbytes`)."""
        return (plan.peak_temp_nbytes(self.rank) + stream_peak_nbytes(plan, self.rank, wire)
                + self.hold_nbytes(wire))

    def hold_nbytes(self, wire: torch.dtype) -> int:
        """The most bytes :meth:`stream` holds beyond the full tensor it is handed: the quantizer's working
        tensors for the largest quantized weight (its padded copy in ``wire``, two float32 copies, the e4m3
        result), the quantized tensors of one layer waiting for the others a fused or stacked tensor is cut
        from (the stage's tensors come layer by layer), and the largest tensor cut."""
        shapes = layout_full_shapes(self.layout)
        quantized = set(self.quantized)
        largest = max((math.prod(shapes[n]) for n in quantized), default=0)
        per_layer: dict[int, int] = {}
        for name in quantized:
            m = _LAYER.match(name)
            layer = int(m[1]) if m else -1
            per_layer[layer] = per_layer.get(layer, 0) + math.prod(shapes[name]) + 4 * math.prod(
                shapes[name + SCALE_SUFFIX])
        out = self.out_dtype or wire
        cut = 0
        for local in self.layout.tensors(self.rank).values():
            hf = local.pieces[0].hf_name if local.pieces else ""
            itemsize = (1 if hf in quantized else 4 if hf.endswith(SCALE_SUFFIX)
                        else held_dtype(self.layout.spec, local, out).itemsize)
            cut = max(cut, local.numel * itemsize)
        return largest * (wire.itemsize + 4 + 4 + 1) + max(per_layer.values(), default=0) + cut


@functools.lru_cache(maxsize=8)
def _quantized(spec: ModelSpec) -> frozenset[str]:
    return frozenset(fp8_quantized_names(spec))


