"""vLLM in its own process (``vllm serve``, or an AsyncLLM), driven through vLLM's RL API.

The trainer side: :mod:`.engine` (the InferenceEngine), :mod:`.client` (HTTP and AsyncLLM control planes),
:mod:`.process` (starting and stopping ``vllm serve``), :mod:`.ranks` (the trainer ranks serving one
engine) and :mod:`.staging` (the shared-memory files the weights travel through). The worker side,
imported by vLLM in its own processes: :mod:`.transfer`. Importing this package does not import vLLM.
"""

from __future__ import annotations

from hybridmem.adapters.vllm.server.engine import UPDATE_MIN_BPS, InFlight, VLLMServerEngine

__all__ = ["VLLMServerEngine", "InFlight", "UPDATE_MIN_BPS"]
