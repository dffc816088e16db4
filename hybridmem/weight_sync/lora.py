"""LoRA weight sync: a PEFT LoRA model's adapters into vLLM's LoRA, the base kept by the engine
(:class:`LoraSync`), or the adapters merged into the base and the whole model streamed
(:func:`merged_lora_weights`, :attr:`LoraRoute.MERGED`).

[Note: lora sync]
With LoRA only the adapters train; the base weights the engine loaded stay valid as long as the engine
keeps them. :class:`LoraSync` therefore sends the base once (the first sync, and again only when the
engine reports that it discarded its weights, as a level-2 sleep does) and at every sync only the
adapters, which the engine installs as a new adapter version (``load_lora``, see [Note: vllm lora from
memory] in :mod:`hybridmem.adapters.vllm.inprocess.lora`); generation then runs with that version.
The bytes the sync reports (``SyncStats.received_nbytes``, the switch report's ``weight sync`` step, the
memory plan's transient copy) are the adapters' (plus the base's on a sync that sends it). Verification:
after the install the engine sums what each of its LoRA modules holds in the adapter's slot (``lora_a`` and
the scaled ``lora_b``, per packed part), and the sync compares them with the same sums of the trainer's
tensors; a PEFT adapter module that vLLM did not take, or whose sums differ, is reported as unwritten
([Note: weight coverage] in :mod:`hybridmem.weight_sync`), which fails the switch. What vLLM cannot serve
as LoRA (target modules it has no LoRA layer for, DoRA, ``modules_to_save``, LoRA bias, a rank above
``max_lora_rank``, several active adapters, vLLM at TP or PP above 1, whose ranks each hold a part
of every adapter slot, not checked yet) is found when the sync is built, and the sync then streams
merged weights instead, saying why in every report (``SyncStats.route``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping
from enum import Enum
from typing import Any

import torch

from hybridmem.contract.engine import InferenceEngine
from hybridmem.weight_sync.base import SyncStats, WeightSync, dtype_note
from hybridmem.weight_sync.streamed import LoadWeightsSync

__all__ = [
    "LoraRoute",
    "LoraSync",
    "adapter_config",
    "adapter_tensors",
    "lora_nbytes",
    "merged_lora_weights",
    "peft_base_weights",
]

log = logging.getLogger(__name__)

PEFT_PREFIX = "base_model.model."


class LoraRoute(Enum):
    """How a PEFT LoRA model's weights reach the engine."""

    ADAPTERS = "adapters"
    """Only the adapters, into vLLM's LoRA; the engine keeps its base (:class:`LoraSync`)."""
    MERGED = "merged"
    """The base plus each adapter's delta, the whole model streamed (:func:`merged_lora_weights`)."""


def _active_adapter(model: Any) -> str:
    active = getattr(model, "active_adapters", None) or [getattr(model, "active_adapter", "default")]
    if len(active) != 1:
        raise ValueError(f"the PEFT model has {len(active)} active adapters {list(active)}; the adapter sync "
                         "takes one")
    return active[0]


def adapter_config(model: Any, adapter: str | None = None) -> dict[str, Any]:
    """The PEFT adapter's configuration as its ``adapter_config.json`` holds it."""
    config = model.peft_config[adapter or _active_adapter(model)].to_dict()
    return json.loads(json.dumps(config,
                                 default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


def adapter_tensors(model: Any, adapter: str | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors as PEFT saves them (``get_peft_model_state_dict``: ``adapter_model.safetensors``
    names), not copied."""
    from peft import get_peft_model_state_dict  # noqa: PLC0415 - peft is optional

    state = get_peft_model_state_dict(model, adapter_name=adapter or _active_adapter(model))
    return {k: v.detach() for k, v in state.items()}


def lora_nbytes(model: Any) -> int:
    """Bytes of the PEFT model's ``lora_A``/``lora_B`` weights (every adapter)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if ".lora_A." in n or ".lora_B." in n)


def _lora_modules(model: Any) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer  # noqa: PLC0415 - peft is optional

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def _checkpoint_name(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer", "").replace("modules_to_save.default.", "")


def peft_base_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """A PEFT model's base weights as the base model's checkpoint names them, without the adapters (and
    without the original copies of ``modules_to_save``)."""
    prefix = getattr(model, "prefix", "lora_")
    for name, param in model.named_parameters():
        if prefix in name or "original_module" in name:
            continue
        yield _checkpoint_name(name), param.detach()


def merged_lora_weights(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """A PEFT model's weights as the base model's checkpoint names them, each LoRA layer's base weight
    plus its active adapters' delta (``get_delta_weight``), computed out of place.

    TRL's own iterator merges the adapters into the base weights and unmerges them after, which rounds the
    trained base weights a little on every sync; here nothing of the model is written, so a switch leaves
    the training state bit for bit as it was. Adapter tensors and the original copies of
    ``modules_to_save`` are not yielded (vLLM has no such weights).
    """
    layers = _lora_modules(model)
    with torch.no_grad():
        for name, tensor in peft_base_weights(model):
            owner, _, leaf = name.rpartition(".")
            layer = layers.get(PEFT_PREFIX + owner)
            if layer is not None and leaf == "weight":
                adapters = [a for a in layer.active_adapters if a in layer.lora_A]
                if adapters:
                    tensor = tensor + sum(layer.get_delta_weight(a) for a in adapters).to(tensor.dtype)
            yield name, tensor


class LoraSync(WeightSync):
    """The adapters of a PEFT LoRA model into the engine's LoRA, the base sent only when the engine lacks
    it (see [Note: lora sync]); merged weights where vLLM cannot serve the adapter.

    Args:
        model: The PEFT model (one active LoRA adapter).
        engine: An engine with LoRA (:class:`~hybridmem.adapters.vllm.VLLMEngine` of an ``LLM`` built
            with ``enable_lora=True``, ``max_lora_rank`` at least the adapter's rank, ``max_loras>=1``).
        send_base: Send the base weights on the first sync (``True``, default: the engine then serves the
            trainer's base whatever it loaded); ``False`` trusts that the engine loaded the same base
            (the checkpoint the trainer's model was loaded from). Either way the base is sent again when
            the engine discarded its weights.

    Raises:
        ValueError: The engine was built without LoRA.

    Attributes:
        route: :attr:`LoraRoute.ADAPTERS`, or :attr:`LoraRoute.MERGED` when vLLM cannot serve the adapter.
        merged_because: Why the sync streams merged weights (empty on the adapter route).
    """

    def __init__(self, model: Any, engine: InferenceEngine, *, send_base: bool = True):
        if not getattr(engine, "lora_enabled", False):
            raise ValueError(
                f"{type(engine).__name__} serves no LoRA adapters: build vLLM with enable_lora=True and "
                "max_lora_rank>=r, or sync merged weights "
                "(LoadWeightsSync(lambda: merged_lora_weights(model), engine))"
            )
        self.model = model
        self.engine = engine
        self._base_pending = bool(send_base)
        self.merged_because = self._refusals()
        self.route = LoraRoute.MERGED if self.merged_because else LoraRoute.ADAPTERS
        self._merged = (LoadWeightsSync(lambda: merged_lora_weights(model), engine) if self.merged_because
                        else None)
        if self.merged_because:
            log.warning("hybridmem: LoRA synced as merged weights: %s", self.merged_because)

    @property
    def adapters_only(self) -> bool:
        """On the adapter route the engine's base stays valid between switches ([Note: lora base] in
        :mod:`hybridmem.switch.lora_base`); merged weights rewrite the whole model."""
        return self.route is LoraRoute.ADAPTERS

    def engine_holds_base(self) -> None:
        """The engine's weights are the trainer's base (a shared base): the first sync sends none."""
        self._base_pending = False

    def _refusals(self) -> str:
        """Why vLLM cannot serve the model's adapter (empty when it can)."""
        try:
            adapter = _active_adapter(self.model)
        except ValueError as exc:
            return str(exc)
        reasons = list(self.engine.lora_refusals(adapter_config(self.model, adapter)))
        layout = getattr(self.engine, "parallel_layout", {}) or {}
        if layout.get("tp", 1) > 1 or layout.get("pp", 1) > 1:
            reasons.append(f"vLLM runs at tp={layout.get('tp', 1)} pp={layout.get('pp', 1)}: each rank's "
                           "LoRA slots hold a part of the adapter, which the adapter sync does not check yet "
                           "(TP 1 only)")
        served = set(self.engine.lora_info.modules)
        unserved = sorted({n.removeprefix(PEFT_PREFIX) for n, m in _lora_modules(self.model).items()
                           if adapter in m.lora_A} - served)
        if unserved:
            reasons.append(f"vLLM has no LoRA layer for {len(unserved)} target modules "
                           f"({', '.join(unserved[:4])}{', ...' if len(unserved) > 4 else ''})")
        return "; ".join(reasons)

    def temp_nbytes(self) -> int:
        """The copies handed to the engine: every adapter tensor at once (plus the largest base tensor on a
        sync that sends the base); the merged route's largest weight."""
        if self._merged is not None:
            return self._merged.temp_nbytes()
        adapters = sum(t.numel() * t.element_size() for t in adapter_tensors(self.model).values())
        if self._base_pending or self.engine.weights_discarded:
            adapters += max((t.numel() * t.element_size()
                             for _, t in peft_base_weights(self.model)), default=0)
        return adapters

    def sync(self) -> SyncStats:
        if self._merged is not None:
            if self.engine.lora_request is not None:  # an adapter over merged weights would apply it twice
                self.engine.drop_lora()
            s = self._merged.sync()
            route = f"LoRA merged into the base, whole model sent ({self.merged_because})"
            return SyncStats(num_tensors=s.num_tensors, received_nbytes=s.received_nbytes,
                             min_received_nbytes=s.min_received_nbytes, engine_nbytes=s.engine_nbytes,
                             seconds=s.seconds,
                             unwritten=s.unwritten,
                             coverage_checked=s.coverage_checked, dtype_note=s.dtype_note, route=route)
        start = time.perf_counter()
        count = nbytes = base_nbytes = 0
        dtypes: set[torch.dtype] = set()
        if self._base_pending or self.engine.weights_discarded:
            base = LoadWeightsSync(lambda: peft_base_weights(self.model), self.engine).sync()
            count, base_nbytes = base.num_tensors, base.received_nbytes
            self._base_pending = False
        adapter = _active_adapter(self.model)
        tensors = adapter_tensors(self.model, adapter)
        with torch.no_grad():
            installed = self.engine.load_lora(tensors, adapter_config(self.model, adapter))
        for t in tensors.values():
            count += 1
            nbytes += t.numel() * t.element_size()
            dtypes.add(t.dtype)
        unwritten = self._unchecked(tensors, installed, adapter)
        route = "LoRA adapters only (the engine keeps its base)" if not base_nbytes else \
            f"LoRA adapters and the base ({base_nbytes} bytes: the engine had none of the trainer's yet)"
        lora_dtype = getattr(torch, self.engine.lora_info.lora_dtype.removeprefix("torch."), None)
        return SyncStats(
            num_tensors=count, received_nbytes=nbytes + base_nbytes, min_received_nbytes=nbytes + base_nbytes,
            engine_nbytes=nbytes + base_nbytes,
            temp_peak_nbytes=nbytes, seconds=time.perf_counter() - start, unwritten=unwritten,
            coverage_checked=True,
            dtype_note=dtype_note(dtypes, {lora_dtype} if isinstance(lora_dtype, torch.dtype) else set()),
            route=route,
        )

    def _unchecked(self, tensors: Mapping[str, torch.Tensor],
                   installed: Any, adapter: str) -> tuple[str, ...]:
        """The adapter tensors whose slot sums in the engine differ from the trainer's (or that no LoRA module
        of the engine took), see [Note: lora sync]."""
        layers = _lora_modules(self.model)
        slices: dict[str, tuple[str, int]] = {}  # PEFT module (vLLM's unpacked name) -> (vLLM module, slice)
        for name in installed.slot_sums:
            for i, part in enumerate(installed.packed.get(name, (name,))):
                slices[part] = (name, i)
        same_dtype = self.engine.lora_info.lora_dtype in {str(t.dtype) for t in tensors.values()}
        tolerance = 1e-5 if same_dtype else 1e-2
        bad: list[str] = []
        for full, layer in layers.items():
            if adapter not in layer.lora_A:
                continue
            module = full.removeprefix(PEFT_PREFIX)
            names = [k for k in tensors if k.startswith(f"{full}.lora_")]
            where = slices.get(module)
            if where is None:
                bad.extend(names)
                continue
            got_a, got_b = installed.slot_sums[where[0]][where[1]]
            a = layer.lora_A[adapter].weight.detach().double()
            b = layer.lora_B[adapter].weight.detach().double() * float(layer.scaling[adapter])
            for got, want, which in ((got_a, a, "lora_A"), (got_b, b, "lora_B")):
                if abs(got - float(want.sum())) > tolerance * (float(want.abs().sum()) + 1e-12):
                    bad.extend(k for k in names if f".{which}." in k)
        return tuple(bad)
