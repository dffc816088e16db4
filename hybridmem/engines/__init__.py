"""Inference engines hybridmem ships, and the contract's names (from :mod:`hybridmem.contract.engine`)."""

from __future__ import annotations

from hybridmem.contract.engine import InferenceEngine, check_kv_utilization
from hybridmem.contract.kinds import ENGINE_TAGS, KV_CACHE, WEIGHTS
from hybridmem.engines.reference import (
    GenerationOutput,
    ReferenceEngine,
    SamplingParams,
)
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
