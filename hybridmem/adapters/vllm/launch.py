"""How :meth:`VLLMEngine.create` starts vLLM in the calling process: which executor, and what it sets meanwhile.

[Note: vllm launch]
The adapter needs vLLM's engine core and worker in the calling process (see [Note: vllm co-location] in
:mod:`hybridmem.adapters.vllm.engine`). ``VLLMEngine.create(..., distributed_executor_backend="auto")``,
the default, picks the executor from how the program was started:

- **torchrun, or a process group already initialised** (``RANK``/``WORLD_SIZE`` in the environment, or
  ``torch.distributed.is_initialized()``): ``"external_launcher"``, one vLLM worker inside each rank,
  tensor parallel across the ranks, when ``tensor_parallel_size`` equals the world size; ``None`` (one
  in-process worker per rank, each rank its own replica) when it is 1. Other sizes are refused with a
  line naming both numbers. vLLM's ``external_launcher`` reads ``RANK`` and ``LOCAL_RANK``; where the
  group was initialised without them (``init_process_group(init_method="tcp://...")``) they are set from
  the group for the duration of the build.
- **a plain process** (``python train.py``): ``None``, vLLM's single in-process worker (TP 1; a larger
  ``tensor_parallel_size`` is refused, naming the torchrun command that runs it).

An in-process worker needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` while the ``LLM`` is built (vLLM reads it
once, when it creates its engine-core client; ``external_launcher`` sets it itself). ``create`` sets what
it needs for the build only and puts every variable it set back afterwards. Building an ``LLM`` also
re-seeds Python's, NumPy's and torch's global generators (vLLM's ``seed``); ``create`` saves them before
and restores them after, so creating an engine does not change what the training code draws next.
What vLLM itself leaves in the environment (``LD_PRELOAD``, ``VLLM_WORKER_MULTIPROC_METHOD`` and a few
private variables) and the ``torch.distributed`` group its worker initialises stay as vLLM left them.

[Note: vllm cpu kv default]
On vLLM's CPU backend ``gpu_memory_utilization`` is a share of the whole NUMA node's memory, and without
``kv_cache_memory_bytes`` (or ``VLLM_CPU_KVCACHE_SPACE``) vLLM gives the KV cache all of that share the
model does not use: gigabytes of host RAM, which a co-located trainer and its offloaded state live in too.
``create`` therefore passes ``kv_cache_memory_bytes`` on the CPU backend unless the caller set one of
those (:func:`cpu_kv_cache_nbytes`): room for ``max_num_seqs`` sequences of ``max_model_len`` tokens, but
at most :data:`CPU_KV_TOKENS` tokens unless one ``max_model_len`` sequence needs more, in whole blocks,
at 2 x layers x KV heads x head dim x element size per token (MLA models: their latent width), and at
most ``gpu_memory_utilization`` of the memory free now. The token cap is what keeps the default in
proportion to the model: vLLM's defaults (``max_num_seqs`` 256, ``max_model_len`` from the config, 32768
for a Qwen2 config) would otherwise ask 8 GiB for a model of a few MiB. vLLM's scheduler admits a
sequence while KV blocks are free and queues the rest, so a cache smaller than every sequence at full
length still runs them all; vLLM needs room for one full-length sequence, which the cap always leaves.
``create`` logs the size it chose.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = ["AUTO", "Launch", "plan_launch", "launching", "cpu_kv_cache_nbytes", "cpu_kv_default", "DEFAULT_MAX_NUM_SEQS",
           "CPU_KV_TOKENS"]

DEFAULT_MAX_NUM_SEQS = 256
"""vLLM's default ``max_num_seqs`` for offline ``LLM`` use, assumed when the caller gives none."""

CPU_KV_TOKENS = 65_536
"""The most tokens the CPU default KV cache holds unless one ``max_model_len`` sequence needs more (see
[Note: vllm cpu kv default]): 64 MiB for docs/vllm.md's two-layer float32 model, about 3.5 GiB for
Qwen2.5-7B in bfloat16."""

DEFAULT_CPU_BLOCK_SIZE = 128
"""vLLM's KV block size on its CPU backend (0.32) when the caller gives no ``block_size``."""

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")

AUTO = "auto"
"""``distributed_executor_backend`` value that lets :func:`plan_launch` choose (see [Note: vllm launch])."""

OUT_OF_PROCESS_BACKENDS = ("mp", "ray")
"""Executors whose workers run in other processes: the adapter cannot pass tensors to them."""

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE")


@dataclass(frozen=True, slots=True)
class Launch:
    """How to build the ``LLM``."""

    backend: str | None
    """``distributed_executor_backend`` to pass (``None``: vLLM's single in-process worker)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables to set while the ``LLM`` is built (restored afterwards)."""
    why: str = ""
    """How the choice was made, for logs and errors."""


def _world() -> tuple[int, int, str] | None:
    """``(world size, rank, where from)`` of the process group this process belongs to, if any."""
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank(), "the initialised torch.distributed group"
    if all(v in os.environ for v in _TORCHRUN_VARS):
        return int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), "torchrun (RANK/WORLD_SIZE)"
    return None


def plan_launch(requested: str | None, tensor_parallel_size: int) -> Launch:
    """The executor and environment for building an in-process ``LLM`` (see [Note: vllm launch]).

    Args:
        requested: ``distributed_executor_backend`` as the caller gave it (:data:`AUTO` to choose).
        tensor_parallel_size: vLLM's TP size.

    Raises:
        ValueError: An executor whose workers run in other processes, or a TP size the launch cannot run;
            the message names the value and what would run it.
    """
    if requested in OUT_OF_PROCESS_BACKENDS:
        raise ValueError(
            f"distributed_executor_backend={requested!r} runs vLLM's workers in other processes, where the adapter "
            f"cannot hand them weight tensors; use 'auto' (default), 'external_launcher' or None"
        )
    world = _world()
    if requested == AUTO:
        if world is None:
            if tensor_parallel_size != 1:
                raise ValueError(
                    f"tensor_parallel_size={tensor_parallel_size} needs one process per TP rank, and this is a "
                    f"plain process: start the program with `torchrun --nproc-per-node {tensor_parallel_size} ...` "
                    f"(in a plain process VLLMEngine.create runs one in-process vLLM worker, TP 1)"
                )
            requested, why = None, "a plain process: one in-process vLLM worker"
        else:
            size, _, source = world
            if tensor_parallel_size == 1:
                requested, why = None, f"{source}: one in-process vLLM worker per rank (a replica each)"
            elif tensor_parallel_size == size:
                requested, why = "external_launcher", f"{source}: one vLLM worker per rank, TP across all {size}"
            else:
                raise ValueError(
                    f"tensor_parallel_size={tensor_parallel_size} with {source} of world size {size}: "
                    f"VLLMEngine.create runs TP 1 (a replica per rank) or TP {size} (across every rank); pass "
                    f"distributed_executor_backend='external_launcher' with vLLM's data_parallel_size for others"
                )
    else:
        why = f"distributed_executor_backend={requested!r} as given"
    env: dict[str, str] = {}
    if requested is None:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    elif requested == "external_launcher" and world is not None and "RANK" not in os.environ:
        _, rank, _ = world
        local = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else rank
        env.update(RANK=str(rank), LOCAL_RANK=str(os.environ.get("LOCAL_RANK", local)))
    return Launch(requested, env, why)


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.random.get_rng_state()}
    try:
        import numpy  # noqa: PLC0415

        states["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _restore_rng(states: Mapping[str, Any]) -> None:
    random.setstate(states["python"])
    torch.random.set_rng_state(states["torch"])
    if "numpy" in states:
        import numpy  # noqa: PLC0415

        numpy.random.set_state(states["numpy"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


@contextlib.contextmanager
def launching(launch: Launch) -> Iterator[None]:
    """Set ``launch.env`` and save the global random generators for the body; restore both after, also
    on an exception (see [Note: vllm launch])."""
    saved_env = {k: os.environ.get(k) for k in launch.env}
    rng = _rng_states()
    os.environ.update(launch.env)
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _restore_rng(rng)


_DTYPE_NBYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def _element_nbytes(dtype: Any) -> int:
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    return _DTYPE_NBYTES.get(str(dtype).removeprefix("torch."), 4)  # "auto" or unknown: the widest vLLM uses


def cpu_kv_cache_nbytes(hf_config: Any, llm_kwargs: Mapping[str, Any], *, utilization: float, free_nbytes: int) -> int:
    """The KV-cache bytes ``create`` asks vLLM's CPU backend for (see [Note: vllm cpu kv default]).

    Args:
        hf_config: The model's transformers config.
        llm_kwargs: The ``vllm.LLM`` arguments (``max_model_len``, ``max_num_seqs``, ``block_size``,
            ``dtype``, ``kv_cache_dtype``).
        utilization: ``gpu_memory_utilization``: the most of ``free_nbytes`` the cache may take.
        free_nbytes: Host memory free now.
    """
    text = hf_config.get_text_config() if callable(getattr(hf_config, "get_text_config", None)) else hf_config
    get = lambda key, default=None: getattr(text, key, None) or default  # noqa: E731
    heads = int(get("num_attention_heads", 1))
    if get("kv_lora_rank"):  # MLA caches one latent vector (plus the RoPE part) per token and layer
        per_layer = int(get("kv_lora_rank")) + int(get("qk_rope_head_dim", 0))
    else:
        head_dim = int(get("head_dim", int(get("hidden_size", heads)) // heads))
        per_layer = 2 * int(get("num_key_value_heads", heads)) * head_dim
    kv_dtype = llm_kwargs.get("kv_cache_dtype", "auto")
    itemsize = _element_nbytes(llm_kwargs.get("dtype", "auto") if kv_dtype in (None, "auto") else kv_dtype)
    seq_len = int(llm_kwargs.get("max_model_len") or next((get(k) for k in _CONTEXT_KEYS if get(k)), 4096))
    num_seqs = int(llm_kwargs.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS)
    tokens = min(seq_len * num_seqs, max(seq_len, CPU_KV_TOKENS))
    block = int(llm_kwargs.get("block_size") or DEFAULT_CPU_BLOCK_SIZE)
    tokens = -(-tokens // block) * block
    needed = tokens * int(get("num_hidden_layers", 1)) * per_layer * itemsize
    return max(1, min(needed, int(free_nbytes * utilization)))


def _hf_config(model_path_or_config: Any) -> Any:
    """The transformers config of a model directory (or the config itself); ``None`` where none can be read."""
    if hasattr(model_path_or_config, "save_pretrained"):
        return model_path_or_config
    try:
        import transformers  # noqa: PLC0415 - a dependency of vLLM

        return transformers.AutoConfig.from_pretrained(str(model_path_or_config))
    except (OSError, ValueError, ImportError) as exc:  # a hub name offline, an unknown architecture
        log.info("hybridmem vLLM adapter: no config read from %r (%s); vLLM sizes the KV cache", model_path_or_config, exc)
        return None


def cpu_kv_default(model_path_or_config: Any, llm_kwargs: Mapping[str, Any], utilization: float) -> dict[str, Any]:
    """``{"kv_cache_memory_bytes": ...}`` for an ``LLM`` on vLLM's CPU backend, or ``{}`` when the caller
    chose (``kv_cache_memory_bytes``, ``VLLM_CPU_KVCACHE_SPACE``) or the model's config cannot be read (see
    [Note: vllm cpu kv default])."""
    if "kv_cache_memory_bytes" in llm_kwargs or "VLLM_CPU_KVCACHE_SPACE" in os.environ:
        return {}
    hf_config = _hf_config(model_path_or_config)
    if hf_config is None:
        return {}
    from hybridmem.accel import get_accelerator  # noqa: PLC0415

    free = get_accelerator("cpu").memory_figures().free_nbytes
    nbytes = cpu_kv_cache_nbytes(hf_config, llm_kwargs, utilization=utilization, free_nbytes=free)
    log.info("hybridmem vLLM adapter: KV cache on vLLM's CPU backend: %.1f MiB (at most %d tokens, or one "
             "max_model_len sequence; pass kv_cache_memory_bytes or set VLLM_CPU_KVCACHE_SPACE to choose)",
             nbytes / 2**20, CPU_KV_TOKENS)
    return {"kv_cache_memory_bytes": nbytes}
