"""The demo's rollout engines: the embedded ReferenceEngine, or a real vLLM (``--engine vllm``, or
``--engine vllm-server`` for an engine in its own process).

With ``vllm`` every rank runs its own co-located engine core (see [Note: vllm co-location] in
:mod:`hybridmem.adapters.vllm.inprocess.engine`): one in-process worker per rank when each rank is its own
inference replica (``--infer-tp 1``), or ``distributed_executor_backend="external_launcher"`` with
tensor parallelism across all ranks (``--infer-tp`` equal to the world size).

With ``vllm-server`` every rank starts an ``AsyncLLM`` whose engine core and worker run in a process of
their own on the rank's device, as verl's and OpenRLHF's rollout workers do, and drives it through
vLLM's RL API (:class:`~hybridmem.adapters.vllm.server.VLLMServerEngine`): the weight sync streams the
vLLM layout through the rank's two buckets in one versioned update (``--infer-tp 1``).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hybridmem.engines.nn.config import hf_config_dict
from hybridmem.reshard.spec import ModelSpec

__all__ = ["ENGINES", "VLLM_ENGINES", "VLLM_ENV", "VLLM_MODEL", "build_engine", "vllm_env"]

ENGINES = ("reference", "vllm", "vllm-server")
VLLM_ENGINES = ("vllm", "vllm-server")
"""The engines that are vLLM (its policy, :data:`VLLM_MODEL`, and its environment, :func:`vllm_env`)."""

VLLM_MODEL = ModelSpec(
    family="qwen2", hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
    intermediate_size=128, num_hidden_layers=2, vocab_size=16, qkv_bias=True, rms_norm_eps=1e-6,
    rope_theta=10000.0,
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


def vllm_env(rank: int, world_size: int, infer_tp: int, port: int, *,
             own_process: bool = False) -> dict[str, str]:
    """:data:`VLLM_ENV` plus one core per vLLM worker (``VLLM_CPU_OMP_THREADS_BIND``; vLLM's automatic
    binding fails on machines with fewer cores than it wants) and the torchrun variables
    ``external_launcher`` reads; ``own_process``: the engine core in a process of its own (an AsyncLLM),
    which needs vLLM's multiprocessing."""
    cores = os.cpu_count() or 1
    bind = "|".join(str(r % cores) for r in range(world_size)) if infer_tp > 1 else str(rank % cores)
    env = {**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": bind, "RANK": str(rank), "LOCAL_RANK": str(rank),
           "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    if own_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    return env


def build_engine(kind: str, model: ModelSpec, topo: Any, *, device: torch.device, dtype: torch.dtype,
                 max_len: int, max_seqs: int) -> Any:
    """The rollout engine, built released (as ShardingManager expects).

    Raises:
        ValueError: An unknown ``kind``, or vLLM with ``1 < infer tp < world size``.
    """
    from hybridmem.engines import ENGINE_TAGS, ReferenceEngine  # noqa: PLC0415

    if kind == "reference":
        block_size = 16
        engine = ReferenceEngine(hf_config_dict(model), group=topo.infer_tp_group, device=device, dtype=dtype,
                                 block_size=block_size, num_kv_blocks=max_seqs * -(-max_len // block_size))
        engine.release(list(ENGINE_TAGS))
        return engine
    if kind not in VLLM_ENGINES:
        raise ValueError(f"engine={kind!r}; expected one of {ENGINES}")
    if kind == "vllm-server":
        return _server_engine(model, topo, dtype=dtype, max_len=max_len, max_seqs=max_seqs)
    if topo.infer.tp not in (1, topo.world_size):
        raise ValueError(
            f"--engine vllm runs --infer-tp 1 (a replica per rank) or --infer-tp {topo.world_size} (the "
            f"world size, external_launcher); got --infer-tp {topo.infer.tp}"
        )
    import transformers  # noqa: PLC0415

    from hybridmem.adapters.vllm import VLLMEngine  # noqa: PLC0415

    hf = transformers.Qwen2Config(**{**hf_config_dict(model), "max_position_embeddings": max(128, max_len)})
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


def _server_engine(model: ModelSpec, topo: Any, *, dtype: torch.dtype, max_len: int, max_seqs: int) -> Any:
    """This rank's AsyncLLM, its engine core in a process of its own, built from the policy's config alone
    (``load_format="dummy"``: the first weight sync writes every weight).

    Raises:
        ValueError: ``--infer-tp`` other than 1 (one engine per rank).
    """
    if topo.infer.tp != 1:
        raise ValueError(f"--engine vllm-server runs one engine per process (--infer-tp 1); "
                         f"got --infer-tp {topo.infer.tp}")
    import tempfile  # noqa: PLC0415

    import transformers  # noqa: PLC0415

    from hybridmem.adapters.vllm.server import VLLMServerEngine  # noqa: PLC0415

    hf = transformers.Qwen2Config(**{**hf_config_dict(model), "max_position_embeddings": max(128, max_len)})
    model_dir = tempfile.mkdtemp(prefix=f"hybridmem-demo-rank{topo.rank}-")
    hf.save_pretrained(model_dir)  # config.json: what vLLM builds the model from
    return VLLMServerEngine.start_async(
        model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype],
        enforce_eager=True,
        max_model_len=max(128, max_len),
        max_num_seqs=max(max_seqs, 1),
        seed=0,
        disable_log_stats=True,
    )
