"""What a LoRA model's switches hold and move on one device, for each place its base can stay
(``hybridmem plan --lora-rank R``).

[Note: lora plan]
With LoRA only the adapters train. Per device (tensor-parallel size 1), with ``B`` the base's bytes as the
trainer holds them, ``A`` the adapters' (and ``G`` their gradients, ``O`` AdamW's two moments and step per
adapter tensor), ``W`` the engine's weights (vLLM's layout, padding rows included), ``L`` the engine's LoRA
slot (the adapter in the engine's dtype) and ``K`` the KV cache:

============  ======================  ==================  ============================  ======================
route         device in TRAIN         device in INFER     host link per switch          written into engine
============  ======================  ==================  ============================  ======================
merged        B + A + G + O           W + K               2 (B + A + G + O)             W (the whole model)
sleeps        B + A + G + O           B + W + L + K       2 (A + G + O) (+ 2 W, lvl 1)  A (+ B again, level 2)
resident      B + A + G + O + W + L   B + W + L + K       2 (A + G + O)                 A
shared        W + A + G + O + L       W + L + K           2 (A + G + O)                 A
============  ======================  ==================  ============================  ======================

With ``resident`` and ``shared`` an engine that cannot free its KV cache without its weights (vLLM's sleep
mode: ``releases_kv_alone=False``, the default here) keeps ``K`` in TRAIN too ([Note: lora base] in
:mod:`hybridmem.switch.lora_base`). ``merged`` is the sync of merged weights (every tensor offloaded, the
whole model written); the others are :class:`~hybridmem.config.LoraBase`'s modes ([Note: lora base] in
:mod:`hybridmem.switch.lora_base`). The trainer's module buffers (RoPE's ``inv_freq``) are offloaded with the
adapters in every route. Adapter shapes come from the model's checkpoint tensors the targets name
(``[out, in]`` gives ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]``), as PEFT builds them;
tests/planner/test_lora_plan.py checks the counts against PEFT's model and the offloaded bytes against a run
of the manager.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from hybridmem.config import LoraBase, ParallelLayout
from hybridmem.reshard import ModelSpec, vllm_layout

__all__ = ["LoraSetup", "LoraRoutePlan", "adapter_shapes", "plan_lora"]

MERGED = "merged"
"""The route that streams merged weights (not a :class:`LoraBase` mode)."""


@dataclass(frozen=True, kw_only=True)
class LoraSetup:
    """The adapters: rank, target modules (suffixes of the checkpoint's linear layers) and dtype."""

    rank: int
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    adapter_bytes: int = 4
    """Bytes per adapter element in the trainer (PEFT keeps adapters in fp32 by default)."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank={self.rank!r} must be a positive int")
        if not self.targets:
            raise ValueError("LoRA targets=() names no module")


def adapter_shapes(spec: ModelSpec, lora: LoraSetup) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """``{checkpoint weight: (lora_A shape, lora_B shape)}`` for every 2-D weight whose module the
    targets name.

    Raises:
        ValueError: A target names no 2-D weight of the model.
    """
    out, hit = {}, set()
    for name, shape in spec.full_shapes().items():
        module, _, leaf = name.rpartition(".")
        target = next((t for t in lora.targets if module == t or module.endswith("." + t)), None)
        if leaf == "weight" and len(shape) == 2 and target is not None:
            out[name] = ((lora.rank, shape[1]), (shape[0], lora.rank))
            hit.add(target)
    missing = [t for t in lora.targets if t not in hit]
    if missing:
        raise ValueError(f"LoRA targets {missing} name no linear weight of model_type={spec.family!r}")
    return out


@dataclass(frozen=True)
class LoraRoutePlan:
    """One route's figures on one device (see [Note: lora plan])."""

    route: str
    train_nbytes: int
    """Device bytes in TRAIN (between switches)."""
    infer_nbytes: int
    """Device bytes in INFER, the KV cache included."""
    host_link_nbytes: int
    """Bytes over the host link per pair of switches (out and back)."""
    engine_write_nbytes: int
    """Bytes written into the engine per TRAIN->INFER switch."""
    kv_room_nbytes: int
    """Device bytes left for the KV cache in INFER (the device less everything else there)."""
    fits: bool
    """Both phases fit the device with the KV cache given."""


def plan_lora(spec: ModelSpec, lora: LoraSetup, *, param_bytes: int, infer_bytes: int, device_nbytes: int,
              kv_nbytes: int, sleep_level: int = 1, buffer_nbytes: int = 0,
              releases_kv_alone: bool = False) -> list[LoraRoutePlan]:
    """Every route's figures (see [Note: lora plan]): ``merged``, then each :class:`LoraBase` mode.

    Args:
        spec: The base model.
        lora: The adapters.
        param_bytes: Bytes per base element in the trainer.
        infer_bytes: Bytes per element in the engine.
        device_nbytes: The device's memory.
        kv_nbytes: The KV cache in INFER.
        sleep_level: The engine's sleep level with ``engine_sleeps`` (1: weights wait in host memory; 2:
            discarded, and the base is written again at every switch).
        buffer_nbytes: The trainer's module buffers, offloaded in every route.
        releases_kv_alone: The engine frees its KV cache without its weights (the embedded engine; ``False``:
            vLLM's sleep mode, whose KV cache then stays in TRAIN with a resident or shared base).
    """
    shapes = adapter_shapes(spec, lora)
    adapter_elements = sum(a[0] * a[1] + b[0] * b[1] for a, b in shapes.values())
    base = sum(math.prod(s) for s in spec.full_shapes().values()) * param_bytes
    a = adapter_elements * lora.adapter_bytes
    g = a
    o = 2 * a + 4 * 2 * len(shapes)  # AdamW: two moments per element, a 4-byte step per adapter tensor
    moved = a + g + o + buffer_nbytes
    w = sum(t.numel * spec.wire_itemsize(t.pieces[0].hf_name, infer_bytes) if t.pieces
            else t.numel * infer_bytes
            for t in vllm_layout(spec, ParallelLayout(), 1).tensors(0).values())
    slot = adapter_elements * infer_bytes
    level1 = sleep_level == 1
    kept_kv = 0 if releases_kv_alone else kv_nbytes
    rows = [
        (MERGED, base + moved, w + kv_nbytes, 2 * (base + moved), w),
        (LoraBase.ENGINE_SLEEPS.value, base + moved, base + w + slot + kv_nbytes,
         2 * moved + (2 * w if level1 else 0), a + (0 if level1 else base)),
        (LoraBase.ENGINE_RESIDENT.value, base + moved + w + slot + kept_kv, base + w + slot + kv_nbytes,
         2 * moved, a),
        (LoraBase.SHARED.value, w + moved + slot + kept_kv, w + slot + kv_nbytes, 2 * moved, a),
    ]
    return [LoraRoutePlan(route, train, infer, host, write, device_nbytes - (infer - kv_nbytes),
                          max(train, infer) <= device_nbytes)
            for route, train, infer, host, write in rows]


def to_dicts(plans: list[LoraRoutePlan]) -> list[dict]:
    """JSON-ready form."""
    return [asdict(p) for p in plans]
