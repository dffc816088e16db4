"""vLLM in its own process (``vllm serve``, or an AsyncLLM), driven through vLLM's RL API.

The trainer side: :mod:`.engine` (the InferenceEngine), :mod:`.client` (HTTP and AsyncLLM control planes),
:mod:`.contact` (what ``connect`` checks about a server first),
:mod:`.process` (starting and stopping ``vllm serve``), :mod:`.ranks` (the trainer ranks serving one
engine), :mod:`.update` (the update call beside the stream). The transport, both sides: :mod:`.buckets`
(the two reused buffers a rank's weights travel through), :mod:`.channel` (the socket saying what they
hold), :mod:`.packing` (a stream of tensors into buckets). The worker side, imported by vLLM in its own
processes: :mod:`.transfer`, on :mod:`.receive` (the stream's receiving end, which imports no vLLM).
Importing this package does not import vLLM.
"""

from __future__ import annotations

from hybridmem.adapters.vllm.server.engine import UPDATE_MIN_BPS, InFlight, VLLMServerEngine

__all__ = ["VLLMServerEngine", "InFlight", "UPDATE_MIN_BPS"]
