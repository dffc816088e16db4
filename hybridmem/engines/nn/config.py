"""The decoders :mod:`hybridmem.engines.nn` and the embedded engine run: which
:class:`~hybridmem.reshard.ModelSpec` their blocks can compute, read from an HF config and checked once.

There is one model configuration, the registry's :class:`~hybridmem.reshard.ModelSpec`; this module says which
of them the embedded blocks (q/k/v biases, RMSNorm, unscaled whole-head RoPE, a SwiGLU MLP) run, and gives
back the HF config dict a spec stands for (the demo builds transformers' model from it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from hybridmem.models import ALIASES, FAMILIES, get_family, getter, model_type_of
from hybridmem.reshard.spec import ModelSpec

__all__ = ["EMBEDDED_MODEL_TYPES", "embedded_spec", "check_embedded", "hf_config_dict"]

EMBEDDED_MODEL_TYPES = tuple(sorted(
    [name for name, f in FAMILIES.items() if f.embedded_engine is None]
    + [alias for alias, name in ALIASES.items() if FAMILIES[name].embedded_engine is None]))
"""HF ``model_type`` values the embedded blocks run: the families whose description says the embedded engine
runs them (``Family.embedded_engine is None``), and their aliases."""


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def check_embedded(spec: ModelSpec) -> ModelSpec:
    """``spec`` when the embedded blocks can compute it.

    Raises:
        ValueError: The family is not one the embedded engine runs (named, with the reason its description
            gives), or the spec has tensors the blocks have no place for (an output-projection or MLP bias,
            each named), or an odd ``head_dim`` (RoPE rotates pairs).
    """
    reason = spec.description.embedded_engine
    if reason is not None:
        raise ValueError(f"model_type={spec.family!r} does not run in the embedded engine ({reason}); "
                         f"it runs {list(EMBEDDED_MODEL_TYPES)}")
    extra = []
    if spec.o_bias:
        extra.append("attention_bias=True gives self_attn.o_proj.bias")
    if spec.mlp_bias:
        extra.append("mlp_bias=True gives mlp.gate_proj.bias, mlp.up_proj.bias, mlp.down_proj.bias")
    if extra:
        raise ValueError(f"model_type={spec.family!r} with {'; '.join(extra)}: the embedded engine's blocks "
                         f"have no place for these biases (they add q/k/v biases only); serve this model "
                         f"with vLLM")
    if spec.head_dim % 2:
        raise ValueError(f"head_dim={spec.head_dim} must be even for RoPE")
    if spec.intermediate_size < 1:
        raise ValueError(f"intermediate_size={spec.intermediate_size} must be a positive int")
    return spec


def embedded_spec(cfg: Any) -> ModelSpec:
    """The :class:`~hybridmem.reshard.ModelSpec` of a transformers config (``LlamaConfig``, ``Qwen2Config``,
    ...) or a dict with the same keys, checked for the embedded blocks; a ``ModelSpec`` is checked as it is.

    ``attention_bias`` is the config's; absent, the family's default (Qwen2 always has q/k/v biases, Llama
    none).

    Raises:
        ValueError: ``model_type`` is not one of :data:`EMBEDDED_MODEL_TYPES` (absent: read from the config's
            ``architectures``, else ``llama``, see :func:`hybridmem.models.model_type_of`; a
            known family the engine has no blocks for is named with the reason), the config gives biases the
            blocks have no place for (each named), the RoPE is scaled (``rope_scaling`` / ``rope_parameters``
            with a ``rope_type`` other than ``default``) or partial, or attention is limited to a sliding
            window shorter than the context.
    """
    if isinstance(cfg, ModelSpec):
        return check_embedded(cfg)
    model_type = model_type_of(getter(cfg))
    reason = get_family(model_type).embedded_engine
    if reason is not None:
        raise ValueError(f"model_type={model_type!r} does not run in the embedded engine ({reason}); "
                         f"it runs {list(EMBEDDED_MODEL_TYPES)}")
    rope = _get(cfg, "rope_parameters") or _get(cfg, "rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ValueError(f"rope_type={rope_type!r} is not supported; only the default (unscaled) RoPE")
    partial = rope.get("partial_rotary_factor", _get(cfg, "partial_rotary_factor")) or 1.0
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported; the embedded engine rotates "
                         "whole heads")
    window, context = _get(cfg, "sliding_window"), _get(cfg, "max_position_embeddings")
    if (window is not None and _get(cfg, "use_sliding_window") is not False
            and (context is None or window < context)):
        raise ValueError(
            f"sliding_window={window} (max_position_embeddings={context}) is not supported: the embedded "
            f"engine attends to the whole context; use a model without a sliding window "
            f"(sliding_window=None)")
    spec = ModelSpec.from_hf_config(cfg)
    bias = _get(cfg, "attention_bias")
    if bias is not None and bool(bias) != spec.qkv_bias and not spec.o_bias:
        # Qwen2's reader builds q/k/v biases whatever the config says; a config that sets the key decides.
        spec = dataclasses.replace(spec, qkv_bias=bool(bias))
    return check_embedded(spec)


def hf_config_dict(spec: ModelSpec) -> dict[str, Any]:
    """The HF config dict of an embedded decoder (for ``transformers.AutoConfig.for_model`` or
    :meth:`~hybridmem.reshard.ModelSpec.from_hf_config`, which gives ``spec`` back).

    Raises:
        ValueError: As :func:`check_embedded`.
    """
    check_embedded(spec)
    return dict(
        model_type=spec.family, hidden_size=spec.hidden_size, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        vocab_size=spec.vocab_size, rms_norm_eps=spec.rms_norm_eps, rope_theta=spec.rope_theta,
        attention_bias=spec.qkv_bias, tie_word_embeddings=spec.tie_word_embeddings,
    )
