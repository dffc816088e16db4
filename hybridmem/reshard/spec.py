"""ModelSpec: the shapes that sharding a decoder-only transformer depends on.

Built from a HF-style config (:meth:`ModelSpec.from_hf_config`, a ``transformers`` config object or a
plain dict). Supported families: ``llama``, ``qwen2``, ``qwen3`` (dense) and ``qwen2_moe``,
``qwen3_moe`` (every layer MoE, as their default ``decoder_sparse_step=1`` and empty
``mlp_only_layers`` make them), and ``deepseek_v3``: multi-latent attention (MLA), the first
``first_k_dense_replace`` layers dense and the rest MoE with shared experts and a routing-score
correction bias (``moe_layer_freq`` 1, as DeepSeek-V3 ships; no multi-token-prediction layers).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelSpec", "FAMILIES"]

FAMILIES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "deepseek_v3")
_MOE_FAMILIES = ("qwen2_moe", "qwen3_moe", "deepseek_v3")


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
    """Width of the shared expert (0: none). Qwen2-MoE also has a [1, H] sigmoid gate on it; DeepSeek-V3's
    is ``moe_intermediate_size * n_shared_experts``."""
    first_k_dense_replace: int = 0
    """MoE families: the first this many layers have a dense MLP of ``intermediate_size`` (DeepSeek-V3)."""
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
        if self.is_mla:
            for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                _positive(name, getattr(self, name))
            if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
                raise ValueError(f"head_dim={self.head_dim} must be qk_nope_head_dim + qk_rope_head_dim = "
                                 f"{self.qk_nope_head_dim} + {self.qk_rope_head_dim} for MLA")
            if self.num_key_value_heads != self.num_attention_heads:
                raise ValueError(f"num_key_value_heads={self.num_key_value_heads} must equal num_attention_heads="
                                 f"{self.num_attention_heads} for MLA (every head has its own key and value)")
        if self.is_moe:
            _positive("num_experts", self.num_experts)
            _positive("moe_intermediate_size", self.moe_intermediate_size)
            if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
                raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must be in "
                                 f"[0, num_hidden_layers={self.num_hidden_layers}]")
            if self.first_k_dense_replace:
                _positive("intermediate_size", self.intermediate_size)
        else:
            _positive("intermediate_size", self.intermediate_size)
            if self.num_experts:
                raise ValueError(f"num_experts={self.num_experts} given for dense family={self.family!r}")

    @property
    def is_moe(self) -> bool:
        """Whether the MLP of every layer is a mixture of experts."""
        return self.family in _MOE_FAMILIES

    @property
    def is_mla(self) -> bool:
        """Whether attention is DeepSeek's multi-latent attention."""
        return self.family == "deepseek_v3"

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` (global index) has a mixture-of-experts MLP."""
        return self.is_moe and layer >= self.first_k_dense_replace

    @property
    def has_dense_layers(self) -> bool:
        """Whether any layer has a dense MLP."""
        return not self.is_moe or self.first_k_dense_replace > 0

    @property
    def has_router_bias(self) -> bool:
        """DeepSeek-V3's router carries ``e_score_correction_bias`` [num_experts] (in HF and Megatron)."""
        return self.family == "deepseek_v3"

    @property
    def vllm_router_bias(self) -> bool:
        """vLLM's DeepSeek-V3 has the router bias: only with ``topk_method == "noaux_tc"``."""
        return self.has_router_bias and self.topk_method == "noaux_tc"

    def keeps_fp32(self, hf_name: str) -> bool:
        """Whether ``hf_name`` travels in fp32 even on a narrower wire (see [Note: wire dtype] in
        :mod:`hybridmem.reshard.execute`): DeepSeek-V3's routing-score correction bias, whose bf16
        rounding would change which experts a token is routed to."""
        return self.has_router_bias and hf_name.endswith(".mlp.gate.e_score_correction_bias")

    @property
    def shared_expert_name(self) -> str:
        """HF/vLLM module name of the shared expert: ``shared_experts`` (DeepSeek) or ``shared_expert`` (Qwen)."""
        return "shared_experts" if self.family == "deepseek_v3" else "shared_expert"

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
        if family == "deepseek_v3":
            return cls._from_deepseek_v3(get)
        heads = int(get("num_attention_heads"))
        kv = get("num_key_value_heads") or heads
        head_dim = get("head_dim") or get("hidden_size") // heads
        is_moe = family in _MOE_FAMILIES
        if get("qkv_bias") is not None:  # Qwen2-MoE's config key
            bias = bool(get("qkv_bias"))
        elif family in ("qwen2", "qwen2_moe"):
            # Qwen2Attention always builds q/k/v with bias=True; Qwen2-MoE's config defaults qkv_bias to
            # True (transformers' Qwen2MoeConfig; vLLM's Qwen2MoeAttention builds the bias regardless).
            bias = True
        else:
            bias = bool(get("attention_bias", False))
        # transformers >= 5.20 writes Qwen3-MoE's expert count as num_local_experts (num_experts is an
        # attribute alias of its config class, so a config object answers to both).
        experts = get("num_experts") or get("num_local_experts") or 0
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
            num_experts=int(experts) if is_moe else 0,
            moe_intermediate_size=int(get("moe_intermediate_size", 0) or 0) if is_moe else 0,
            shared_expert_intermediate_size=(
                int(get("shared_expert_intermediate_size", 0) or 0) if family == "qwen2_moe" else 0
            ),
        )

    @classmethod
    def _from_deepseek_v3(cls, get: Any) -> ModelSpec:
        if get("attention_bias", False):
            raise ValueError("attention_bias=True is not supported for deepseek_v3 (DeepSeek-V3 has none)")
        if get("rope_interleave", True) is False:
            # HF then rotates halves while Megatron's MLA and vLLM rotate pairs: the rope rows would need
            # a permutation, which the layout tables do not apply.
            raise ValueError("rope_interleave=False is not supported for deepseek_v3 (expected True, its default)")
        freq = get("moe_layer_freq", 1) or 1
        if freq != 1:
            raise ValueError(f"moe_layer_freq={freq} is not supported; expected 1 (every layer after "
                             f"first_k_dense_replace is MoE)")
        heads = int(get("num_attention_heads"))
        nope, rope = int(get("qk_nope_head_dim")), int(get("qk_rope_head_dim"))
        moe = int(get("moe_intermediate_size"))
        return cls(
            family="deepseek_v3",
            hidden_size=int(get("hidden_size")),
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=nope + rope,
            intermediate_size=int(get("intermediate_size") or 0),
            num_hidden_layers=int(get("num_hidden_layers")),
            vocab_size=int(get("vocab_size")),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            num_experts=int(get("n_routed_experts")),
            moe_intermediate_size=moe,
            shared_expert_intermediate_size=moe * int(get("n_shared_experts", 0) or 0),
            first_k_dense_replace=int(get("first_k_dense_replace", 0) or 0),
            q_lora_rank=int(get("q_lora_rank") or 0),
            kv_lora_rank=int(get("kv_lora_rank")),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope,
            v_head_dim=int(get("v_head_dim")),
            topk_method=get("topk_method"),
        )

    def _attention_shapes(self, p: str, shapes: dict[str, tuple[int, ...]]) -> None:
        h = self.hidden_size
        if not self.is_mla:
            for proj, rows in (("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size)):
                shapes[p + f"self_attn.{proj}_proj.weight"] = (rows, h)
                if self.qkv_bias:
                    shapes[p + f"self_attn.{proj}_proj.bias"] = (rows,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (self.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (self.head_dim,)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.q_size)
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

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF-full tensor name and its shape, in HF's order (layers ascending)."""
        h, shapes = self.hidden_size, {}
        shapes["model.embed_tokens.weight"] = (self.vocab_size, h)
        for i in range(self.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            self._attention_shapes(p, shapes)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            if not self.is_moe_layer(i):
                for proj in ("gate", "up"):
                    shapes[p + f"mlp.{proj}_proj.weight"] = (self.intermediate_size, h)
                shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
                continue
            shapes[p + "mlp.gate.weight"] = (self.num_experts, h)
            if self.has_router_bias:
                shapes[p + "mlp.gate.e_score_correction_bias"] = (self.num_experts,)
            for e in range(self.num_experts):
                for proj in ("gate", "up"):
                    shapes[p + f"mlp.experts.{e}.{proj}_proj.weight"] = (self.moe_intermediate_size, h)
                shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (h, self.moe_intermediate_size)
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
