"""KV-cache allocators: a pool of KV blocks that INFER takes and TRAIN gives back.

>>> from hybridmem.kv import get_kv_allocator
>>> kv = get_kv_allocator("torch", "cpu")
>>> kv.allocate(block_nbytes=1024, num_blocks=4)
4
>>> cache = kv.view(torch.float16, (4, 512))
>>> kv.release()
4096
>>> kv.resume(); cache.shape
torch.Size([4, 512])

``torch`` (:mod:`hybridmem.kv.torch_pool`) works on every backend; ``cuda-vmm`` (:mod:`hybridmem.kv.vmm`)
keeps addresses fixed so CUDA graphs survive, and imports ``cuda.bindings`` only when it allocates.
``vllm-sleep`` (:mod:`hybridmem.kv.vllm_sleep`) delegates to a ``VLLMEngine``; it never imports vLLM.
See [Note: KV views stay valid] in :mod:`hybridmem.kv.base`.
"""

from __future__ import annotations

import torch  # noqa: F401  (used by the doctest above)

from hybridmem.kv.base import (
    KV_ALLOCATORS,
    KVCacheAllocator,
    KVState,
    blocks_for_utilization,
    get_kv_allocator,
    register_kv_allocator,
)
from hybridmem.kv.torch_pool import TorchKVAllocator
from hybridmem.kv.vllm_sleep import VLLMSleepKVAllocator
from hybridmem.kv.vmm import CudaVmmKVAllocator

__all__ = [
    "KVState",
    "KVCacheAllocator",
    "KV_ALLOCATORS",
    "register_kv_allocator",
    "get_kv_allocator",
    "blocks_for_utilization",
    "TorchKVAllocator",
    "CudaVmmKVAllocator",
    "VLLMSleepKVAllocator",
]
