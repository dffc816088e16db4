"""Weight sync: write the current training weights into the inference engine.

[Note: weight coverage]
An engine tensor the sync never writes keeps whatever its storage held when it was resumed (uninitialised
memory), and generation silently produces garbage. Every sync therefore proves that it wrote every byte
of every engine tensor of its rank and reports the ones it did not in ``SyncStats.unwritten``; the
weight-sync step then fails the switch (``WeightCoverageError``), which rolls back. Padding rows (vocab
padding) count as written: the sync zeroes them. The proof comes from the party that sees the writes:
:class:`LoadWeightsSync` asks the engine (``unwritten_weights()``, which ``TorchCopyEngine`` and
``ReferenceEngine`` keep per name and row range since the weights were resumed); the resharding sync,
writing in place, counts the elements each engine tensor received against its plan and lists every
engine tensor the plan does not fill. An engine without ``unwritten_weights()`` that is written through
``load_weights`` (vLLM in another process) cannot be checked; ``SyncStats.coverage_checked`` says so.

The default, :class:`~hybridmem.weight_sync.LoadWeightsSync`, streams ``(name, tensor)`` pairs into the
engine's ``load_weights``; it suits engines that hold the training layout (``TorchCopyEngine``) or load
full HF-named tensors. The resharding engine (:mod:`hybridmem.reshard`) provides a sync that writes each
rank's inference-layout shards straight into the engine's parameters; :func:`default_weight_sync`
picks between the two from the config's layouts and the model's spec. The interface types live in
:mod:`hybridmem.weight_sync` (below :mod:`hybridmem.reshard`) and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hybridmem.engines.protocol import InferenceEngine
from hybridmem.reshard import ModelSpec, ReshardSync
from hybridmem.weight_sync import LoadWeightsSync, SyncStats, WeightSync, engine_unwritten

__all__ = ["SyncStats", "WeightSync", "LoadWeightsSync", "default_weight_sync", "engine_unwritten"]


def _dominant_dtype(weights: Iterable[tuple[str, torch.Tensor]]) -> torch.dtype:
    """The dtype holding most bytes (see [Note: wire dtype] in hybridmem.reshard.execute); bf16 if none."""
    nbytes: dict[torch.dtype, int] = {}
    for _, t in weights:
        nbytes[t.dtype] = nbytes.get(t.dtype, 0) + t.numel() * t.element_size()
    return max(nbytes, key=nbytes.__getitem__) if nbytes else torch.bfloat16


def _source_layout(training: Any, spec: Any, config: Any, group: Any) -> Any:
    """The HF-named source layout of ``training`` (see :func:`default_weight_sync`), or ``None`` for a
    Megatron-named one."""
    from hybridmem.reshard.hf_source import hf_source_layout, looks_hf_named  # noqa: PLC0415

    own = getattr(training, "hf_source_layout", None)
    if not callable(own) and not looks_hf_named(name for name, _ in training.named_weights()):
        return None
    train = config.train_layout
    if (train.tp, train.pp, train.ep) != (1, 1, 1):
        raise ValueError(
            f"the training weights have transformers' names (unsharded by tensor/pipeline/expert parallelism) "
            f"but config.train_layout is {train}; set its tp, pp and ep to 1"
        )
    import torch.distributed as dist  # noqa: PLC0415

    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    return own(spec, world, group=group) if callable(own) else hf_source_layout(spec, world)


def default_weight_sync(training: Any, engine: InferenceEngine, config: Any, *, model_spec: Any = None,
                        group: Any = None) -> WeightSync:
    """The weight sync ShardingManager uses when none is given.

    With a model spec, a :class:`~hybridmem.reshard.ReshardSync` from the training weights' layout to
    ``config.infer_layout`` (the engine's vLLM layout). The source layout is the training state's own
    ``hf_source_layout(spec, world_size, group=group)`` when it has one (the FSDP2 adapter); else, for weights with
    transformers' names (a plain HF model, one process or DDP), every rank holding them whole
    (:func:`~hybridmem.reshard.hf_source.hf_source_layout`; ``config.train_layout`` must then be
    tp = pp = ep = 1); else ``config.train_layout`` in Megatron-core's names and layout. It runs over
    ``group``, with ``config.reshard_bucket_bytes`` and ``config.verify_weight_sync``, in the
    element type holding most of the training weights' bytes. The spec is ``model_spec`` or, when that is
    ``None`` and the layouts differ (or the training state says ``needs_reshard``, as FSDP2's does), the
    training state's own ``model_spec_dict()`` (the Megatron and FSDP2 adapters have one). The
    Megatron naming and vocab padding come from the training state's ``megatron_convention()`` when it
    has one, else Megatron's defaults (vocab padded to a multiple of ``128 * tp``). For other conventions
    build the ``ReshardSync`` yourself and pass it as ``weight_sync=``. Without a spec, a
    :class:`LoadWeightsSync` of the training weights as they are, which is only right when the two
    layouts are equal.

    Args:
        training: The training state (``named_weights()``; optionally ``model_spec_dict()``,
            ``source_layout()``, ``megatron_convention()``).
        engine: The inference engine.
        config: The :class:`~hybridmem.config.HybridConfig`.
        model_spec: A :class:`~hybridmem.reshard.ModelSpec` or an HF-style config (object or dict).
        group: The process group spanning both layouts (``None``: the default group).

    Raises:
        ValueError: The layouts differ (or the weights are FSDP2-sharded) and there is no model spec, the
            training state reports a layout (``source_layout()``) other than ``config.train_layout``, or
            HF-named weights come with a ``config.train_layout`` other than tp = pp = ep = 1.
    """
    derive = getattr(training, "model_spec_dict", None)
    # A sharded HF-named source (FSDP2) cannot be streamed as is, even into an equal layout.
    sharded = bool(getattr(training, "needs_reshard", False))
    if model_spec is None and (config.train_layout != config.infer_layout or sharded) and callable(derive):
        model_spec = derive()
    if model_spec is None and sharded:
        raise ValueError(
            f"{type(training).__name__} holds sharded weights, which must be resharded into the engine: pass "
            f"model_spec= (a hybridmem.reshard.ModelSpec or the model's HF config) or weight_sync="
        )
    if model_spec is None:
        if config.train_layout != config.infer_layout:
            raise ValueError(
                f"train layout {config.train_layout} differs from infer layout {config.infer_layout}, so the "
                f"weights must be resharded: pass model_spec= (a hybridmem.reshard.ModelSpec or the model's HF "
                f"config) or weight_sync="
            )
        return LoadWeightsSync(training.named_weights, engine)
    layout_fn = getattr(training, "source_layout", None)
    if callable(layout_fn):
        actual = layout_fn()
        got = tuple(getattr(actual, k) for k in ("tp", "pp", "ep"))
        want = (config.train_layout.tp, config.train_layout.pp, config.train_layout.ep)
        if got != want:
            raise ValueError(
                f"the training state runs at (tp, pp, ep)={got} but config.train_layout is {config.train_layout}; "
                f"set tensor_model_parallel_size / pipeline_model_parallel_size / expert_model_parallel_size to match"
            )

    spec = model_spec if isinstance(model_spec, ModelSpec) else ModelSpec.from_hf_config(
        dict(model_spec) if isinstance(model_spec, Mapping) else model_spec
    )
    convention_fn = getattr(training, "megatron_convention", None)
    dtype = _dominant_dtype(training.named_weights())
    source = _source_layout(training, spec, config, group)
    return ReshardSync(
        spec, config.train_layout if source is None else source, config.infer_layout, group,
        training.named_weights, engine,
        bucket_nbytes=config.reshard_bucket_bytes, verify=config.verify_weight_sync, dtype=dtype,
        megatron=convention_fn() if callable(convention_fn) else None,
    )
