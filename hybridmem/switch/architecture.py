"""Refuse an engine built for another architecture than the training model, at manager construction.

The check runs when both sides say what they are: the engine through a ``spec`` attribute holding a
:class:`~hybridmem.reshard.ModelSpec` (``ReferenceEngine``), the training side through the
``model_spec=`` given to the manager (an HF-style config), the training state's ``model_spec_dict()``
(the Megatron adapter) or an HF model's ``config``. With a ``weight_sync=`` of the caller's own the
check is skipped (such a sync may convert between architectures on purpose); the weight-coverage proof
of every sync ([Note: weight coverage] in :mod:`hybridmem.weight_sync`) still fails a switch that leaves an
engine tensor unwritten.
"""

from __future__ import annotations

from typing import Any

from hybridmem.contract.engine import InferenceEngine, capabilities_of
from hybridmem.contract.training import TrainingState, training_capabilities_of
from hybridmem.reshard.spec import ModelSpec

__all__ = ["ARCHITECTURE_FIELDS", "check_architecture"]

ARCHITECTURE_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "qkv_bias",
    "tie_word_embeddings",
)
"""What must agree between the training model and the engine (the vocabulary may be padded differently)."""


def _decoder(config: Any) -> ModelSpec | None:
    if config is None or isinstance(config, ModelSpec):
        return config
    try:
        return ModelSpec.from_hf_config(config)
    except (ValueError, TypeError, KeyError, AttributeError):
        # a family hybridmem.models does not know: cannot tell
        return None


def _training_side(training: Any, model_spec: Any) -> tuple[str, ModelSpec] | None:
    candidates: list[tuple[str, Any]] = []
    if model_spec is not None:
        candidates.append(("model_spec", model_spec))
    capabilities = training_capabilities_of(training)
    if capabilities.describes_model:
        candidates.append((f"{type(training).__name__}.model_spec_dict()", training.model_spec_dict()))
    config = training.hf_config if capabilities.has_hf_config else None
    if config is not None:
        module = training.module if capabilities.holds_module else None
        what = (type(getattr(module, "module", module)).__name__ if module is not None
                else "the training model")
        candidates.append((f"{what} ({getattr(config, 'model_type', '?')})", config))
    for label, config in candidates:
        decoder = _decoder(config)
        if decoder is not None:
            return label, decoder
    return None


def _describe(decoder: ModelSpec, fields: list[str]) -> str:
    return ", ".join(f"{f}={getattr(decoder, f)!r}" for f in fields)


def check_architecture(training: TrainingState, engine: InferenceEngine, *, model_spec: Any = None) -> None:
    """Raise when the engine's architecture and the training model's are both known and differ.

    Raises:
        ValueError: Naming both sides and every differing field.
    """
    engine_spec = engine.spec if capabilities_of(engine).describes_decoder else None
    if not isinstance(engine_spec, ModelSpec):
        return
    side = _training_side(training, model_spec)
    if side is None:
        return
    label, train_spec = side
    differ = [f for f in ARCHITECTURE_FIELDS if getattr(train_spec, f) != getattr(engine_spec, f)]
    if differ:
        raise ValueError(
            f"the engine {type(engine).__name__} is built for another architecture than the training model "
            f"{label}: engine has {_describe(engine_spec, differ)}, the training model has "
            f"{_describe(train_spec, differ)}; build the engine from the training model's config"
        )
