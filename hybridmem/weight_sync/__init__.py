"""Weight sync: write the current training weights into the inference engine.

- :class:`WeightSync` (the interface the TRAIN->INFER weight-sync step calls) and :class:`SyncStats` (what
  one sync did), in :mod:`~hybridmem.weight_sync.base`;
- :class:`LoadWeightsSync`: ``(name, tensor)`` pairs streamed into the engine's ``load_weights``; it suits
  engines that hold the training layout (``TorchCopyEngine``) or load full HF-named tensors;
- :class:`ReshardSync`: each rank's inference-layout shards written straight into the engine's parameters,
  or streamed to it as complete tensors of its own layout, or as its pipeline stage's full HF tensors
  (:class:`ReshardRoute`), through the resharding engine (:mod:`hybridmem.reshard`, below this package);
- :func:`default_weight_sync`: picks between the two from the config's layouts and the model's spec;
- :class:`LoraSync`: a PEFT LoRA model's adapters into vLLM's LoRA, the base kept by the engine (or
  :func:`merged_lora_weights` streamed where vLLM cannot serve the adapter), see [Note: lora sync] in
  :mod:`hybridmem.weight_sync.lora`.

[Note: weight coverage]
An engine tensor the sync never writes keeps whatever its storage held when it was resumed (uninitialised
memory), and generation silently produces garbage. Every sync therefore proves that it wrote every byte
of every engine tensor of its rank and reports the ones it did not in ``SyncStats.unwritten``; the
weight-sync step then fails the switch (``WeightCoverageError``), which rolls back. Padding rows (vocab
padding) count as written: the sync zeroes them. The proof comes from the party that sees the writes:
:class:`LoadWeightsSync` asks the engine (``unwritten_weights()``, which ``TorchCopyEngine`` and
``ReferenceEngine`` keep per name and row range since the weights were resumed); the resharding sync,
writing in place, counts the elements each engine tensor received against its plan and lists every
engine tensor the plan does not fill; streaming, it asks the engine as :class:`LoadWeightsSync` does. An
engine without ``unwritten_weights()`` that is written through a stream (``load_weights``,
``load_layout_weights``) cannot be checked; ``SyncStats.coverage_checked`` says so.
"""

from __future__ import annotations

from hybridmem.weight_sync.base import (
    SyncStats,
    WeightSync,
    dominant_dtype,
    dtype_note,
    engine_dtypes,
    engine_unwritten,
)
from hybridmem.weight_sync.choice import default_weight_sync, model_spec_of
from hybridmem.weight_sync.lora import LoraRoute, LoraSync, merged_lora_weights
from hybridmem.weight_sync.resharding import ReshardRoute, ReshardSync
from hybridmem.weight_sync.streamed import LoadWeightsSync

__all__ = [
    "SyncStats",
    "WeightSync",
    "LoadWeightsSync",
    "ReshardSync",
    "ReshardRoute",
    "LoraSync",
    "LoraRoute",
    "merged_lora_weights",
    "default_weight_sync",
    "model_spec_of",
    "engine_unwritten",
    "engine_dtypes",
    "dominant_dtype",
    "dtype_note",
]
