"""The demo's rollout engines: the embedded ReferenceEngine, or a real vLLM (``--engine vllm``).

With vLLM every rank runs its own co-located engine core (see [Note: vllm co-location] in
:mod:`hybridmem.adapters.vllm.engine`): one in-process worker per rank when each rank is its own
inference replica (``--infer-tp 1``), or ``distributed_executor_backend="external_launcher"`` with
tensor parallelism across all ranks (``--infer-tp`` equal to the world size).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hybridmem.nn.config import DecoderConfig

__all__ = ["ENGINES", "VLLM_ENV", "VLLM_MODEL", "build_engine", "vllm_env"]

ENGINES = ("reference", "vllm")

VLLM_MODEL = DecoderConfig(
    hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32, intermediate_size=128,
    num_hidden_layers=2, vocab_size=16, attention_bias=True, rms_norm_eps=1e-6, rope_theta=10000.0,
)
"""The demo's policy for ``--engine vllm``: vLLM's CPU attention needs head_dim >= 32."""

VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the rank's own process
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per CPU worker
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOGGING_LEVEL": "ERROR",  # keep the demo's table readable
}
"""Environment the demo's worker processes run vLLM with (values already set are kept)."""


def vllm_env(rank: int, world_size: int, infer_tp: int, port: int) -> dict[str, str]:
    """:data:`VLLM_ENV` plus one core per vLLM worker (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's automatic
    binding fails on machines with fewer cores than it wants) and the torchrun variables
    ``external_launcher`` reads."""
    cores = os.cpu_count() or 1
    bind = "|".join(str(r % cores) for r in range(world_size)) if infer_tp > 1 else str(rank % cores)
    return {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": bind, "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def build_engine(kind: str, model: DecoderConfig, topo: Any, *, device: torch.device, dtype: torch.dtype,
                 max_len: int, max_seqs: int) -> Any:
    """The rollout engine, built released (as ShardingManager expects).

    Raises:
        ValueError: An unknown ``kind``, or vLLM with ``1 < infer tp < world size``.
    """
    from hybridmem.engines import ENGINE_TAGS, ReferenceEngine  # noqa: PLC0415

    if kind == "reference":
        block_size = 16
        engine = ReferenceEngine(model.to_hf_dict(), group=topo.infer_tp_group, device=device, dtype=dtype,
                                 block_size=block_size, num_kv_blocks=max_seqs * -(-max_len // block_size))
        engine.release(list(ENGINE_TAGS))
        return engine
    if kind != "vllm":
        raise ValueError(f"engine={kind!r}; expected one of {ENGINES}")
    if topo.infer.tp not in (1, topo.world_size):
        raise ValueError(
            f"--engine vllm runs --infer-tp 1 (a replica per rank) or --infer-tp {topo.world_size} (the world "
            f"size, external_launcher); got --infer-tp {topo.infer.tp}"
        )
    import transformers  # noqa: PLC0415

    from hybridmem.adapters.vllm import VLLMEngine  # noqa: PLC0415

    hf = transformers.Qwen2Config(**{**model.to_hf_dict(), "max_position_embeddings": max(128, max_len)})
    return VLLMEngine.create(
        hf,
        tensor_parallel_size=topo.infer.tp,
        distributed_executor_backend="external_launcher" if topo.infer.tp > 1 else None,
        dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype],
        enforce_eager=True,
        max_model_len=max(128, max_len),
        max_num_seqs=max(max_seqs, 1),
        seed=0,
    )
