"""The weight sync ShardingManager uses when none is given (:func:`default_weight_sync`), and the model
spec it reads from the training state (:func:`model_spec_of`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from enum import Enum
from typing import Any

from hybridmem.accel.group import rank_and_size
from hybridmem.contract.engine import InferenceEngine, capabilities_of
from hybridmem.contract.training import TrainingState, training_capabilities_of
from hybridmem.reshard import ModelSpec
from hybridmem.weight_sync.base import WeightSync
from hybridmem.weight_sync.fp8 import engine_block
from hybridmem.weight_sync.resharding import ReshardSync
from hybridmem.weight_sync.streamed import LoadWeightsSync

__all__ = ["SyncRoute", "default_weight_sync", "model_spec_of"]

log = logging.getLogger(__name__)


def _source_layout(training: Any, spec: Any, group: Any) -> Any:
    """The training state's own source layout (FSDP2 shards), or ``None``: ``ReshardSync`` then reads
    ``config.train_layout`` (transformers' names held whole on every rank, or Megatron-core's layout)."""
    if not training_capabilities_of(training).shards_weights:
        return None
    return training.hf_source_layout(spec, rank_and_size(group)[1], group=group)


def model_spec_of(training: TrainingState, engine: InferenceEngine | None = None) -> ModelSpec | None:
    """The resharding engine's spec of the training model, derived from the model itself, as the training
    state's capabilities say ([Note: training capabilities] in :mod:`hybridmem.contract.training`): its
    ``model_spec_dict()`` (``describes_model``: the Megatron and FSDP2 adapters), or the transformers config
    of a plain model (``has_hf_config``). ``None`` when the model says nothing, or its family is not one
    the resharding engine knows (the weights are then streamed as a checkpoint names them). A state that
    wants the engine's vocab (``vocab_from_engine``: a Megatron model built with a padded vocab whose
    unpadded size was not given) gets the engine's ``vocab_size``, since the engine holds the tokenizer's
    vocab; one that takes the engine's family (``family_from_engine``) gets the engine's ``model_type``
    (vLLM's), and its config must then have that family's tensors.

    Raises:
        ValueError: The training state's own ``model_spec_dict()`` cannot describe the model (a Megatron
            configuration the supported families cannot express); the message names the options.
    """
    capabilities = training_capabilities_of(training)
    if capabilities.describes_model:
        kwargs = {}
        served = capabilities_of(engine) if engine is not None else None
        engine_vocab = engine.vocab_size if served is not None and served.describes_weights else None
        if capabilities.vocab_from_engine and isinstance(engine_vocab, int):
            kwargs["vocab_size"] = engine_vocab
        engine_type = engine.model_type if served is not None and served.reports_model_type else None
        if capabilities.family_from_engine and isinstance(engine_type, str):
            kwargs["model_type"] = engine_type  # the family the engine serves names the weights it loads
        return ModelSpec.from_hf_config(training.model_spec_dict(**kwargs))
    config = training.hf_config if capabilities.has_hf_config else None
    if config is None:
        return None
    try:
        return ModelSpec.from_hf_config(config)
    except ValueError as exc:
        log.info("hybridmem: weights streamed by their checkpoint names, not resharded (%s)", exc)
        return None


class SyncRoute(Enum):
    """How the default weight sync moves the training weights into the engine."""

    TRAINING_NAMES = "the training model's own names, streamed (LoadWeightsSync of named_weights())"
    """The engine loads the training model's own names (``loads_training_names``: ``TorchCopyEngine``)."""
    RESHARD = "resharded from the training layout to the engine's vLLM layout (ReshardSync)"
    """A model spec is known (given, or derived by :func:`model_spec_of`)."""
    CHECKPOINT_NAMES = "a checkpoint's names, streamed (LoadWeightsSync of checkpoint_weights())"
    """The model's family is not one the resharding engine knows: what a checkpoint of the model holds
    (parameters and persistent buffers, never non-persistent ones such as RoPE's ``inv_freq``)."""


def default_weight_sync(training: Any, engine: InferenceEngine, config: Any, *, model_spec: Any = None,
                        group: Any = None) -> WeightSync:
    """The weight sync ShardingManager uses when none is given: the first :class:`SyncRoute` that applies.

    The two streamed routes need equal training and inference layouts, and neither takes FSDP2-sharded
    weights. :attr:`SyncRoute.RESHARD` reads its source layout from the training state
    (``hf_source_layout``, FSDP2), else from transformers' names held whole on every rank (train layout
    tp = pp = ep = 1), else ``config.train_layout`` in Megatron-core's names; its bucket size,
    verification, deadline and wire dtype come from the config and the weights (see [Note: no silent
    dtype change] in :mod:`hybridmem.weight_sync.base`).

    Args:
        training: The training state (``named_weights()``, and what its capabilities declare, see
            [Note: training capabilities] in :mod:`hybridmem.contract.training`).
        engine: The inference engine.
        config: The :class:`~hybridmem.config.HybridConfig`, its layouts resolved (see
            :func:`hybridmem.parts.resolve_layouts`).
        model_spec: A :class:`~hybridmem.reshard.ModelSpec` or an HF-style config (object or dict).
        group: The process group spanning both layouts (``None``: the default group).

    Raises:
        ValueError: A streamed route with different layouts or sharded weights, or into an engine that
            reports FP8 ([Note: fp8 sync] in :mod:`hybridmem.weight_sync.fp8`); a training state that
            reports a layout (``source_layout()``) other than ``config.train_layout``; HF-named weights with
            a ``config.train_layout`` other than tp = pp = ep = 1.
    """
    capabilities = training_capabilities_of(training)
    route, model_spec = _route(training, engine, model_spec)
    log.debug("hybridmem: weight sync: %s", route.value)
    if route is not SyncRoute.RESHARD and engine_block(engine) is not None:
        raise ValueError(
            f"{type(engine).__name__} serves FP8 with 128x128 blocks, which only the resharding sync makes "
            f"(quantized from the full tensors), but the weights would go as {route.value}, unquantized: "
            "pass model_spec= (the model's HF config) for a family with an FP8 layout"
        )
    if route is SyncRoute.TRAINING_NAMES:
        _require_equal_layouts(config, f"{type(engine).__name__} loads the training model's own names")
        # [Note: loaders write what they are given] in :mod:`hybridmem.weight_sync.streamed`: a copy of the
        # module copies what it is handed
        return LoadWeightsSync(training.named_weights, engine, copies=False)
    if route is SyncRoute.CHECKPOINT_NAMES:
        if capabilities.shards_weights:
            raise ValueError(
                f"{type(training).__name__} holds sharded weights, which must be resharded into the engine: "
                "pass model_spec= (a hybridmem.reshard.ModelSpec or the model's HF config) or weight_sync="
            )
        _require_equal_layouts(config, "the model's family is not one the resharding engine knows")
        return LoadWeightsSync(training.checkpoint_weights if capabilities.lists_checkpoint_weights
                               else training.named_weights, engine)
    if capabilities.reports_source_layout:
        _require_reported_layout(training.source_layout(), config)
    spec = model_spec if isinstance(model_spec, ModelSpec) else ModelSpec.from_hf_config(
        dict(model_spec) if isinstance(model_spec, Mapping) else model_spec
    )
    source = _source_layout(training, spec, group)
    return ReshardSync(
        spec, config.train_layout if source is None else source, config.infer_layout, group,
        training.named_weights, engine,
        bucket_nbytes=config.reshard_bucket_bytes, verify=config.verify_weight_sync,
        deadline_s=config.collective_deadline_s,
        megatron=training.megatron_convention() if capabilities.megatron_names else None,
    )


def _route(training: TrainingState, engine: InferenceEngine, model_spec: Any) -> tuple[SyncRoute, Any]:
    """The route, and the model spec it uses (derived from the model when not given)."""
    # A sharded HF-named source (FSDP2) cannot be streamed as is, even into an equal layout.
    if (model_spec is None and capabilities_of(engine).loads_training_names
            and not training_capabilities_of(training).shards_weights):
        return SyncRoute.TRAINING_NAMES, None
    if model_spec is None:
        model_spec = model_spec_of(training, engine)
    return (SyncRoute.CHECKPOINT_NAMES if model_spec is None else SyncRoute.RESHARD), model_spec


def _require_reported_layout(actual: Any, config: Any) -> None:
    got = tuple(getattr(actual, k) for k in ("tp", "pp", "ep"))
    want = (config.train_layout.tp, config.train_layout.pp, config.train_layout.ep)
    if got != want:
        raise ValueError(
            f"the training state runs at (tp, pp, ep)={got} but config.train_layout is "
            f"{config.train_layout}; set tensor_model_parallel_size / pipeline_model_parallel_size / "
            "expert_model_parallel_size to match"
        )


def _require_equal_layouts(config: Any, why: str) -> None:
    if config.train_layout != config.infer_layout:
        raise ValueError(
            f"train layout {config.train_layout} differs from infer layout {config.infer_layout}, so the "
            f"weights must be resharded, but {why}: pass model_spec= (a hybridmem.reshard.ModelSpec or the "
            "model's HF config) or weight_sync="
        )
