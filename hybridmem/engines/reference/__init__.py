"""The embedded reference inference engine (Llama/Qwen2, tensor parallel, paged KV cache).

Modules, one job each: :mod:`.spec` (architecture and TP sizes), :mod:`.layout` (vLLM's per-rank
weight layout and HF->shard placement), :mod:`.blocks` (KV block tables), :mod:`.model` (forward),
:mod:`.sampling` (SamplingParams, sampling), :mod:`.engine` (ReferenceEngine).
"""

from __future__ import annotations

from hybridmem.contract.generation import GenerationOutput, SamplingParams
from hybridmem.engines.reference.blocks import BlockManager, KVBlocksExhaustedError
from hybridmem.engines.reference.engine import DEFAULT_NUM_KV_BLOCKS, ReferenceEngine
from hybridmem.engines.reference.layout import param_shapes, place_hf_weight
from hybridmem.engines.reference.spec import TPShard, pad_vocab, tp_shard

__all__ = [
    "ReferenceEngine",
    "SamplingParams",
    "GenerationOutput",
    "tp_shard",
    "TPShard",
    "pad_vocab",
    "param_shapes",
    "place_hf_weight",
    "BlockManager",
    "KVBlocksExhaustedError",
    "DEFAULT_NUM_KV_BLOCKS",
]
