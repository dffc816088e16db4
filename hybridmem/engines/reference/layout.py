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
:func:`place_hf_weight` maps them as vLLM's ``stacked_params_mapping`` does. Phi-3's checkpoints store them
fused already (``self_attn.qkv_proj.weight`` = [q; k; v], ``mlp.gate_up_proj.weight`` = [gate; up]);
:func:`split_fused_hf` cuts those into the separate HF tensors first.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from hybridmem.config import ParallelLayout
from hybridmem.engines.reference.spec import VOCAB_PADDING, TPShard
from hybridmem.models import FAMILIES
from hybridmem.nn.config import DecoderConfig
from hybridmem.reshard import ModelSpec, VLLMConvention, vllm_layout
from hybridmem.reshard.layouts import DEFAULT_VLLM_VERSION

__all__ = ["layout_spec", "param_shapes", "Placement", "place_hf_weight", "split_fused_hf"]


def layout_spec(spec: DecoderConfig) -> ModelSpec:
    """The resharding engine's :class:`~hybridmem.reshard.ModelSpec` of a decoder the embedded engine runs.

    Every family it runs has Llama's vLLM names (Qwen2 adds the q/k/v bias, Phi-3 differs only in its
    checkpoint), so the spec is Llama's with ``qkv_bias`` as the config says."""
    return ModelSpec(family="llama", hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
                     num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
                     intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
                     vocab_size=spec.vocab_size, qkv_bias=spec.attention_bias,
                     tie_word_embeddings=spec.tie_word_embeddings)


def param_shapes(shard: TPShard) -> dict[str, tuple[int, ...]]:
    """Name -> per-rank shape of every engine parameter, in vLLM's naming: read from the resharding
    engine's vLLM layout (:func:`~hybridmem.reshard.vllm_layout`, the rules checked against vLLM's own
    loaders), so the engine holds exactly what a weight sync into vLLM writes."""
    spec = layout_spec(shard.spec)
    convention = VLLMConvention(vocab_padding=VOCAB_PADDING, version=DEFAULT_VLLM_VERSION,
                                stage_layers=(spec.num_hidden_layers,))
    layout = vllm_layout(spec, ParallelLayout(tp=shard.tp_size), shard.tp_size, convention=convention)
    return {name: tuple(local.shape) for name, local in layout.tensors(shard.tp_rank).items()}


@dataclass(frozen=True, slots=True)
class Placement:
    """Where (part of) a HF-full tensor goes: ``params[name][rows] = value``.

    ``zero_rest`` asks to zero the parameter's rows after ``rows`` (vocab padding).
    """

    name: str
    rows: slice
    value: torch.Tensor
    zero_rest: bool = False


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_STACKED = {
    # HF suffix -> (vLLM fused name, shard id), as vLLM's stacked_params_mapping.
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_REPLICATED = ("input_layernorm.weight", "post_attention_layernorm.weight")
_ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


_FUSED: dict[str, tuple[str, ...]] = {
    whole: parts for family in FAMILIES.values() for parts, whole in family.checkpoint_fused
}
"""Checkpoint layer suffix -> the canonical suffixes it stacks by rows, from the families' descriptions
(``Family.checkpoint_fused``: Phi-3's ``qkv_proj`` and ``gate_up_proj``)."""


@functools.lru_cache(maxsize=16)
def _layer_rows(spec: DecoderConfig) -> dict[str, int]:
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


def place_hf_weight(shard: TPShard, name: str, full: torch.Tensor) -> Placement | None:
    """Slice the HF-full tensor ``name`` for this rank and say where it goes.

    Returns:
        The placement, or ``None`` for a tensor vLLM skips (RoPE buffers such as
        ``rotary_emb.inv_freq``; ``lm_head.weight`` when embeddings are tied).

    Raises:
        KeyError: ``name`` is not a weight of this architecture.
        ValueError: ``full`` does not have the HF shape for ``name``.
    """
    s = shard.spec
    d, h, r = s.head_dim, s.hidden_size, shard.tp_rank
    if ".rotary_emb." in name:  # inv_freq, original_inv_freq, cos/sin caches: recomputed, as vLLM skips them
        return None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name == "lm_head.weight" and s.tie_word_embeddings:
            return None
        _check_shape(name, full, (s.vocab_size, h))
        start = r * shard.vocab_rows
        stop = min(s.vocab_size, start + shard.vocab_rows)
        value = full[start:max(start, stop)]
        return Placement(name, slice(0, value.shape[0]), value, zero_rest=True)
    if name == "model.norm.weight":
        _check_shape(name, full, (h,))
        return Placement(name, slice(None), full)
    m = _LAYER.match(name)
    if m is None or int(m.group(1)) >= s.num_hidden_layers:
        raise KeyError(f"no engine weight for HF name {name!r} (model has {s.num_hidden_layers} layers)")
    prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if rest in _REPLICATED:
        _check_shape(name, full, (h,))
        return Placement(prefix + rest, slice(None), full)
    if rest in _ROW_PARALLEL:
        width = shard.num_heads * d if rest.startswith("self_attn") else shard.intermediate_size
        total = s.num_attention_heads * d if rest.startswith("self_attn") else s.intermediate_size
        _check_shape(name, full, (h, total))
        return Placement(prefix + rest, slice(None), full[:, r * width:(r + 1) * width])
    module, _, kind = rest.rpartition(".")
    if module not in _STACKED or kind not in ("weight", "bias"):
        raise KeyError(f"no engine weight for HF name {name!r}")
    if kind == "bias" and not (s.attention_bias and module.startswith("self_attn")):
        raise KeyError(f"HF weight {name!r} is a bias this model does not have (attention_bias={s.attention_bias})")
    fused, shard_id = _STACKED[module]
    tail = (h,) if kind == "weight" else ()
    if shard_id == "q":
        _check_shape(name, full, (s.num_attention_heads * d, *tail))
        n = shard.num_heads * d
        return Placement(f"{prefix}{fused}.{kind}", slice(0, n), full[r * n:(r + 1) * n])
    if shard_id in ("k", "v"):
        _check_shape(name, full, (s.num_key_value_heads * d, *tail))
        n = shard.num_kv_heads * d
        start = shard.num_heads * d + (n if shard_id == "v" else 0)
        src = shard.kv_head_start * d
        return Placement(f"{prefix}{fused}.{kind}", slice(start, start + n), full[src:src + n])
    _check_shape(name, full, (s.intermediate_size, *tail))
    n = shard.intermediate_size
    start = shard_id * n
    return Placement(f"{prefix}{fused}.{kind}", slice(start, start + n), full[r * n:(r + 1) * n])
