"""One copy of a LoRA model's frozen base: the trainer's base parameters as views of the engine's weights.

[Note: shared base]
With LoRA the base weights never change, so the trainer and the engine can hold one copy of them on the
device. :func:`share_base` replaces each of the training model's frozen base parameters by a view of the
engine tensor that holds it (at tensor-parallel size 1, vLLM's layout keeps every HF tensor whole: a row block
of the fused ``qkv_proj`` / ``gate_up_proj``, the first vocabulary rows of the padded embedding and head, a
tensor of its own otherwise), after checking that the engine holds exactly the trainer's values; the trainer's
own copy is then freed. It is refused, naming the tensor, wherever that does not hold: an engine that does not
offer its tensors for writing in place (the vLLM CPU backend repacks linear weights after loading), tensor
parallelism, a base tensor the layout splits, transposes or permutes, another dtype or device, a trainable
base tensor.

From then on the engine's weights must stay where they are, and the trainer must not move them: the manager
leaves the shared tensors out of the parameter offload
(:func:`~hybridmem.offload.engine_owned.is_engine_owned`, read by
:class:`~hybridmem.offload.params.ParamOffloader`) and never releases the engine's weights
(:attr:`SharedBase.engine_weights_stay`), so a switch moves the adapters and the KV cache only; the LoRA sync
sends no base (:class:`~hybridmem.weight_sync.lora.LoraSync` with ``send_base=False``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridmem.config import ParallelLayout
from hybridmem.contract.engine import InferenceEngine, capabilities_of
from hybridmem.offload.engine_owned import is_engine_owned, mark_engine_owned
from hybridmem.reshard import ModelSpec, vllm_layout
from hybridmem.reshard.transforms import piece_view

__all__ = ["SharedBase", "share_base", "is_engine_owned"]

PEFT_PREFIX = "base_model.model."

@dataclass(frozen=True)
class SharedBase:
    """What :func:`share_base` shared."""

    names: tuple[str, ...]
    """The base tensors, by the base model's checkpoint names, now views of the engine's weights."""
    nbytes: int
    """Device bytes the trainer no longer holds (its copy of those tensors)."""
    engine_weights_stay: bool = True
    """The engine's weights must stay resident and in place: the manager releases its KV cache only."""


def _checkpoint_name(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer", "")


def _base_model(model: Any) -> torch.nn.Module:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(inner, "config", None) is None:
        raise ValueError(f"{type(inner).__name__} has no HF config: share_base needs a transformers model "
                         f"(or a PEFT model of one)")
    return inner


def _engine_tensors(engine: InferenceEngine) -> dict[str, torch.Tensor]:
    if not capabilities_of(engine).writes_in_place:
        raise ValueError(f"{type(engine).__name__} does not offer its weights in place "
                         f"(capabilities.writes_in_place is False): the trainer cannot hold views of them")
    try:
        return dict(engine.named_parameters())
    except RuntimeError as exc:
        raise ValueError(f"{type(engine).__name__} cannot share its weights with the trainer: {exc}") from exc


def share_base(model: torch.nn.Module, engine: InferenceEngine) -> SharedBase:
    """Make every frozen base parameter of ``model`` a view of the engine's copy (see [Note: shared base]).

    Args:
        model: A PEFT LoRA model (or a transformers model whose base parameters are frozen): every parameter
            that is not a LoRA adapter must have ``requires_grad=False``.
        engine: An engine at tensor-parallel size 1 that offers its vLLM-layout tensors in place
            (``capabilities.writes_in_place``: :class:`~hybridmem.adapters.vllm.VLLMEngine` on GPUs, the
            embedded :class:`~hybridmem.engines.reference.ReferenceEngine`), holding the trainer's base
            values.

    Returns:
        What was shared; the trainer's copy of those tensors is freed once nothing else refers to it.

    Raises:
        ValueError: Naming the first reason the base cannot be shared: the engine's, a parallel engine, a
            trainable base tensor, a tensor the layout does not keep whole in one engine tensor, a shape,
            dtype or device that differs, or values that differ (sync the base into the engine first).
    """
    config = _base_model(model).config
    tp = int((engine.parallel_layout or {}).get("tp", 1)) if capabilities_of(engine).reports_layout else 1
    if tp != 1:
        raise ValueError(f"the engine runs at tensor-parallel size {tp}: a shared base needs tp=1 (each rank "
                         f"of a parallel engine holds part of a tensor the trainer holds whole)")
    engine_tensors = _engine_tensors(engine)
    spec = ModelSpec.from_hf_config(config)
    where = {}
    for vllm_name, local in vllm_layout(spec, ParallelLayout(), 1).tensors(0).items():
        for piece in local.pieces:
            where.setdefault(piece.hf_name, []).append((vllm_name, piece))
    full = spec.full_shapes()
    holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    params: dict[int, tuple[str, torch.nn.Parameter]] = {}
    prefix = getattr(model, "prefix", "lora_")
    for module_name, module in model.named_modules(remove_duplicate=False):
        for leaf, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{leaf}" if module_name else leaf
            if prefix in name:
                continue
            holders.setdefault(id(param), []).append((module, leaf))
            params.setdefault(id(param), (_checkpoint_name(name), param))
    views: dict[int, torch.Tensor] = {}
    for key, (name, param) in params.items():
        if param.requires_grad:
            raise ValueError(f"{name} is trainable (requires_grad=True): only a frozen base can be shared "
                             f"with the engine")
        pieces = where.get(name, [])
        if len(pieces) != 1 or pieces[0][1].src != tuple((0, s) for s in full.get(name, ())):
            raise ValueError(f"{name}: the engine's layout does not keep it whole in one tensor "
                             f"({[n for n, _ in pieces] or 'no engine tensor'}), so it cannot be a view")
        vllm_name, piece = pieces[0]
        if piece.transposed or vllm_name not in engine_tensors:
            raise ValueError(f"{name}: the engine holds it {'transposed' if piece.transposed else 'nowhere'} "
                             f"({vllm_name}), so it cannot be a view")
        view = piece_view(engine_tensors[vllm_name], piece)
        if view.shape != param.shape or view.dtype != param.dtype or view.device != param.device:
            raise ValueError(f"{name}: the engine's {vllm_name} holds it as {tuple(view.shape)} {view.dtype} "
                             f"on {view.device}, the trainer as {tuple(param.shape)} {param.dtype} on "
                             f"{param.device}")
        if not torch.equal(view, param.detach()):
            raise ValueError(f"{name}: the engine's {vllm_name} holds other values than the trainer's: sync "
                             f"the base into the engine (or load the engine from the same checkpoint) before "
                             f"sharing it")
        views[key] = view
    nbytes = 0
    names = []
    for key, view in views.items():
        name, param = params[key]
        shared = torch.nn.Parameter(view, requires_grad=False)
        for module, leaf in holders[key]:
            module._parameters[leaf] = shared
        mark_engine_owned(shared)
        nbytes += param.numel() * param.element_size()
        names.append(name)
    return SharedBase(names=tuple(names), nbytes=nbytes)
