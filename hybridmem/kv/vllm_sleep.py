"""The ``vllm-sleep`` KV-cache allocator: vLLM's own KV pool, released and resumed through its sleep mode.

vLLM allocates and owns its KV cache (sized by ``gpu_memory_utilization`` or ``kv_cache_memory_bytes``
when the ``LLM`` is built, in ``CuMemAllocator``'s ``"kv_cache"`` pool, or ``CaMemAllocator``'s on
Ascend NPUs), so this allocator does not allocate anything: :meth:`allocate` records the pool's size,
:meth:`release` and :meth:`resume` go through a :class:`~hybridmem.adapters.vllm.VLLMEngine`, which
maps them onto ``LLM.sleep(level=...)`` and ``LLM.wake_up(tags=["kv_cache"])`` (see
[Note: vllm sleep granularity] in :mod:`hybridmem.adapters.vllm.inprocess.sleep`: vLLM cannot release the KV
pool alone, so releasing it also releases the weights, discarded or parked on host per the engine's
``kv_only_release``). Bytes released are measured with the accelerator's free-memory figure, not with
``memory_allocated`` (vLLM's pools are outside PyTorch's caching allocator).

Like the adapter, it has not been run against a real vLLM in this project's CI; vLLM is imported only
by the adapter, lazily.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from hybridmem.accel import Accelerator
from hybridmem.contract.kinds import KV_CACHE
from hybridmem.errors import KVStateError
from hybridmem.kv.base import KVCacheAllocator, KVState, register_kv_allocator

__all__ = ["VLLMSleepKVAllocator"]


def _config_value(llm: Any, path: str) -> Any:
    obj = llm
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@register_kv_allocator
class VLLMSleepKVAllocator(KVCacheAllocator):
    """vLLM's KV pool behind hybridmem's KV-allocator interface.

    Args:
        accel: The accelerator whose free-memory figure measures released bytes (``cuda`` or ``npu``).
        engine: The :class:`~hybridmem.adapters.vllm.VLLMEngine` wrapping the ``LLM`` (one tracker of
            vLLM's sleep state per LLM: pass the engine the manager uses).

    Raises:
        ValueError: ``accel`` is not a CUDA or NPU accelerator (vLLM's sleep mode needs one).
        TypeError: ``engine`` is not a VLLMEngine.
    """

    name: ClassVar[str] = "vllm-sleep"
    preserves_addresses: ClassVar[bool] = True
    """``CuMemAllocator``/``CaMemAllocator`` re-map a woken pool at the same virtual addresses."""
    backends: ClassVar[frozenset[str]] = frozenset({"cuda", "npu"})

    def __init__(self, accel: Accelerator, *, engine: Any):
        super().__init__(accel)
        for method in ("release", "resume", "resident_nbytes", "state"):
            if not callable(getattr(engine, method, None)):
                raise TypeError(
                    f"engine must be a VLLMEngine (it lacks {method}()), got {type(engine).__name__}"
                )
        self.engine = engine

    def allocate(
        self,
        *,
        block_nbytes: int,
        num_blocks: int | None = None,
        utilization: float | None = None,
        reserve_nbytes: int = 0,
    ) -> int:
        """Record vLLM's pool: vLLM sized it when the LLM was built; nothing is allocated here.

        Unlike the other allocators, ``num_blocks`` and ``utilization`` are optional checks, not sizes.

        Args:
            block_nbytes: Bytes of one KV block (all layers), as the caller computes it.
            num_blocks: If given, must equal vLLM's ``cache_config.num_gpu_blocks``.
            utilization: If given, must equal vLLM's ``cache_config.gpu_memory_utilization``.
            reserve_nbytes: Must be 0: vLLM's profiling already left its own headroom.

        Returns:
            vLLM's number of KV blocks.

        Raises:
            KVStateError: Already allocated.
            ValueError: A request that differs from what vLLM built (size vLLM's pool with
                ``num_gpu_blocks_override``, ``kv_cache_memory_bytes`` or ``gpu_memory_utilization``
                when building the LLM instead), or vLLM's block count is unknown.
        """
        if self.state is not KVState.EMPTY:
            raise KVStateError(
                "allocate", self.state, allocator=self.name, hint="allocate once, then release/resume"
            )
        if not isinstance(block_nbytes, int) or block_nbytes < 1:
            raise ValueError(f"block_nbytes={block_nbytes!r} must be a positive int")
        llm = self.engine.llm
        vllm_blocks = _config_value(llm, "llm_engine.vllm_config.cache_config.num_gpu_blocks")
        vllm_util = _config_value(llm, "llm_engine.vllm_config.cache_config.gpu_memory_utilization")
        if vllm_blocks is None:
            raise ValueError("vLLM's cache_config.num_gpu_blocks is unknown (LLM not initialised?)")
        if num_blocks is not None and num_blocks != vllm_blocks:
            raise ValueError(
                f"num_blocks={num_blocks} but vLLM built {vllm_blocks} KV blocks; vLLM sizes its own pool "
                f"(set num_gpu_blocks_override or kv_cache_memory_bytes when building the LLM)"
            )
        if utilization is not None and vllm_util is not None and abs(utilization - vllm_util) > 1e-9:
            raise ValueError(
                f"utilization={utilization} but the LLM was built with gpu_memory_utilization={vllm_util}"
            )
        if reserve_nbytes:
            raise ValueError(
                f"reserve_nbytes={reserve_nbytes} must be 0 for vllm-sleep: vLLM reserved its headroom itself"
            )
        self.num_blocks = int(vllm_blocks)
        self.block_nbytes = int(block_nbytes)
        resident = self.engine.state(KV_CACHE).value == "resident"
        self.state = KVState.ALLOCATED if resident else KVState.RELEASED
        return self.num_blocks

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Not available: vLLM owns its KV tensors (one per attention layer, in its attention backend's
        layout), and only vLLM's model runner reads and writes them.

        Raises:
            NotImplementedError: Always.
        """
        raise NotImplementedError(
            f"vllm-sleep cannot view its pool as {dtype}{tuple(shape)}: vLLM owns its KV tensors (one per "
            f"attention layer, in the attention backend's layout); use the 'torch' or 'cuda-vmm' allocator "
            f"for an engine that needs KV views"
        )

    # Backend steps --------------------------------------------------------------------------------
    def _allocate(self, nbytes: int) -> None:
        raise AssertionError("unreachable: vllm-sleep overrides allocate()")

    def _release(self) -> int:
        """``engine.release(["kv_cache"])``; the bytes freed by the free-memory figure (after - before).

        The figure includes the weights when the engine had to release them too (see the module
        docstring).
        """
        free_before = self.accel.memory_figures().free_nbytes
        self.engine.release([KV_CACHE])
        return max(0, self.accel.memory_figures().free_nbytes - free_before)

    def _resume(self) -> None:
        """``engine.resume(["kv_cache"])``, i.e. ``wake_up(tags=["kv_cache"])``; contents undefined."""
        self.engine.resume([KV_CACHE])

    def _view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        raise AssertionError("unreachable: vllm-sleep overrides view()")

    def _resident_nbytes(self) -> int:
        """vLLM's KV pool bytes now, as the engine measured them at its last wake-up."""
        return int(self.engine.resident_nbytes(KV_CACHE))

    def _close(self) -> None:
        """Forget the pool; vLLM keeps owning it (shut the LLM down to free it)."""
