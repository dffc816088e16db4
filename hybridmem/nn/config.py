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

from hybridmem.models import ALIASES, get_family, getter
from hybridmem.models import FAMILIES

__all__ = ["DecoderConfig", "EMBEDDED_MODEL_TYPES"]

EMBEDDED_MODEL_TYPES = tuple(sorted(
    [name for name, f in FAMILIES.items() if f.embedded_engine is None]
    + [alias for alias, name in ALIASES.items() if FAMILIES[name].embedded_engine is None]))
"""HF ``model_type`` values a :class:`DecoderConfig` describes: the families whose description says the
embedded engine runs them (``Family.embedded_engine is None``), and their aliases."""


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

        ``attention_bias`` is the config's; absent, the family's default (its description's ``qkv_bias``:
        Qwen2 always has q/k/v biases, Llama none).

        Raises:
            ValueError: ``model_type`` is not one of :data:`EMBEDDED_MODEL_TYPES` (absent counts as
                ``llama``; a known family the engine has no blocks for is named with the reason), the config gives biases the
                blocks have no place for (an output-projection or MLP bias, each named), the RoPE is scaled
                (``rope_scaling`` / ``rope_parameters`` with a ``rope_type`` other than ``default``) or
                partial, or attention is limited to a sliding window shorter than the context.
        """
        model_type = _get(cfg, "model_type") or "llama"
        family = get_family(model_type)
        reason = family.embedded_engine
        if reason is not None:
            raise ValueError(f"model_type={model_type!r} does not run in the embedded engine ({reason}); "
                             f"it runs {list(EMBEDDED_MODEL_TYPES)}")
        rope = _get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope_type={rope_type!r} is not supported; only the default (unscaled) RoPE")
        partial = rope.get("partial_rotary_factor", _get(cfg, "partial_rotary_factor")) or 1.0
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor={partial} is not supported; the embedded engine rotates whole heads")
        window, context = _get(cfg, "sliding_window"), _get(cfg, "max_position_embeddings")
        if window is not None and _get(cfg, "use_sliding_window") is not False and (context is None or window < context):
            raise ValueError(
                f"sliding_window={window} (max_position_embeddings={context}) is not supported: the embedded engine "
                f"attends to the whole context; use a model without a sliding window (sliding_window=None)")
        # The blocks add q/k/v biases only; the family's own reader says which other biases the config gives.
        fields = family.read_config(getter(cfg))
        extra = []
        if fields.get("o_bias"):
            extra.append("attention_bias=True gives self_attn.o_proj.bias")
        if fields.get("mlp_bias"):
            extra.append("mlp_bias=True gives mlp.gate_proj.bias, mlp.up_proj.bias, mlp.down_proj.bias")
        if extra:
            raise ValueError(f"model_type={model_type!r} with {'; '.join(extra)}: the embedded engine's blocks have "
                             f"no place for these biases (they add q/k/v biases only); serve this model with vLLM")
        heads = int(_get(cfg, "num_attention_heads"))
        hidden = int(_get(cfg, "hidden_size"))
        bias = _get(cfg, "attention_bias")
        if bias is None:  # the family's default: Qwen2 always builds q/k/v biases, Llama none
            bias = fields["qkv_bias"]
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
