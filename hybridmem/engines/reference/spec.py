"""ModelSpec: the architecture figures of a Llama/Qwen2 decoder, and how tensor parallelism splits them.

Built from a HF config (a ``transformers`` config object or a plain dict). :class:`TPShard` holds the
per-rank sizes vLLM uses for the same model at a tensor-parallel size (see [Note: vLLM per-rank layout]
in :mod:`hybridmem.engines.reference.layout`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ModelSpec", "TPShard", "VOCAB_PADDING", "pad_vocab"]

VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: the embedding and LM head are padded to a multiple of it."""


def pad_vocab(vocab_size: int, pad_to: int = VOCAB_PADDING) -> int:
    """``vocab_size`` rounded up to a multiple of ``pad_to`` (vLLM's ``pad_vocab_size``)."""
    return -(-vocab_size // pad_to) * pad_to


_FAMILIES = ("llama", "qwen2")


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Architecture of a decoder-only Llama/Qwen2-family model."""

    vocab_size: int
    """Number of token ids (unpadded)."""
    hidden_size: int
    """Model width."""
    intermediate_size: int
    """SwiGLU MLP width."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA: divides ``num_heads``)."""
    head_dim: int
    """Width of one head."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    qkv_bias: bool = False
    """Whether q/k/v projections have a bias (Qwen2: yes; Llama: ``attention_bias``)."""
    tie_word_embeddings: bool = False
    """Whether the LM head reuses the embedding matrix."""

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim")
        for name in sizes:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def from_hf(cls, config: Any) -> ModelSpec:
        """Read a HF ``LlamaConfig``/``Qwen2Config`` (object or dict).

        Raises:
            ValueError: ``model_type`` is not a supported family, or rope scaling is set (not supported).
        """
        cfg: Mapping[str, Any] = config if isinstance(config, Mapping) else config.to_dict()
        model_type = cfg.get("model_type", "llama")
        if model_type not in _FAMILIES:
            raise ValueError(f"model_type={model_type!r} is not supported; expected one of {_FAMILIES}")
        rope_theta = cfg.get("rope_theta")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope_theta is None:
            rope_theta = rope.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope_type={rope_type!r} is not supported; only the default (unscaled) RoPE")
        num_heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    def shard(self, tp_size: int, tp_rank: int) -> TPShard:
        """Per-rank sizes at tensor-parallel size ``tp_size`` (see :class:`TPShard`)."""
        return TPShard(spec=self, tp_size=tp_size, tp_rank=tp_rank)


@dataclass(frozen=True, kw_only=True, slots=True)
class TPShard:
    """What rank ``tp_rank`` of ``tp_size`` holds, as vLLM's parallel layers split it.

    Query heads and the MLP are split evenly. KV heads are split evenly when ``tp_size <= num_kv_heads``;
    otherwise each rank holds ONE kv head, replicated over ``tp_size // num_kv_heads`` ranks, and rank
    ``r`` holds kv head ``r // num_kv_head_replicas`` (vLLM ``QKVParallelLinear``).
    """

    spec: ModelSpec
    """The model."""
    tp_size: int
    """Tensor-parallel size."""
    tp_rank: int
    """This rank."""

    def __post_init__(self) -> None:
        s = self.spec
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size={self.tp_size!r} must be a positive int")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} must be in [0, {self.tp_size})")
        if s.num_heads % self.tp_size:
            raise ValueError(f"num_heads={s.num_heads} is not divisible by tp_size={self.tp_size}")
        if s.num_kv_heads % self.tp_size and self.tp_size % s.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={s.num_kv_heads} and tp_size={self.tp_size}: one must divide the other"
            )
        if s.intermediate_size % self.tp_size:
            raise ValueError(
                f"intermediate_size={s.intermediate_size} is not divisible by tp_size={self.tp_size}"
            )
        if self.padded_vocab_size % self.tp_size:
            raise ValueError(
                f"padded vocab {self.padded_vocab_size} is not divisible by tp_size={self.tp_size}"
            )

    @property
    def num_heads(self) -> int:
        """Query heads on this rank."""
        return self.spec.num_heads // self.tp_size

    @property
    def num_kv_head_replicas(self) -> int:
        """How many ranks hold each kv head (1 unless ``tp_size > num_kv_heads``)."""
        return max(1, self.tp_size // self.spec.num_kv_heads)

    @property
    def num_kv_heads(self) -> int:
        """KV heads on this rank."""
        return max(1, self.spec.num_kv_heads // self.tp_size)

    @property
    def kv_head_start(self) -> int:
        """Global index of this rank's first kv head."""
        return (self.tp_rank // self.num_kv_head_replicas) * self.num_kv_heads

    @property
    def intermediate_size(self) -> int:
        """MLP width on this rank."""
        return self.spec.intermediate_size // self.tp_size

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary padded to :data:`VOCAB_PADDING` (all ranks together)."""
        return pad_vocab(self.spec.vocab_size)

    @property
    def vocab_rows(self) -> int:
        """Embedding / LM-head rows on this rank (``padded_vocab_size // tp_size``)."""
        return self.padded_vocab_size // self.tp_size
