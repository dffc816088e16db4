"""ModelSpec: the shapes that sharding a decoder-only transformer depends on.

Built from a HF-style config (:meth:`ModelSpec.from_hf_config`, a ``transformers`` config object or a
plain dict). Supported families: ``llama``, ``qwen2``, ``qwen3`` (dense) and ``qwen2_moe``,
``qwen3_moe`` (every layer MoE, as their default ``decoder_sparse_step=1`` and empty
``mlp_only_layers`` make them). DeepSeek-V3 (MLA attention, dense first layers) is not covered.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelSpec", "FAMILIES"]

FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
_MOE_FAMILIES = ("qwen2_moe", "qwen3_moe")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Shapes and options of one model; hashable, so plans can be cached on it."""

    family: str = "llama"
    """One of :data:`FAMILIES`; decides attention bias / qk-norm defaults and the MoE block."""
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
    qk_norm: bool = False
    """Per-head RMSNorm on q and k (Qwen3): ``q_norm.weight`` / ``k_norm.weight`` of shape [head_dim]."""
    tie_word_embeddings: bool = False
    """The output layer shares the embedding matrix."""
    num_experts: int = 0
    """Routed experts per MoE layer (0 for dense models)."""
    moe_intermediate_size: int = 0
    """Width of one routed expert."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert (0: none). Qwen2-MoE also has a [1, H] sigmoid gate on it."""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} is not supported; expected one of {FAMILIES}")
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "num_hidden_layers", "vocab_size"):
            _positive(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.is_moe:
            _positive("num_experts", self.num_experts)
            _positive("moe_intermediate_size", self.moe_intermediate_size)
        else:
            _positive("intermediate_size", self.intermediate_size)
            if self.num_experts:
                raise ValueError(f"num_experts={self.num_experts} given for dense family={self.family!r}")

    @property
    def is_moe(self) -> bool:
        """Whether the MLP of every layer is a mixture of experts."""
        return self.family in _MOE_FAMILIES

    @property
    def has_shared_expert_gate(self) -> bool:
        """Qwen2-MoE gates its shared expert with a [1, H] sigmoid; Qwen3-MoE has no shared expert."""
        return self.family == "qwen2_moe" and self.shared_expert_intermediate_size > 0

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
        """Build from a ``transformers`` config object or a dict with the same keys.

        Raises:
            ValueError: Unknown ``model_type``, or a required key is missing.
        """
        get = (lambda k, d=None: cfg.get(k, d)) if isinstance(cfg, Mapping) else (
            lambda k, d=None: getattr(cfg, k, d)
        )
        family = get("model_type", "llama")
        if family not in FAMILIES:
            raise ValueError(f"model_type={family!r} is not supported; expected one of {FAMILIES}")
        missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
                   if get(k) is None]
        if missing:
            raise ValueError(f"HF config lacks {missing}")
        heads = int(get("num_attention_heads"))
        kv = get("num_key_value_heads") or heads
        head_dim = get("head_dim") or get("hidden_size") // heads
        is_moe = family in _MOE_FAMILIES
        if get("qkv_bias") is not None:  # Qwen2-MoE's config key
            bias = bool(get("qkv_bias"))
        elif family == "qwen2":
            bias = True  # Qwen2Attention always builds q/k/v with bias=True.
        else:
            bias = bool(get("attention_bias", False))
        return cls(
            family=family,
            hidden_size=int(get("hidden_size")),
            num_attention_heads=heads,
            num_key_value_heads=int(kv),
            head_dim=int(head_dim),
            intermediate_size=int(get("intermediate_size") or 0),
            num_hidden_layers=int(get("num_hidden_layers")),
            vocab_size=int(get("vocab_size")),
            qkv_bias=bias,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            num_experts=int(get("num_experts", 0) or 0) if is_moe else 0,
            moe_intermediate_size=int(get("moe_intermediate_size", 0) or 0) if is_moe else 0,
            shared_expert_intermediate_size=(
                int(get("shared_expert_intermediate_size", 0) or 0) if family == "qwen2_moe" else 0
            ),
        )

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF-full tensor name and its shape, in HF's order (layers ascending)."""
        h, shapes = self.hidden_size, {}
        shapes["model.embed_tokens.weight"] = (self.vocab_size, h)
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            for proj, rows in (("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size)):
                shapes[p + f"self_attn.{proj}_proj.weight"] = (rows, h)
                if self.qkv_bias:
                    shapes[p + f"self_attn.{proj}_proj.bias"] = (rows,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (self.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (self.head_dim,)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.q_size)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if not self.is_moe:
                for proj in ("gate", "up"):
                    shapes[p + f"mlp.{proj}_proj.weight"] = (self.intermediate_size, h)
                shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
                continue
            shapes[p + "mlp.gate.weight"] = (self.num_experts, h)
            for e in range(self.num_experts):
                for proj in ("gate", "up"):
                    shapes[p + f"mlp.experts.{e}.{proj}_proj.weight"] = (self.moe_intermediate_size, h)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (h, self.moe_intermediate_size)
            if self.shared_expert_intermediate_size:
                s = self.shared_expert_intermediate_size
                for proj in ("gate", "up"):
                    shapes[p + f"mlp.shared_expert.{proj}_proj.weight"] = (s, h)
                shapes[p + "mlp.shared_expert.down_proj.weight"] = (h, s)
                if self.has_shared_expert_gate:
                    shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes
