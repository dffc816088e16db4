"""DecoderConfig: the architecture of a Llama/Qwen2 decoder (HF config names), shared by the trainable
model (:mod:`hybridmem.nn.gpt`), the embedded engine (:mod:`hybridmem.engines.reference`) and the demo.

The resharding engine has its own :class:`hybridmem.reshard.ModelSpec`: it covers more families (MoE,
qk-norm) and only the shapes sharding depends on; both read the same HF config dict
(:meth:`DecoderConfig.to_hf_dict` gives it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DecoderConfig", "FAMILIES"]

FAMILIES = ("llama", "qwen2")
"""HF ``model_type`` values a :class:`DecoderConfig` describes."""


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


@dataclass(frozen=True, kw_only=True, slots=True)
class DecoderConfig:
    """The hyper-parameters of a Llama/Qwen2 decoder (HF config names)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention_bias: bool = False
    """q/k/v biases (Qwen2 has them)."""
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                    "num_hidden_layers", "vocab_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DecoderConfig.{key}={value!r} must be a positive int")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def from_hf_config(cls, cfg: Any) -> DecoderConfig:
        """From a transformers ``LlamaConfig``/``Qwen2Config`` or a dict with the same keys.

        ``attention_bias`` defaults to ``True`` for ``model_type == "qwen2"`` (Qwen2 always has q/k/v
        biases), else to the config's ``attention_bias`` (Llama's default ``False``).

        Raises:
            ValueError: ``model_type`` is not ``llama`` or ``qwen2`` (absent counts as ``llama``), or the
                RoPE is scaled (``rope_scaling`` / ``rope_parameters`` with a ``rope_type`` other than
                ``default``).
        """
        model_type = _get(cfg, "model_type") or "llama"
        if model_type not in FAMILIES:
            raise ValueError(f"model_type={model_type!r} is not supported; expected one of {FAMILIES}")
        rope = _get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope_type={rope_type!r} is not supported; only the default (unscaled) RoPE")
        heads = int(_get(cfg, "num_attention_heads"))
        hidden = int(_get(cfg, "hidden_size"))
        bias = _get(cfg, "attention_bias")
        if bias is None:
            bias = _get(cfg, "model_type") == "qwen2"
        theta = _get(cfg, "rope_theta")
        if theta is None:  # transformers 5 keeps it in rope_parameters
            theta = rope.get("rope_theta", 10000.0)
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(_get(cfg, "num_key_value_heads") or heads),
            head_dim=int(_get(cfg, "head_dim") or hidden // heads),
            intermediate_size=int(_get(cfg, "intermediate_size")),
            num_hidden_layers=int(_get(cfg, "num_hidden_layers")),
            vocab_size=int(_get(cfg, "vocab_size")),
            rms_norm_eps=float(_get(cfg, "rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            attention_bias=bool(bias),
            tie_word_embeddings=bool(_get(cfg, "tie_word_embeddings", False)),
        )

    def to_hf_dict(self, model_type: str = "qwen2") -> dict[str, Any]:
        """The HF config dict (for ``transformers.AutoConfig.for_model`` or ``ModelSpec.from_hf_config``)."""
        out = {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]
        out["model_type"] = model_type
        return out
