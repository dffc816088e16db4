"""ModelSpec: the shapes that sharding a decoder-only transformer depends on.

Built from a HF-style config (:meth:`ModelSpec.from_hf_config`, a ``transformers`` config object or a
plain dict). What each family is (its config keys, which blocks it has, how its checkpoint and vLLM name
its tensors) lives in its file under :mod:`hybridmem.models`; this class holds the sizes and answers
from the family's description (:attr:`ModelSpec.description`). Supported families: :data:`FAMILIES`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hybridmem.models import FAMILIES as _FAMILY_TABLE
from hybridmem.models import (
    Family,
    RouterBias,
    TextModelNames,
    family_name,
    get_family,
    getter,
    model_type_of,
)

__all__ = ["ModelSpec", "FAMILIES", "Placement"]


class Placement(NamedTuple):
    """Where a canonical tensor sits in the checkpoint (see [Note: canonical names] in
    :mod:`hybridmem.models.family`)."""

    name: str
    """The checkpoint tensor."""
    row: int = 0
    """First row of the canonical tensor inside it (a row block of a fused tensor, Phi-3's ``qkv_proj``)."""
    index: tuple[int, ...] = ()
    """Leading indices of a checkpoint tensor stacked over experts (gpt-oss's ``experts.gate_up_proj``)."""
    transposed: bool = False
    """The checkpoint holds the canonical tensor transposed (its last two axes swapped)."""

FAMILIES = tuple(_FAMILY_TABLE)
"""The families' ``model_type`` names (see :mod:`hybridmem.models.registry`; aliases such as ``mistral``
resolve to one of them)."""


def _numerics(get: Any) -> dict[str, float]:
    """The fields no shape depends on, as every family's config names them: ``rms_norm_eps`` and the rotary
    base (``rope_theta``, else transformers 5's ``rope_parameters``), each absent: the field's default."""
    out = {}
    eps = get("rms_norm_eps")
    if eps is not None:
        out["rms_norm_eps"] = float(eps)
    theta = get("rope_theta")
    if theta is None:
        rope = get("rope_parameters") or {}
        theta = rope.get("rope_theta") if isinstance(rope, Mapping) else None
    if theta is not None:
        out["rope_theta"] = float(theta)
    return out


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Shapes and options of one model; hashable, so plans can be cached on it."""

    family: str = "llama"
    """One of :data:`FAMILIES` (an alias such as ``"mistral"`` is stored as its family's name)."""
    hidden_size: int
    """Model width H."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (query groups); must divide ``num_attention_heads``."""
    head_dim: int
    """Width of one head."""
    intermediate_size: int
    """Dense MLP width (per half of the gate/up pair)."""
    num_hidden_layers: int
    """Decoder layers."""
    vocab_size: int
    """Real vocabulary rows (before any padding)."""
    qkv_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    o_bias: bool = False
    """The attention output projection carries a bias [hidden_size] (gpt-oss; Llama and Granite with
    ``attention_bias``), whole on every TP rank."""
    mlp_bias: bool = False
    """The dense MLP's gate, up and down projections carry biases (Llama and Granite with ``mlp_bias``):
    gate/up split with their rows per TP rank, down whole on every TP rank."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k (Qwen3): ``q_norm.weight`` / ``k_norm.weight`` of shape [head_dim]."""
    tie_word_embeddings: bool = False
    """The output layer shares the embedding matrix."""
    rms_norm_eps: float = field(default=1e-6, compare=False)
    """The RMSNorms' epsilon (the HF config's ``rms_norm_eps``): the embedded engine and the trainable decoder
    of :mod:`hybridmem.engines.nn` compute with it. No tensor depends on it, so it takes no part in equality
    or the hash: specs describing the same tensors are equal (and share cached plans)."""
    rope_theta: float = field(default=10000.0, compare=False)
    """The rotary base (``rope_theta``, or ``rope_parameters["rope_theta"]`` in transformers 5); like
    :attr:`rms_norm_eps`, computed with and not compared."""
    num_experts: int = 0
    """Routed experts per MoE layer (0 for dense models)."""
    moe_intermediate_size: int = 0
    """Width of one routed expert."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert (0: none). Qwen2-MoE also has a [1, H] sigmoid gate on it; DeepSeek-V3's
    is ``moe_intermediate_size * n_shared_experts``."""
    first_k_dense_replace: int = 0
    """MoE families: the first this many layers have a dense MLP of ``intermediate_size`` (DeepSeek-V3)."""
    moe_layer_step: int = 1
    """MoE families: of the layers past :attr:`first_k_dense_replace`, every this many is MoE (layer ``i``
    when ``(i + 1) % moe_layer_step == 0``), the others dense of ``intermediate_size`` (Llama 4's
    ``interleave_moe_layer_step``)."""
    q_lora_rank: int = 0
    """MLA: rank of the query down-projection (``q_a_proj``); 0 projects queries directly (``q_proj``)."""
    kv_lora_rank: int = 0
    """MLA: rank of the compressed key/value latent (``kv_a_proj_with_mqa`` gives it plus the rope key)."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key width without RoPE."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query/key width with RoPE (shared by all heads on the key side)."""
    v_head_dim: int = 0
    """MLA: per-head value width."""
    topk_method: str | None = "noaux_tc"
    """DeepSeek-V3: the HF config's ``topk_method`` (``"noaux_tc"`` as DeepSeek-V3 ships it; ``None`` when the
    config lacks the key, as transformers' own ``DeepseekV3Config`` does). HF and Megatron models always
    carry the router's ``e_score_correction_bias``; vLLM creates it only for ``"noaux_tc"``
    (:attr:`vllm_router_bias`). Ignored by other families."""
    index_n_heads: int = 0
    """DeepSeek sparse attention (:attr:`hybridmem.models.Family.sparse_attention_indexer`): the indexer's
    heads."""
    index_head_dim: int = 0
    """DeepSeek sparse attention: the width of one indexer head (and of its key, ``indexer.wk``)."""

    full_attention_layers: tuple[int, ...] = ()
    """Layers whose attention has a geometry of its own (Gemma 4's full-attention layers, between sliding
    ones): :attr:`full_attention_head_dim` per head, :attr:`full_attention_kv_heads` kv heads, and with
    :attr:`full_attention_k_eq_v` no value projection. Empty: every layer has ``head_dim`` and
    ``num_key_value_heads``."""
    full_attention_head_dim: int = 0
    """Head width of the :attr:`full_attention_layers`."""
    full_attention_kv_heads: int = 0
    """Key/value heads of the :attr:`full_attention_layers`."""
    full_attention_k_eq_v: bool = False
    """The :attr:`full_attention_layers` have no ``v_proj``: values are the key projection's output
    (Gemma 4's ``attention_k_eq_v``; vLLM loads ``k_proj`` into both the K and V rows of ``qkv_proj``)."""

    hidden_size_per_layer_input: int = 0
    """Per-layer input embeddings (:attr:`hybridmem.models.Family.per_layer_inputs`, Gemma 4's PLE): the
    width P each layer gets of them; 0: none."""
    vocab_size_per_layer_input: int = 0
    """Per-layer input embeddings: the rows of ``model.embed_tokens_per_layer.weight`` (before any padding);
    0 without them."""

    linear_attention_layers: tuple[int, ...] = ()
    """Layers (global indices, ascending) whose token mixer is a gated delta-net, ``linear_attn.*`` (Qwen3.5's
    ``linear_attention`` layer type), instead of attention; the other layers have ``self_attn.*``."""
    linear_num_key_heads: int = 0
    """Gated delta-net: query/key heads."""
    linear_num_value_heads: int = 0
    """Gated delta-net: value heads (and heads of ``A_log``, ``dt_bias``, ``in_proj_b``, ``in_proj_a``)."""
    linear_key_head_dim: int = 0
    """Gated delta-net: width of one query/key head."""
    linear_value_head_dim: int = 0
    """Gated delta-net: width of one value head (and of its gated RMSNorm, ``linear_attn.norm``)."""
    linear_conv_kernel_dim: int = 0
    """Gated delta-net: taps of the depthwise causal convolution over [q; k; v] (``linear_attn.conv1d``)."""
    multimodal: str = ""
    """A multimodal ``model_type`` that keeps the text model's tensors under names of its own
    (:attr:`hybridmem.models.Family.multimodal_names`, Kimi-K2.5's ``kimi_k25``): the checkpoint's, vLLM's and
    transformers' module names are that model's (:attr:`text_names`); ``""``: the text model's."""

    _family: Family | None = field(default=None, init=False, repr=False, compare=False)
    """The family's description, looked up once (read through :attr:`description`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "family", family_name(self.family))
        object.__setattr__(self, "_family", get_family(self.family))
        if self.multimodal and self.multimodal not in dict(self._family.multimodal_names):
            raise ValueError(f"multimodal={self.multimodal!r} is no multimodal model of "
                             f"family={self.family!r} with names of its own; expected one of "
                             f"{[t for t, _ in self._family.multimodal_names]}")
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "num_hidden_layers", "vocab_size"):
            _positive(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.full_attention_layers:
            self._check_full_attention()
        elif self.full_attention_k_eq_v:
            raise ValueError("full_attention_k_eq_v=True given without full_attention_layers")
        if self.is_mla:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                _positive(name, getattr(self, name))
            if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
                raise ValueError(f"head_dim={self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim = "
                                 f"{self.qk_nope_head_dim} + {self.qk_rope_head_dim} for MLA")
            if self.num_key_value_heads != self.num_attention_heads:
                raise ValueError(f"num_key_value_heads={self.num_key_value_heads} must equal "
                                 f"num_attention_heads={self.num_attention_heads} for MLA (every head has "
                                 "its own key and value)")
        if self.description.sparse_attention_indexer:
            for name in ("index_n_heads", "index_head_dim", "q_lora_rank"):
                _positive(name, getattr(self, name))
        if self.is_moe:
            _positive("num_experts", self.num_experts)
            if self.description.dense_mlp_with_experts:
                _positive("intermediate_size", self.intermediate_size)
            _positive("moe_intermediate_size", self.moe_intermediate_size)
            if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
                raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must be in "
                                 f"[0, num_hidden_layers={self.num_hidden_layers}]")
            _positive("moe_layer_step", self.moe_layer_step)
            if self.first_k_dense_replace or self.moe_layer_step > 1:
                _positive("intermediate_size", self.intermediate_size)
        else:
            _positive("intermediate_size", self.intermediate_size)
            if self.num_experts:
                raise ValueError(f"num_experts={self.num_experts} given for dense family={self.family!r}")
        if self.linear_attention_layers:
            if list(self.linear_attention_layers) != sorted(set(self.linear_attention_layers)) or not all(
                    0 <= i < self.num_hidden_layers for i in self.linear_attention_layers):
                raise ValueError(f"linear_attention_layers={self.linear_attention_layers} must be distinct "
                                 f"ascending layers in [0, num_hidden_layers={self.num_hidden_layers})")
            for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_conv_kernel_dim"):
                _positive(name, getattr(self, name))
        if self.hidden_size_per_layer_input:
            if not self.description.per_layer_inputs:
                raise ValueError(f"hidden_size_per_layer_input={self.hidden_size_per_layer_input} given for "
                                 f"family={self.family!r}, which has no per-layer input embeddings")
            _positive("hidden_size_per_layer_input", self.hidden_size_per_layer_input)
            _positive("vocab_size_per_layer_input", self.vocab_size_per_layer_input)
        elif self.vocab_size_per_layer_input:
            raise ValueError(f"vocab_size_per_layer_input={self.vocab_size_per_layer_input} given without "
                             "hidden_size_per_layer_input")
        if self.shared_expert_intermediate_size and self.description.shared_expert is None:
            raise ValueError(f"shared_expert_intermediate_size={self.shared_expert_intermediate_size} given "
                             f"for family={self.family!r}, which has no shared expert")

    def _check_full_attention(self) -> None:
        layers = self.full_attention_layers
        if list(layers) != sorted(set(layers)) or not 0 <= layers[0] <= layers[-1] < self.num_hidden_layers:
            raise ValueError(f"full_attention_layers={layers} must be distinct ascending layers in "
                             f"[0, num_hidden_layers={self.num_hidden_layers})")
        _positive("full_attention_head_dim", self.full_attention_head_dim)
        _positive("full_attention_kv_heads", self.full_attention_kv_heads)
        if self.num_attention_heads % self.full_attention_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                             f"full_attention_kv_heads={self.full_attention_kv_heads}")
        if self.is_mla:
            raise ValueError(f"full_attention_layers given for family={self.family!r}, which has MLA")

    def attention_dims(self, layer: int) -> tuple[int, int]:
        """``(head_dim, num_key_value_heads)`` of decoder layer ``layer`` (see
        :attr:`full_attention_layers`)."""
        if layer in self.full_attention_layers:
            return self.full_attention_head_dim, self.full_attention_kv_heads
        return self.head_dim, self.num_key_value_heads

    def values_from_keys(self, layer: int) -> bool:
        """Whether layer ``layer`` has no ``v_proj``, its values being its keys
        (:attr:`full_attention_k_eq_v`)."""
        return self.full_attention_k_eq_v and layer in self.full_attention_layers

    @property
    def kv_head_counts(self) -> tuple[int, ...]:
        """The distinct key/value head counts of the layers, ascending."""
        return tuple(sorted({self.attention_dims(i)[1] for i in range(self.num_hidden_layers)}))

    @property
    def description(self) -> Family:
        """The family's description (:class:`hybridmem.models.Family`); :attr:`family` is its name."""
        return self._family

    @property
    def text_names(self) -> TextModelNames:
        """Where :attr:`multimodal`'s model keeps the text model's tensors; the text model's own names (no
        renames) without one."""
        return dict(self.description.multimodal_names).get(self.multimodal, TextModelNames())

    @property
    def is_moe(self) -> bool:
        """Whether the MLP of every layer is a mixture of experts (of a family whose experts are optional, a
        config that gives them)."""
        return self.description.moe and (self.num_experts > 0 or not self.description.experts_optional)

    @property
    def is_mla(self) -> bool:
        """Whether attention is DeepSeek's multi-latent attention."""
        return self.description.mla

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (global index) has a mixture-of-experts MLP."""
        return self.is_moe and layer >= self.first_k_dense_replace and (layer + 1) % self.moe_layer_step == 0

    @property
    def has_dense_layers(self) -> bool:
        """Whether any layer has a dense MLP."""
        if self.description.dense_mlp_with_experts:
            return True
        return not self.is_moe or self.first_k_dense_replace > 0 or self.moe_layer_step > 1

    @property
    def has_router_bias(self) -> bool:
        """The router carries ``e_score_correction_bias`` [num_experts] (in HF and Megatron: DeepSeek-V3,
        GLM-4.5)."""
        return self.description.router_bias is not RouterBias.NONE

    @property
    def vllm_router_bias(self) -> bool:
        """vLLM's model has the router bias (DeepSeek-V3: only with ``topk_method == "noaux_tc"``)."""
        bias = self.description.router_bias
        return bias is RouterBias.ALWAYS or (bias is RouterBias.NOAUX_TC and self.topk_method == "noaux_tc")

    def keeps_fp32(self, hf_name: str) -> bool:
        """Whether checkpoint tensor ``hf_name`` travels in fp32 even on a narrower wire (see [Note: wire
        dtype] in :mod:`hybridmem.reshard.execute`): a routing-score correction bias (DeepSeek-V3, GLM-4.5,
        MiniMax-M2's ``block_sparse_moe.e_score_correction_bias``), whose bf16 rounding would change which
        experts a token is routed to."""
        return self.has_router_bias and any(name.endswith(".mlp.gate.e_score_correction_bias")
                                            for name in self.canonical_names_of(hf_name))

    def wire_itemsize(self, hf_name: str, itemsize: int) -> int:
        """Bytes per element of ``hf_name`` on a wire of ``itemsize`` bytes: 4 (fp32) for a tensor the spec
        keeps in fp32 when the wire is narrower, else ``itemsize`` (see [Note: wire dtype] in
        :mod:`hybridmem.reshard.execute`)."""
        return max(itemsize, 4) if self.keeps_fp32(hf_name) else itemsize

    @property
    def shared_expert_name(self) -> str:
        """HF/vLLM module name of the shared expert: ``shared_experts`` (DeepSeek, GLM) or ``shared_expert``
        (Qwen)."""
        return self.description.shared_expert or "shared_expert"

    @property
    def has_shared_expert_gate(self) -> bool:
        """Qwen2-MoE gates its shared expert with a [1, H] sigmoid."""
        return self.description.shared_expert_gate and self.shared_expert_intermediate_size > 0

    @property
    def per_layer_inputs_size(self) -> int:
        """Columns of the per-layer input embeddings (and rows of their model projection), all layers'
        together: ``num_hidden_layers * hidden_size_per_layer_input``; 0 without them."""
        return self.num_hidden_layers * self.hidden_size_per_layer_input

    def is_linear_attention_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (global index) is a gated delta-net layer (``linear_attn.*``)."""
        return layer in self.linear_attention_layers

    @property
    def q_size(self) -> int:
        """Rows of q_proj: ``num_attention_heads * head_dim``."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Rows of k_proj (and v_proj): ``num_key_value_heads * head_dim``."""
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelSpec:
        """Build from a ``transformers`` config object or a dict with the same keys, read by the family's
        own reader (:attr:`hybridmem.models.Family.read_config`). A multimodal config the family names
        (:attr:`hybridmem.models.Family.multimodal_types`, Qwen3.5's ``qwen3_5``) gives its text model's spec,
        read from its ``text_config``; where that model keeps the text model's tensors under names of its own
        (:attr:`hybridmem.models.Family.multimodal_names`, Kimi-K2.5's ``kimi_k25``), the spec's
        :attr:`multimodal` is its type.

        Raises:
            ValueError: Unknown ``model_type``, a required key is missing (a multimodal config's
                ``text_config`` too), or a value the family's description does not cover (each named).
        """
        get = getter(cfg)
        model_type = model_type_of(get)
        family = get_family(model_type)
        if model_type in family.multimodal_types:
            text = get("text_config")
            if text is None:
                raise ValueError(f"model_type={model_type!r}: the multimodal config lacks text_config")
            get = getter(text)
        multimodal = model_type if model_type in dict(family.multimodal_names) else ""
        return cls(family=family.name, multimodal=multimodal, **_numerics(get), **family.read_config(get))

    def _attention_shapes(self, p: str, shapes: dict[str, tuple[int, ...]], layer: int) -> None:
        h = self.hidden_size
        if not self.is_mla:
            if self.description.attention_sinks:
                shapes[p + "self_attn.sinks"] = (self.num_attention_heads,)
            hd, nkv = self.attention_dims(layer)
            q_rows, kv_rows = self.num_attention_heads * hd, nkv * hd
            projections = (("q", q_rows), ("k", kv_rows)) + (() if self.values_from_keys(layer)
                                                             else (("v", kv_rows),))
            gate = 2 if self.description.attention_output_gate else 1  # [q_h; gate_h] per head (Qwen3.5)
            for proj, rows in projections:
                rows *= gate if proj == "q" else 1
                shapes[p + f"self_attn.{proj}_proj.weight"] = (rows, h)
                if self.qkv_bias:
                    shapes[p + f"self_attn.{proj}_proj.bias"] = (rows,)
            if self.qk_norm:
                every_head = self.description.qk_norm_all_heads  # one norm over all heads (MiniMax-M2)
                shapes[p + "self_attn.q_norm.weight"] = (q_rows,) if every_head else (hd,)
                shapes[p + "self_attn.k_norm.weight"] = (kv_rows,) if every_head else (hd,)
            shapes[p + "self_attn.o_proj.weight"] = (h, q_rows)
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            return
        n, kv_lora = self.num_attention_heads, self.kv_lora_rank
        if self.q_lora_rank:
            shapes[p + "self_attn.q_a_proj.weight"] = (self.q_lora_rank, h)
            shapes[p + "self_attn.q_a_layernorm.weight"] = (self.q_lora_rank,)
            shapes[p + "self_attn.q_b_proj.weight"] = (n * self.head_dim, self.q_lora_rank)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (n * self.head_dim, h)
        shapes[p + "self_attn.kv_a_proj_with_mqa.weight"] = (kv_lora + self.qk_rope_head_dim, h)
        shapes[p + "self_attn.kv_a_layernorm.weight"] = (kv_lora,)
        shapes[p + "self_attn.kv_b_proj.weight"] = (n * (self.qk_nope_head_dim + self.v_head_dim), kv_lora)
        shapes[p + "self_attn.o_proj.weight"] = (h, n * self.v_head_dim)
        if self.description.sparse_attention_indexer:
            x, heads, width = p + "self_attn.indexer.", self.index_n_heads, self.index_head_dim
            shapes[x + "wq_b.weight"] = (heads * width, self.q_lora_rank)
            shapes[x + "wk.weight"] = (width, h)
            shapes[x + "k_norm.weight"] = (width,)
            shapes[x + "k_norm.bias"] = (width,)
            shapes[x + "weights_proj.weight"] = (heads, h)

    def _linear_attention_shapes(self, p: str, shapes: dict[str, tuple[int, ...]]) -> None:
        """A gated delta-net layer by canonical names: its convolution and input projection over [q; k; v] as
        one canonical tensor per segment (the checkpoint fuses them, see the family's
        ``checkpoint_fused``)."""
        h, la = self.hidden_size, p + "linear_attn."
        key = self.linear_num_key_heads * self.linear_key_head_dim
        value = self.linear_num_value_heads * self.linear_value_head_dim
        segments = (("q", key), ("k", key), ("v", value))
        for part, rows in segments:
            shapes[la + f"conv1d_{part}.weight"] = (rows, 1, self.linear_conv_kernel_dim)
        shapes[la + "dt_bias"] = (self.linear_num_value_heads,)
        shapes[la + "A_log"] = (self.linear_num_value_heads,)
        shapes[la + "norm.weight"] = (self.linear_value_head_dim,)
        shapes[la + "out_proj.weight"] = (h, value)
        for part, rows in (*segments, ("z", value)):
            shapes[la + f"in_proj_{part}.weight"] = (rows, h)
        for part in ("b", "a"):
            shapes[la + f"in_proj_{part}.weight"] = (self.linear_num_value_heads, h)

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF-full tensor the checkpoint holds, by its checkpoint name, and its shape, in HF's order
        (layers ascending); the names ``load_weights`` of vLLM takes (see [Note: canonical names] in
        :mod:`hybridmem.models.family`)."""
        return dict(_checkpoint(self)[0])

    def checkpoint_names(self) -> Mapping[str, Placement]:
        """``{canonical name: Placement}``: the tensor itself, a renamed one, a row block of a fused one
        (Phi-3's ``qkv_proj``), or one expert of a tensor stacked over experts, maybe transposed
        (gpt-oss). Cached per spec; do not modify."""
        return _checkpoint(self)[1]

    def canonical_names_of(self, hf_name: str) -> tuple[str, ...]:
        """The canonical names whose tensors make up checkpoint tensor ``hf_name`` (the inverse of
        :meth:`checkpoint_names`; ``()`` for a name the checkpoint lacks). Cached per spec."""
        family = self.description
        if not (family.checkpoint_renames or family.checkpoint_fused or family.checkpoint_stacked
                or self.multimodal):
            return (hf_name,) if hf_name in _canonical(self) else ()
        return _inverse_checkpoint(self).get(hf_name, ())

    def canonical_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Every tensor by its canonical name (see [Note: canonical names] in :mod:`hybridmem.models.family`)
        and its shape, in HF's order. Cached per spec; do not modify."""
        return _canonical(self)

    def per_layer_input_shapes(self) -> dict[str, tuple[int, ...]]:
        """The per-layer input embeddings' tensors outside the layers, by name, and their shapes (see
        :attr:`hybridmem.models.Family.per_layer_inputs`); empty without them."""
        if not self.hidden_size_per_layer_input:
            return {}
        width, total = self.hidden_size_per_layer_input, self.per_layer_inputs_size
        return {"model.embed_tokens_per_layer.weight": (self.vocab_size_per_layer_input, total),
                "model.per_layer_model_projection.weight": (total, self.hidden_size),
                "model.per_layer_projection_norm.weight": (width,)}

    def _canonical_shapes(self) -> dict[str, tuple[int, ...]]:
        h, shapes = self.hidden_size, {}
        shapes["model.embed_tokens.weight"] = (self.vocab_size, h)
        shapes.update(self.per_layer_input_shapes())
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            if self.is_linear_attention_layer(i):
                self._linear_attention_shapes(p, shapes)
            else:
                self._attention_shapes(p, shapes, i)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            for norm in self.description.extra_norms:
                shapes[p + norm] = (h,)
            if self.description.layer_scalar:
                shapes[p + "layer_scalar"] = (1,)
            if self.hidden_size_per_layer_input:
                width = self.hidden_size_per_layer_input
                shapes[p + "per_layer_input_gate.weight"] = (width, h)
                shapes[p + "per_layer_projection.weight"] = (h, width)
                shapes[p + "post_per_layer_input_norm.weight"] = (h,)
            if not self.is_moe_layer(i) or self.description.dense_mlp_with_experts:
                for proj in ("gate", "up"):
                    shapes[p + f"mlp.{proj}_proj.weight"] = (self.intermediate_size, h)
                    if self.mlp_bias:
                        shapes[p + f"mlp.{proj}_proj.bias"] = (self.intermediate_size,)
                shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
                if self.mlp_bias:
                    shapes[p + "mlp.down_proj.bias"] = (h,)
                if not self.is_moe_layer(i):
                    continue
            for norm in self.description.moe_norms:
                shapes[p + norm] = (h,)
            shapes[p + "mlp.gate.weight"] = (self.num_experts, h)
            if self.description.router_scales:
                shapes[p + "mlp.gate.scale"] = (h,)
                shapes[p + "mlp.gate.per_expert_scale"] = (self.num_experts,)
            if self.description.router_linear_bias:
                shapes[p + "mlp.gate.bias"] = (self.num_experts,)
            if self.has_router_bias:
                shapes[p + "mlp.gate.e_score_correction_bias"] = (self.num_experts,)
            width = self.moe_intermediate_size
            for e in range(self.num_experts):
                x = p + f"mlp.experts.{e}."
                if self.description.experts_fused_gate_up:
                    shapes[x + "gate_up_proj.weight"] = (2 * width, h)
                    shapes[x + "down_proj.weight"] = (h, width)
                    continue
                if self.description.experts_interleaved:
                    shapes[x + "gate_up_proj.weight"] = (2 * width, h)
                    shapes[x + "gate_up_proj.bias"] = (2 * width,)
                    shapes[x + "down_proj.weight"] = (h, width)
                    shapes[x + "down_proj.bias"] = (h,)
                    continue
                for proj in ("gate", "up"):
                    shapes[x + f"{proj}_proj.weight"] = (width, h)
                shapes[x + "down_proj.weight"] = (h, width)
            if self.shared_expert_intermediate_size:
                s = self.shared_expert_intermediate_size
                x = p + f"mlp.{self.shared_expert_name}."
                for proj in ("gate", "up"):
                    shapes[x + f"{proj}_proj.weight"] = (s, h)
                shapes[x + "down_proj.weight"] = (h, s)
                if self.has_shared_expert_gate:
                    shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


@functools.lru_cache(maxsize=64)
def _canonical(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return spec._canonical_shapes()


@functools.lru_cache(maxsize=64)
def _inverse_checkpoint(spec: ModelSpec) -> dict[str, tuple[str, ...]]:
    out: dict[str, list[str]] = {}
    for canonical, at in _checkpoint(spec)[1].items():
        out.setdefault(at.name, []).append(canonical)
    return {name: tuple(names) for name, names in out.items()}


@functools.lru_cache(maxsize=64)
def _checkpoint(spec: ModelSpec) -> tuple[dict[str, tuple[int, ...]], dict[str, Placement]]:
    """``({checkpoint name: shape}, {canonical name: Placement})`` of ``spec``: the text model's, under the
    multimodal model's names where the spec has them (:attr:`ModelSpec.text_names`)."""
    shapes, where = _text_checkpoint(spec)
    if not spec.multimodal:
        return shapes, where
    names = spec.text_names
    return ({names.checkpoint_name(n): shape for n, shape in shapes.items()},
            {c: at._replace(name=names.checkpoint_name(at.name)) for c, at in where.items()})


def _text_checkpoint(spec: ModelSpec) -> tuple[dict[str, tuple[int, ...]], dict[str, Placement]]:
    family = spec.description
    canonical = spec.canonical_shapes()
    if not (family.checkpoint_renames or family.checkpoint_fused or family.checkpoint_stacked):
        return dict(canonical), {name: Placement(name) for name in canonical}
    fused = {part: (whole, parts) for parts, whole in family.checkpoint_fused for part in parts}
    # Entries naming one stacked tensor are its row blocks (canonical rows, before any transposition), in
    # order.
    wholes = [whole for _, whole, _ in family.checkpoint_stacked]
    stacked = [(re.compile(pattern), whole, transposed, wholes[:k].count(whole), wholes.count(whole))
               for k, (pattern, whole, transposed) in enumerate(family.checkpoint_stacked)]
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, Placement] = {}
    for name, shape in canonical.items():
        prefix, suffix = _split_layer(name)
        if suffix in fused:
            whole, parts = fused[suffix]
            target = prefix + whole
            if target not in shapes:
                shapes[target] = (sum(canonical[prefix + q][0] for q in parts), *shape[1:])
            where[name] = Placement(target,
                                    sum(canonical[prefix + q][0] for q in parts[: parts.index(suffix)]))
            continue
        match = stacked and next(((m, *rest) for pattern, *rest in stacked
                                  if (m := pattern.fullmatch(suffix))), None)
        if match:
            m, whole, transposed, part, parts = match
            target, expert = prefix + whole, int(m.group(1))
            rows = (parts * shape[0], *shape[1:])
            inner = (*rows[:-2], rows[-1], rows[-2]) if transposed else rows
            if target not in shapes:
                shapes[target] = (spec.num_experts, *inner)
            where[name] = Placement(target, row=part * shape[0], index=(expert,), transposed=transposed)
            continue
        target = prefix + family.checkpoint_suffix(suffix) if prefix else name
        shapes[target] = shape
        where[name] = Placement(target)
    return shapes, where


def _split_layer(name: str) -> tuple[str, str]:
    """``"model.layers.3.mlp.gate.weight"`` -> ``("model.layers.3.", "mlp.gate.weight")``; ``("", name)``
    for a tensor outside the layers."""
    if not name.startswith("model.layers."):
        return "", name
    head, _, rest = name[len("model.layers."):].partition(".")
    return f"model.layers.{head}.", rest
