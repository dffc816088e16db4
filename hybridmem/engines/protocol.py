"""The contract between hybridmem and an inference engine: see :mod:`hybridmem.engine_contract`.

It lives below every unit that talks to engines (the weight syncs, the resharding engine, the steps), so
the engines themselves may use the resharding engine's layouts.
"""

from __future__ import annotations

from hybridmem.engine_contract import (
    ENGINE_TAGS,
    KV_CACHE,
    WEIGHTS,
    EngineCapabilities,
    InferenceEngine,
    capabilities_of,
    check_kv_utilization,
)

__all__ = ["InferenceEngine", "EngineCapabilities", "capabilities_of", "WEIGHTS", "KV_CACHE", "ENGINE_TAGS",
           "check_kv_utilization"]
