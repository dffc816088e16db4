"""The KV cache vLLM's CPU backend gets when the caller sizes none.

[Note: vllm cpu kv default]
On vLLM's CPU backend ``gpu_memory_utilization`` is a share of the whole NUMA node's memory, and without
``kv_cache_memory_bytes`` (or ``VLLM_CPU_KVCACHE_SPACE``) vLLM gives the KV cache all of that share the
model does not use: gigabytes of host RAM, which a co-located trainer and its offloaded state live in too.
``VLLMEngine.create`` therefore passes ``kv_cache_memory_bytes`` on the CPU backend (and
``VLLMServerEngine.launch`` the server's ``--kv-cache-memory-bytes``) unless the caller set one of those
(:func:`cpu_kv_cache_nbytes`): room for ``max_num_seqs`` sequences of ``max_model_len`` tokens, but at most
:data:`CPU_KV_TOKENS` tokens unless one ``max_model_len`` sequence needs more, in whole blocks, at 2 x
layers x KV heads x head dim x element size per token (MLA models: their latent width), and at most
``gpu_memory_utilization`` of the memory free now. The token cap is what keeps the default in
proportion to the model: vLLM's defaults (``max_num_seqs`` 256, ``max_model_len`` from the config, 32768
for a Qwen2 config) would otherwise ask 8 GiB for a model of a few MiB. vLLM's scheduler admits a
sequence while KV blocks are free and queues the rest, so a cache smaller than every sequence at full
length still runs them all; vLLM needs room for one full-length sequence, which the cap always leaves.
``create`` logs the size it chose.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = ["cpu_kv_cache_nbytes", "cpu_kv_default", "DEFAULT_MAX_NUM_SEQS", "CPU_KV_TOKENS"]

DEFAULT_MAX_NUM_SEQS = 256
"""vLLM's default ``max_num_seqs`` for offline ``LLM`` use, assumed when the caller gives none."""

CPU_KV_TOKENS = 65_536
"""The most tokens the CPU default KV cache holds unless one ``max_model_len`` sequence needs more (see
[Note: vllm cpu kv default]): 64 MiB for docs/vllm.md's two-layer float32 model, about 3.5 GiB for
Qwen2.5-7B in bfloat16."""

DEFAULT_CPU_BLOCK_SIZE = 128
"""vLLM's KV block size on its CPU backend (0.32) when the caller gives no ``block_size``."""

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length")

_DTYPE_NBYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def _element_nbytes(dtype: Any) -> int:
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    return _DTYPE_NBYTES.get(str(dtype).removeprefix("torch."), 4)  # "auto" or unknown: the widest vLLM uses


def cpu_kv_cache_nbytes(hf_config: Any, llm_kwargs: Mapping[str, Any], *, utilization: float,
                        free_nbytes: int) -> int:
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
    """The transformers config of a model directory (or the config itself); ``None`` where none is read."""
    if hasattr(model_path_or_config, "save_pretrained"):
        return model_path_or_config
    try:
        import transformers  # noqa: PLC0415 - a dependency of vLLM

        return transformers.AutoConfig.from_pretrained(str(model_path_or_config))
    except (OSError, ValueError, ImportError) as exc:  # a hub name offline, an unknown architecture
        log.info("hybridmem vLLM adapter: no config read from %r (%s); vLLM sizes the KV cache",
                 model_path_or_config, exc)
        return None


def cpu_kv_default(model_path_or_config: Any, llm_kwargs: Mapping[str, Any],
                   utilization: float) -> dict[str, Any]:
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
