"""FP8 block quantization: bf16/fp32 weights into ``float8_e4m3fn`` with one float32 ``weight_scale_inv`` per
128x128 block, as vLLM's ``Fp8Config(weight_block_size=[128, 128])`` holds them.

[Note: fp8 block layout]
An FP8 checkpoint (DeepSeek-V3's, Qwen3's ``-FP8`` ones) stores each quantized linear weight ``X.weight``
[rows, cols] as e4m3 values of the same shape and beside it ``X.weight_scale_inv`` [ceil(rows / 128),
ceil(cols / 128)]: block ``(i, j)`` of the weight is ``round_e4m3(w / s[i, j])`` with ``s[i, j]`` =
max(|block|, 1e-4) / 448 (:func:`quantize_block_fp8`, which equals vLLM's ``per_block_cast_to_fp8``,
``vllm/utils/deep_gemm.py``, bit for bit). A block depends on its own elements alone, so a shard made of
whole blocks quantizes to the blocks of the quantized whole: a vLLM rank's FP8 weight is pieces of the
quantized checkpoint tensor, and its scale the same pieces with every box divided by 128
(:func:`scale_of`), exactly as vLLM's weight loaders cut the checkpoint's ``weight_scale_inv``
(``BlockQuantScaleParameter``). A shard whose boundary falls inside a block has no such pieces (vLLM's own
``validate_fp8_block_shape`` refuses it too), and :func:`scale_of` refuses it naming the tensor and the rows.
A tensor vLLM fuses from several checkpoint weights holds each one's blocks in turn, so every part but the
last must be whole blocks: DeepSeek-V3's ``fused_qkv_a_proj`` is q_a (``q_lora_rank`` rows, 1536) then kv_a
(``kv_lora_rank + qk_rope_head_dim``, 576: its last block partial), and a ``q_lora_rank`` that is not a
multiple of 128 is refused by name (:func:`hybridmem.reshard.layouts.vllm_layout`; vLLM 0.32 and 0.33 build
such a layer and then fail loading kv_a's block scales into it).

Which tensors are quantized is vLLM's: the linear layers its model classes build with the quantization config
(:data:`QUANTIZED_VLLM_RULES`: attention q/k/v and output, MLA's projections, the MLP's and the shared
expert's projections, the routed experts, the sparse-attention indexer's ``wq_b``); embeddings, norms,
biases, the head and the routers stay as vLLM holds them (an FP8 Qwen3-MoE checkpoint lists its routers in
``modules_to_not_convert``, for vLLM builds them as linear layers that would otherwise be quantized;
GLM-4.5's and DeepSeek-V3's routers are built without the quantization config, GLM-4.5's in float32, beside
their float32 ``e_score_correction_bias``; the indexer's ``wk`` and ``weights_proj``, which vLLM fuses into a
``wk_weights_proj`` built without it, stay bf16). Only the
families checked against vLLM's loaders (:data:`FP8_FAMILIES`) have an FP8 layout;
tests/reshard/test_vllm_fp8.py runs vLLM's own classes with ``quantization="fp8"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from hybridmem.reshard.transforms import LocalTensor, Piece

__all__ = ["FP8_BLOCK", "FP8_FAMILIES", "QUANTIZED_VLLM_RULES", "FP8_DTYPE", "SCALE_SUFFIX",
           "QUANTIZABLE_DTYPES", "check_block", "block_from_hf_config", "quantize_block_fp8", "scale_name",
           "scale_of", "quantize_stream", "fp8_full_shapes", "whole_blocks", "block_cover", "scale_box",
           "dequantize_block_fp8"]

FP8_BLOCK = (128, 128)
"""The one block shape hybridmem quantizes in (rows, columns): vLLM's ``weight_block_size=[128, 128]``."""
FP8_DTYPE = torch.float8_e4m3fn
"""The element type of a quantized weight (vLLM's ``current_platform.fp8_dtype()`` on CUDA and CPU)."""
SCALE_SUFFIX = "_scale_inv"
"""``X.weight`` -> ``X.weight_scale_inv``: the checkpoint's and vLLM's name of a weight's block scales."""
QUANTIZABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
"""Training dtypes the quantizer takes (those vLLM's quantizer reads exactly once promoted to float32)."""
FP8_FAMILIES = ("llama", "qwen3", "qwen3_moe", "glm4_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa")
"""Families whose FP8 layout is checked against vLLM's classes built with ``quantization="fp8"``."""
QUANTIZED_VLLM_RULES = frozenset({
    "self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight",
    "mlp.{shared}.gate_up_proj.weight", "mlp.{shared}.down_proj.weight", "<experts_w13>", "<experts_w2>",
    # DeepSeek's multi-latent attention
    "self_attn.fused_qkv_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.q_b_proj.weight",
    "self_attn.q_proj.weight", "self_attn.kv_b_proj.weight",
    # DeepSeek sparse attention's indexer: wq_b is a quantized ReplicatedLinear; vLLM builds the fused
    # wk_weights_proj without the quantization config (an FP8 checkpoint's wk is dequantized into it)
    "self_attn.indexer.wq_b.weight",
})
"""The vLLM names (``LayerRule.vllm``) of the rows of :data:`hybridmem.reshard.rules.LAYER_RULES` whose
tensors vLLM's ``Fp8LinearMethod`` / ``Fp8MoEMethod`` hold in FP8."""
_FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
_AMAX_FLOOR = 1e-4


def check_block(block: Any) -> tuple[int, int]:
    """``block`` as ``(rows, columns)`` when it is 128x128.

    Raises:
        ValueError: Any other block shape, named.
    """
    try:
        shape = tuple(int(b) for b in block)
    except (TypeError, ValueError):
        shape = None
    if shape != FP8_BLOCK:
        raise ValueError(f"weight_block_size={block!r}: hybridmem's FP8 layout takes 128x128 blocks only "
                         f"(weight_block_size=[128, 128], as DeepSeek-V3's and Qwen3's FP8 checkpoints have)")
    return FP8_BLOCK


def block_from_hf_config(config: Mapping[str, Any] | Any) -> tuple[int, int] | None:
    """The block shape of an HF config's ``quantization_config`` (a dict or a transformers config): ``None``
    without one.

    Raises:
        ValueError: A quantization other than FP8 with 128x128 blocks (another ``quant_method``, FP8 without
            ``weight_block_size`` (per tensor), another block shape, a static activation scheme), named.
    """
    get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
    quant = get("quantization_config", None)
    if not quant:
        return None
    if not isinstance(quant, Mapping):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config quant_method={method!r}: hybridmem syncs into "
                         "bf16/fp32 engines and FP8 ones with 128x128 blocks (quant_method='fp8') only")
    if quant.get("weight_block_size") is None:
        raise ValueError("quantization_config quant_method='fp8' without weight_block_size (one scale per "
                         "tensor): hybridmem's FP8 layout takes weight_block_size=[128, 128] only")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"quantization_config activation_scheme={quant.get('activation_scheme')!r}: block "
                         "FP8 takes 'dynamic' only (as vLLM's Fp8Config)")
    return check_block(quant["weight_block_size"])


def _check_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in QUANTIZABLE_DTYPES:
        raise ValueError(f"{name}: dtype {tensor.dtype} cannot be block-quantized to FP8; the "
                         "quantizer takes "
                         f"{[str(d) for d in QUANTIZABLE_DTYPES]}")
    if tensor.dim() != 2:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} is not a 2-D weight; FP8 blocks are 128x128")


def quantize_block_fp8(weight: torch.Tensor, *, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 weight, float32 scales)`` of a 2-D weight in 128x128 blocks (see [Note: fp8 block layout]).

    The arithmetic is vLLM's ``per_block_cast_to_fp8`` (``vllm/utils/deep_gemm.py``, 0.32 and 0.33): the block
    maximum of ``|w|`` in float32, floored at 1e-4, over 448; the weight times the reciprocal of that scale,
    in float32, rounded to e4m3. The edge blocks of a weight whose sides are not multiples of 128 cover what
    is there (vLLM pads with zeros, which change no maximum).

    Raises:
        ValueError: A dtype other than :data:`QUANTIZABLE_DTYPES`, or a tensor that is not 2-D, named.
    """
    _check_dtype(name, weight)
    rows, cols = weight.shape
    br, bc = FP8_BLOCK
    grid_r, grid_c = -(-rows // br), -(-cols // bc)
    if rows % br or cols % bc:
        padded = weight.new_zeros((grid_r * br, grid_c * bc))
        padded[:rows, :cols] = weight
    else:  # whole blocks: no padded copy
        padded = weight.contiguous()
    blocks = padded.view(grid_r, br, grid_c, bc)
    # The same figures as vLLM's, computed with fewer passes: a block's largest |w| is the larger of its
    # maximum and its negated minimum, each exact in the weight's dtype and in float32 (so taken before the
    # cast); the product in float32, made in one float32 copy (a copy even of a float32 weight, never it).
    amax = torch.maximum(blocks.amax(dim=3, keepdim=True), -blocks.amin(dim=3, keepdim=True))
    scale = amax.amax(dim=1, keepdim=True).float().clamp(_AMAX_FLOOR) / _FP8_MAX
    scaled = blocks.to(torch.float32, copy=True)
    scaled.mul_(1.0 / scale)
    quantized = scaled.to(FP8_DTYPE).view(grid_r * br, grid_c * bc)
    del scaled
    return quantized[:rows, :cols].contiguous(), scale.view(grid_r, grid_c)


def dequantize_block_fp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 values a 2-D e4m3 tensor and its 128x128 block scales stand for (each element times its
    block's scale): what two ranks holding the same quantized blocks both compute bit for bit."""
    rows, cols = values.shape
    grid = scales.repeat_interleave(FP8_BLOCK[0], 0).repeat_interleave(FP8_BLOCK[1], 1)
    return values.float() * grid[:rows, :cols]


def whole_blocks(box: Any, shape: tuple[int, ...]) -> bool:
    """Whether the 2-D ``box`` of a weight of ``shape`` is whole 128x128 blocks of it: each range starts on a
    block edge and ends on one or where the weight ends (its blocks quantize alone to the whole's)."""
    return len(box) == 2 and all(a % blk == 0 and (b % blk == 0 or b == n)
                                 for (a, b), blk, n in zip(box, FP8_BLOCK, shape))


def block_cover(box: Any, shape: tuple[int, ...]) -> tuple[tuple[int, int], tuple[int, int]]:
    """The whole blocks of a weight of ``shape`` that the 2-D ``box`` touches, as a box of it."""
    return tuple((a // blk * blk, min(n, _blocks(b, blk) * blk))  # type: ignore[return-value]
                 for (a, b), blk, n in zip(box, FP8_BLOCK, shape))


def scale_box(box: Any) -> tuple[tuple[int, int], tuple[int, int]]:
    """The box of a weight's ``weight_scale_inv`` whose blocks the 2-D ``box`` of the weight touches."""
    return tuple((a // blk, _blocks(b, blk)) for (a, b), blk in zip(box, FP8_BLOCK))  # type: ignore[return-value]


def scale_name(weight_name: str) -> str:
    """``X.weight`` -> ``X.weight_scale_inv`` (``w13_weight`` -> ``w13_weight_scale_inv``)."""
    return weight_name + SCALE_SUFFIX


def _blocks(extent: int, block: int) -> int:
    return -(-extent // block)


def scale_of(name: str, local: LocalTensor, full_shapes: Mapping[str, tuple[int, ...]]) -> LocalTensor:
    """The block scales of quantized local tensor ``name`` (``local``'s pieces of HF weights): the same pieces
    of the checkpoint's ``weight_scale_inv``, every box and offset divided by 128 (see [Note: fp8 block
    layout]).

    Raises:
        ValueError: A piece whose rows or columns start or end inside a 128-block of the weight, or sit at an
            offset inside one in ``name`` (a shard boundary inside a block), naming the tensor, the checkpoint
            tensor and the ranges.
    """
    br, bc = FP8_BLOCK
    pieces = []
    for p in local.pieces:
        if p.transposed or len(p.src) != 2 or len(p.dst_start) != 2:
            raise ValueError(f"{name}: piece of {p.hf_name} is not a plain 2-D block; no FP8 layout for it")
        full = full_shapes[p.hf_name]
        box, start = [], []
        for axis, ((a, b), d, blk) in enumerate(zip(p.src, p.dst_start, (br, bc))):
            ends_inside = b % blk and b != full[axis]
            inner_end = b % blk and d + (b - a) != local.shape[len(p.dst_prefix) + axis]
            if a % blk or d % blk or ends_inside or inner_end:
                what = ("rows", "columns")[axis]
                raise ValueError(
                    f"{name} holds {what} [{a}, {b}) of {p.hf_name} at offset {d}: a shard boundary inside a "
                    f"{blk}-block of weight_block_size=[128, 128]; vLLM's FP8 layers need every shard to be "
                    "whole blocks (choose a tensor-parallel size that splits this weight into multiples of "
                    f"{blk})")
            box.append((a // blk, _blocks(b, blk)))
            start.append(d // blk)
        pieces.append(Piece(scale_name(p.hf_name), tuple(box), p.dst_prefix, tuple(start)))
    prefix = local.shape[:-2]
    shape = (*prefix, _blocks(local.shape[-2], br), _blocks(local.shape[-1], bc))
    return LocalTensor(shape, tuple(pieces))


def fp8_full_shapes(full_shapes: Mapping[str, tuple[int, ...]],
                    quantized: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """An FP8 checkpoint's tensors: ``full_shapes`` (the bf16 checkpoint's) with each ``quantized`` weight's
    ``weight_scale_inv`` after it."""
    quantized = set(quantized)
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in full_shapes.items():
        out[name] = shape
        if name in quantized:
            out[scale_name(name)] = (_blocks(shape[0], FP8_BLOCK[0]), _blocks(shape[1], FP8_BLOCK[1]))
    return out


def quantize_stream(full: Iterable[tuple[str, torch.Tensor | None]],
                    quantized: Iterable[str]) -> Iterator[tuple[str, torch.Tensor | None]]:
    """A stream of HF-full tensors as the FP8 checkpoint holds them: each ``quantized`` weight as its e4m3
    values and then its ``weight_scale_inv``, the others unchanged (``None`` entries pass through).

    Raises:
        ValueError: A quantized weight of a dtype the quantizer cannot take (:data:`QUANTIZABLE_DTYPES`),
            named, before it is quantized.
    """
    quantized = frozenset(quantized)
    for name, tensor in full:
        if tensor is None or name not in quantized:
            yield name, tensor
            continue
        weight, scale = quantize_block_fp8(tensor, name=name)
        yield name, weight
        yield scale_name(name), scale
