"""Inference engines hybridmem ships, and the contract's names (defined in :mod:`hybridmem.engine_contract`)."""

from __future__ import annotations

from hybridmem.engine_contract import ENGINE_TAGS, KV_CACHE, WEIGHTS, InferenceEngine, check_kv_utilization
from hybridmem.engines.reference import GenerationOutput, ReferenceEngine, SamplingParams
from hybridmem.engines.torch_copy import EngineMemoryState, TorchCopyEngine

__all__ = [
    "InferenceEngine",
    "ReferenceEngine",
    "SamplingParams",
    "GenerationOutput",
    "TorchCopyEngine",
    "EngineMemoryState",
    "WEIGHTS",
    "KV_CACHE",
    "ENGINE_TAGS",
    "check_kv_utilization",
]
