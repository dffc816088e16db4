"""vLLM's per-rank parameter names and shapes for Llama/Qwen2, and how a HF-full tensor lands in them.

[Note: vLLM per-rank layout]
ReferenceEngine holds its weights exactly as vLLM's model runner does on one tensor-parallel rank
(vllm/model_executor/models/llama.py and qwen2.py, built from the layers in
vllm/model_executor/layers/linear.py and vocab_parallel_embedding.py), so the resharding engine writes
into it as it writes into vLLM. On rank ``r`` of ``tp`` (sizes from :class:`~.spec.TPShard`):

- ``model.embed_tokens.weight`` [V_pad / tp, H]: ``VocabParallelEmbedding``; vocab padded to a multiple
  of 64 and split evenly, rank ``r`` holds padded rows ``[r*V_pad/tp, (r+1)*V_pad/tp)``; rows past the
  real vocab are zero after loading.
- ``model.layers.{i}.self_attn.qkv_proj.weight`` [(nh_r + 2*nkv_r) * D, H] (and ``.bias`` with qkv bias):
  ``QKVParallelLinear``, rows ``[q_r; k_r; v_r]``; q heads split evenly; kv heads split evenly, or,
  when ``tp > num_kv_heads``, one kv head per rank, ``r // (tp // num_kv_heads)``.
- ``model.layers.{i}.self_attn.o_proj.weight`` [H, nh_r * D]: ``RowParallelLinear`` (input dim split).
- ``model.layers.{i}.mlp.gate_up_proj.weight`` [2 * I_r, H]: ``MergedColumnParallelLinear``,
  ``[gate_r; up_r]``.
- ``model.layers.{i}.mlp.down_proj.weight`` [H, I_r]: ``RowParallelLinear``.
- ``model.layers.{i}.input_layernorm.weight``, ``...post_attention_layernorm.weight``, ``model.norm.weight``
  [H]: replicated.
- ``lm_head.weight`` [V_pad / tp, H]: ``ParallelLMHead``, padded and split like the embedding; absent when
  ``tie_word_embeddings`` (vLLM's LM head then IS the embedding, and its ``load_weights`` skips
  ``lm_head.weight``).

HF checkpoints name the fused tensors apart (``q_proj``/``k_proj``/``v_proj``, ``gate_proj``/``up_proj``);
:func:`place_hf_weight` places them by the pieces of the resharding engine's vLLM layout (the rules
checked against vLLM's own loaders), as vLLM's ``stacked_params_mapping`` does. Phi-3's checkpoints store them
fused already (``self_attn.qkv_proj.weight`` = [q; k; v], ``mlp.gate_up_proj.weight`` = [gate; up]);
:func:`split_fused_hf` cuts those into the separate HF tensors first.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import torch

from hybridmem.config import ParallelLayout
from hybridmem.engines.reference.spec import VOCAB_PADDING, TPShard
from hybridmem.models import FAMILIES
from hybridmem.models.llama import LLAMA
from hybridmem.reshard import ModelSpec, VLLMConvention, vllm_layout
from hybridmem.reshard.transforms import LocalTensor, Piece
from hybridmem.reshard.vllm_versions import DEFAULT_VLLM_VERSION

__all__ = ["layout_spec", "param_shapes", "rank_tensors", "place_hf_weight", "split_fused_hf"]


def layout_spec(spec: ModelSpec) -> ModelSpec:
    """The spec whose vLLM layout the embedded engine holds: ``spec`` under Llama's names.

    Every family it runs has Llama's vLLM names (Qwen2 adds the q/k/v bias, Phi-3 differs only in its
    checkpoint), so the layout is Llama's with ``qkv_bias`` as the spec says."""
    return dataclasses.replace(spec, family=LLAMA.name)


def param_shapes(shard: TPShard) -> dict[str, tuple[int, ...]]:
    """Name -> per-rank shape of every engine parameter, in vLLM's naming: read from the resharding
    engine's vLLM layout (:func:`~hybridmem.reshard.vllm_layout`, the rules checked against vLLM's own
    loaders), so the engine holds exactly what a weight sync into vLLM writes."""
    return {name: tuple(local.shape) for name, local in rank_tensors(shard).items()}


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


_FUSED: dict[str, tuple[str, ...]] = {
    whole: parts for family in FAMILIES.values() for parts, whole in family.checkpoint_fused
}
"""Checkpoint layer suffix -> the canonical suffixes it stacks by rows, from the families' descriptions
(``Family.checkpoint_fused``: Phi-3's ``qkv_proj`` and ``gate_up_proj``)."""


@functools.lru_cache(maxsize=16)
def _layer_rows(spec: ModelSpec) -> dict[str, int]:
    """Rows of each canonical tensor of a layer (its suffix after ``model.layers.{i}.``)."""
    prefix = "model.layers.0."
    return {name[len(prefix):]: shape[0] for name, shape in layout_spec(spec).canonical_shapes().items()
            if name.startswith(prefix)}


def split_fused_hf(shard: TPShard, name: str, full: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """``[(name, full)]``, or, for a checkpoint tensor that stacks several HF tensors by rows (a family's
    ``checkpoint_fused``, e.g. Phi-3's ``self_attn.qkv_proj.weight``), its parts under their own names."""
    m = _LAYER.match(name)
    if m is None or m.group(2) not in _FUSED:
        return [(name, full)]
    parts, rows = _FUSED[m.group(2)], _layer_rows(shard.spec)
    _check_shape(name, full, (sum(rows[p] for p in parts), shard.spec.hidden_size))
    base, out, start = name[: -len(m.group(2))], [], 0
    for part in parts:
        out.append((base + part, full[start:start + rows[part]]))
        start += rows[part]
    return out


def _check_shape(name: str, full: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(full.shape) != expected:
        raise ValueError(f"HF weight {name!r} has shape {tuple(full.shape)}, expected {expected}")


@functools.lru_cache(maxsize=64)
def rank_tensors(shard: TPShard) -> dict[str, LocalTensor]:
    """This rank's engine tensors as the resharding engine's vLLM layout has them: per-rank shapes, and the
    pieces of HF tensors each holds (see [Note: pieces] in :mod:`hybridmem.reshard.transforms`)."""
    spec = layout_spec(shard.spec)
    convention = VLLMConvention(vocab_padding=VOCAB_PADDING, version=DEFAULT_VLLM_VERSION,
                                stage_layers=(spec.num_hidden_layers,))
    return vllm_layout(spec, ParallelLayout(tp=shard.tp_size), shard.tp_size,
                       convention=convention).tensors(shard.tp_rank)


@functools.lru_cache(maxsize=64)
def _targets(shard: TPShard) -> dict[str, tuple[tuple[str, Piece], ...]]:
    out: dict[str, list[tuple[str, Piece]]] = {}
    for name, local in rank_tensors(shard).items():
        for piece in local.pieces:
            out.setdefault(piece.hf_name, []).append((name, piece))
    return {hf: tuple(targets) for hf, targets in out.items()}


@functools.lru_cache(maxsize=64)
def _hf_shapes(shard: TPShard) -> dict[str, tuple[int, ...]]:
    return layout_spec(shard.spec).full_shapes()


def place_hf_weight(shard: TPShard, name: str, full: torch.Tensor) -> tuple[tuple[str, Piece], ...] | None:
    """Where the HF-full tensor ``name`` goes on this rank: ``(engine tensor, piece)`` pairs of the vLLM
    layout (copy ``full[src_index(piece.src)]`` into ``piece_view(engine tensor, piece)``), as vLLM's
    ``load_weights`` places it; empty where this rank holds none of it.

    Returns:
        The pairs, or ``None`` for a tensor vLLM skips (RoPE buffers such as ``rotary_emb.inv_freq``;
        ``lm_head.weight`` when embeddings are tied).

    Raises:
        KeyError: ``name`` is not a weight of this architecture.
        ValueError: ``full`` does not have the HF shape for ``name``.
    """
    if ".rotary_emb." in name:  # inv_freq, original_inv_freq, cos/sin caches: recomputed, as vLLM skips them
        return None
    if name == "lm_head.weight" and shard.spec.tie_word_embeddings:
        return None
    shapes = _hf_shapes(shard)
    if name not in shapes:
        raise KeyError(f"no engine weight for HF name {name!r} (model has {shard.spec.num_hidden_layers} "
                       f"layers, qkv_bias={shard.spec.qkv_bias})")
    _check_shape(name, full, shapes[name])
    return _targets(shard).get(name, ())
