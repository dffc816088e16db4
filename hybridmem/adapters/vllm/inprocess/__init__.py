"""vLLM in the trainer's own processes: a ``vllm.LLM`` whose engine core and worker run in the caller.

:mod:`.engine` is the facade (:class:`VLLMEngine`); each job is a module beside it: :mod:`.launch`
(building the ``LLM``), :mod:`.state` (the engine's one state record), :mod:`.sleep` (release and resume
by tag through vLLM's sleep mode), :mod:`.weights` (loads, in-place writes, the name check), :mod:`.lora`
(adapter versions, and what runs in the worker for them), :mod:`.generation` and :mod:`.logs` (vLLM log
records silenced during a reload). Importing this package does not import vLLM.
"""

from __future__ import annotations

from hybridmem.adapters.vllm.inprocess.engine import VLLMEngine
from hybridmem.adapters.vllm.inprocess.sleep import KVOnlyRelease
from hybridmem.adapters.vllm.inprocess.state import EngineState, TagState, WeightsContent
from hybridmem.adapters.vllm.inprocess.weights import LoadStats, bucket_weights

__all__ = ["VLLMEngine", "TagState", "WeightsContent", "EngineState", "KVOnlyRelease", "LoadStats",
           "bucket_weights"]
