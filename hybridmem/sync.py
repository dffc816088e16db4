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

The default, :class:`LoadWeightsSync`, streams ``(name, tensor)`` pairs into the engine's
``load_weights``; it suits engines that hold the training layout (``TorchCopyEngine``) or load full
HF-named tensors. The resharding engine (:mod:`hybridmem.reshard`) provides a sync that writes each
rank's inference-layout shards straight into the engine's parameters; :func:`default_weight_sync`
picks between the two from the config's layouts and the model's spec.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridmem.engines.protocol import InferenceEngine

__all__ = ["SyncStats", "WeightSync", "LoadWeightsSync", "default_weight_sync", "engine_unwritten"]


@dataclass(frozen=True, slots=True)
class SyncStats:
    """What one weight sync did on this rank."""

    num_tensors: int = 0
    """Tensors written into the engine."""
    sent_nbytes: int = 0
    """Bytes this rank sent to other ranks."""
    received_nbytes: int = 0
    """Bytes this rank received from other ranks (or copied locally, for a single-process sync)."""
    min_received_nbytes: int = 0
    """The fewest bytes this rank could have received (what it did not already hold)."""
    temp_peak_nbytes: int = 0
    """Peak temporary device bytes."""
    seconds: float = 0.0
    unwritten: tuple[str, ...] = ()
    """Engine tensors of this rank not entirely written (see [Note: weight coverage])."""
    coverage_checked: bool = False
    """Whether ``unwritten`` is a proof (False: the engine cannot report what it received)."""


class WeightSync(ABC):
    """Writes training weights into the engine; the TRAIN->INFER weight-sync step calls it."""

    def temp_nbytes(self) -> int:
        """Peak temporary device bytes one :meth:`sync` needs (for the memory plan)."""
        return 0

    @abstractmethod
    def sync(self) -> SyncStats:
        """Write the weights; the engine's weight storage is resumed before this is called."""


class LoadWeightsSync(WeightSync):
    """Feeds ``weights()`` into ``engine.load_weights``.

    Args:
        weights: Returns the ``(name, tensor)`` pairs to load (called on every sync, so it sees the
            weights as training left them).
        engine: The engine.
    """

    def __init__(self, weights: Callable[[], Iterable[tuple[str, torch.Tensor]]], engine: InferenceEngine):
        self._weights = weights
        self.engine = engine

    def sync(self) -> SyncStats:
        start = time.perf_counter()
        count = 0
        nbytes = 0

        def counted() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal count, nbytes
            for name, tensor in self._weights():
                count += 1
                nbytes += tensor.numel() * tensor.element_size()
                yield name, tensor

        with torch.no_grad():
            self.engine.load_weights(counted())
        unwritten, checked = engine_unwritten(self.engine)
        return SyncStats(
            num_tensors=count,
            received_nbytes=nbytes,
            min_received_nbytes=nbytes,
            seconds=time.perf_counter() - start,
            unwritten=unwritten,
            coverage_checked=checked,
        )


def engine_unwritten(engine: Any) -> tuple[tuple[str, ...], bool]:
    """``(engine tensors not entirely written by load_weights, whether the engine could tell)``."""
    fn = getattr(engine, "unwritten_weights", None)
    if not callable(fn):
        return (), False
    return tuple(fn()), True


def _dominant_dtype(weights: Iterable[tuple[str, torch.Tensor]]) -> torch.dtype:
    """The dtype holding most bytes (see [Note: wire dtype] in hybridmem.reshard.execute); bf16 if none."""
    nbytes: dict[torch.dtype, int] = {}
    for _, t in weights:
        nbytes[t.dtype] = nbytes.get(t.dtype, 0) + t.numel() * t.element_size()
    return max(nbytes, key=nbytes.__getitem__) if nbytes else torch.bfloat16


def default_weight_sync(training: Any, engine: InferenceEngine, config: Any, *, model_spec: Any = None,
                        group: Any = None) -> WeightSync:
    """The weight sync ShardingManager uses when none is given.

    With a model spec, a :class:`~hybridmem.reshard.ReshardSync` from ``config.train_layout`` (the
    training weights in Megatron-core's names and layout) to ``config.infer_layout`` (the engine's vLLM
    layout) over ``group``, with ``config.reshard_bucket_bytes`` and ``config.verify_weight_sync``, in the
    element type holding most of the training weights' bytes. The spec is ``model_spec`` or, when that is ``None`` and the
    layouts differ, the training state's own ``model_spec_dict()`` (the Megatron adapter has one). The
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
        ValueError: The layouts differ and there is no model spec, or the training state reports a
            layout (``source_layout()``) other than ``config.train_layout``.
    """
    derive = getattr(training, "model_spec_dict", None)
    if model_spec is None and config.train_layout != config.infer_layout and callable(derive):
        model_spec = derive()
    if model_spec is None:
        if config.train_layout != config.infer_layout:
            raise ValueError(
                f"train layout {config.train_layout} differs from infer layout {config.infer_layout}, so the "
                f"weights must be resharded: pass model_spec= (a hybridmem.reshard.ModelSpec or the model's HF "
                f"config) or weight_sync="
            )
        return LoadWeightsSync(training.named_weights, engine)
    from hybridmem.reshard import ModelSpec, ReshardSync  # noqa: PLC0415 - reshard imports this module

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
    return ReshardSync(
        spec, config.train_layout, config.infer_layout, group, training.named_weights, engine,
        bucket_nbytes=config.reshard_bucket_bytes, verify=config.verify_weight_sync, dtype=dtype,
        megatron=convention_fn() if callable(convention_fn) else None,
    )
