"""Functions that run inside a vLLM worker (through ``LLM.collective_rpc`` / ``LLM.apply_model``).

They are module-level so that they pickle; the adapter only calls them on workers in its own process
(see [Note: vllm co-location] in :mod:`hybridmem.adapters.vllm.inprocess.engine`), where nothing is pickled.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["WorkerInfo", "persistent_buffers", "buffer_only_classes", "probe_worker", "load_bucket",
           "identity", "reprocess_weights", "worker_model", "unwrapped_name"]


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What a worker reports about itself when the adapter attaches."""

    rank: int
    """The worker's rank in vLLM's world (0 without one)."""
    has_reload_weights: bool
    """Whether the worker offers ``reload_weights(weights_iterator=...)`` (vLLM >= 0.32)."""
    params: tuple[tuple[str, tuple[int, ...]], ...]
    """``(name, shape)`` of every parameter of the worker's model, in model order."""
    device_type: str | None = None
    """The worker's device type (``"cpu"`` on vLLM's CPU backend)."""
    buffers: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """``(name, shape)`` of every persistent buffer of the worker's model (in its state dict), in model order:
    those a layout names are weights its loader fills (Gemma 4's ``layer_scalar``); the others are vLLM's own
    (an attention layer's quantization scales)."""
    buffer_only_modules: tuple[str, ...] = ()
    """Classes every module of which holds buffers only, all non-persistent (a rotary embedding's
    ``cos_sin_cache``): nothing a checkpoint or a weight sync holds (see [Note: vllm buffer-only reload
    warning] in :mod:`hybridmem.adapters.vllm.inprocess.logs`)."""

    @property
    def fused_experts(self) -> tuple[str, ...]:
        """The fused-MoE expert weights (``...experts...w13_weight`` / ``w2_weight``)."""
        return tuple(n for n, _ in self.params
                     if ".experts." in n and n.rsplit(".", 1)[-1] in ("w13_weight", "w2_weight"))

    @property
    def repacked(self) -> tuple[str, ...]:
        """Parameters the backend keeps in its kernels' own format, whose shape says nothing: on vLLM's
        CPU backend linear weights (left with shape ``[0]``) and fused-MoE expert weights (prepacked)."""
        experts = set(self.fused_experts) if self.device_type == "cpu" else set()
        return tuple(n for n, shape in self.params if 0 in shape or n in experts)


def worker_model(worker: Any) -> torch.nn.Module:
    """The worker's ``nn.Module`` (unwrapping a CUDA-graph wrapper)."""
    runner = getattr(worker, "model_runner", None)
    if runner is None:  # a worker without a model runner keeps the model itself
        return worker.model
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    return getattr(model, "runnable", model)


def persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of the persistent buffers of ``model`` (those its state dict holds), each once."""
    for name, buffer in model.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf not in model.get_submodule(owner)._non_persistent_buffers_set:
            yield name, buffer


def buffer_only_classes(model: torch.nn.Module) -> tuple[str, ...]:
    """Class names each module of which, in ``model``, has buffers and no parameters of its own, every
    buffer non-persistent (so outside the state dict); modules with no tensors of their own count for
    neither side."""
    verdict: dict[str, bool] = {}
    for module in model.modules():
        has_params = any(p is not None for p in module._parameters.values())
        buffers = [name for name, b in module._buffers.items() if b is not None]
        if not has_params and not buffers:
            continue
        only = not has_params and all(name in module._non_persistent_buffers_set for name in buffers)
        cls = type(module).__name__
        verdict[cls] = verdict.get(cls, True) and only
    return tuple(sorted(cls for cls, only in verdict.items() if only))


def unwrapped_name(name: str) -> str:
    """A parameter's name without vLLM's LoRA wrappers (``qkv_proj.base_layer.weight`` ->
    ``qkv_proj.weight``): with ``enable_lora`` vLLM wraps each LoRA-served linear layer and keeps the layer
    as ``base_layer``, and its loaders take the unwrapped names (its ``reload_weights`` maps them the same
    way)."""
    return name.replace(".base_layer.", ".")


def probe_worker(worker: Any) -> WorkerInfo:
    """Run in the worker through ``collective_rpc``: its rank, its reload method, its parameters (by the
    names its loaders take, see :func:`unwrapped_name`)."""
    model = worker_model(worker)
    return WorkerInfo(
        rank=int(getattr(worker, "rank", 0) or 0),
        has_reload_weights=callable(getattr(worker, "reload_weights", None)),
        params=tuple((unwrapped_name(n), tuple(p.shape)) for n, p in model.named_parameters()),
        buffers=tuple((unwrapped_name(n), tuple(b.shape)) for n, b in persistent_buffers(model)),
        device_type=getattr(getattr(worker, "device", None), "type", None),
        buffer_only_modules=buffer_only_classes(model),
    )


def load_bucket(model: torch.nn.Module, *, bucket: list[tuple[str, torch.Tensor]]) -> Any:
    """Run in the worker through ``LLM.apply_model``: the model's own ``load_weights`` (workers without
    ``reload_weights``)."""
    return model.load_weights(bucket)


def identity(model: torch.nn.Module) -> torch.nn.Module:
    """Run in the worker through ``LLM.apply_model``: the model itself (in-process workers only)."""
    return model


def reprocess_weights(worker: Any) -> None:
    """Run in the worker through ``LLM.collective_rpc``: vLLM's post-load processing again, so that
    what it derives from the weights at load time follows an in-place update (MLA backends build
    ``W_UK_T``/``W_UV`` from ``kv_b_proj`` there). ``reload_weights`` runs it itself.
    """
    from vllm.model_executor.model_loader.utils import process_weights_after_loading  # noqa: PLC0415

    runner = worker.model_runner
    process_weights_after_loading(worker_model(worker), runner.model_config, worker.device)
