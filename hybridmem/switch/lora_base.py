"""Where a LoRA model's base weights stay while only its adapters are synced.

[Note: lora base]
When the weight sync moves a LoRA model's adapters alone (:attr:`WeightSync.adapters_only
<hybridmem.weight_sync.base.WeightSync.adapters_only>`: :class:`~hybridmem.weight_sync.lora.LoraSync` on its
adapter route), the base weights are the same at every switch, on both sides. So:

- the trainer's frozen base is not offloaded: only the adapters, their gradients and their optimizer state
  move to the host (:attr:`ParamOffloader.include_frozen <hybridmem.offload.params.ParamOffloader>` off);
- where the engine's copy stays is :attr:`HybridConfig.lora_base <hybridmem.config.HybridConfig.lora_base>`
  (:class:`~hybridmem.config.LoraBase`): ``engine_sleeps`` releases and resumes the engine's weights as for
  any sync (its sleep level decides whether they wait in host memory or are discarded and sent again);
  ``engine_resident`` keeps them on the device through TRAIN (not released when the manager is built, and
  resumed then if the engine came asleep), so a switch moves the adapters and the KV cache only;
  ``shared`` keeps them so too and makes the trainer's base parameters views of them
  (:func:`~hybridmem.weight_sync.shared_base.share_base`), one copy on the device;
- the engine's KV cache is still released in TRAIN where the engine can free it alone
  (:attr:`EngineCapabilities.releases_kv_alone <hybridmem.contract.engine.EngineCapabilities>`: the embedded
  engine, vLLM without a sleep mode). vLLM's sleep mode cannot: a sleep unmaps its weights with its KV cache
  ([Note: vllm sleep granularity] in :mod:`hybridmem.adapters.vllm.inprocess.sleep`), which would discard
  the base kept there (and, shared, pull the memory from under the trainer's parameters), so with
  ``engine_resident`` and ``shared`` such an engine keeps its KV cache through TRAIN too, and the switch
  report says so;
- residency reports do not count what stays resident in TRAIN as a leftover.

With a sync that writes the whole model, ``lora_base`` is not read: the engine's weights are rewritten at
every switch and released on leaving INFER.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridmem.config import HybridConfig, LoraBase
from hybridmem.contract.engine import capabilities_of
from hybridmem.contract.kinds import KV_CACHE, WEIGHTS, StateKind
from hybridmem.contract.training import training_capabilities_of
from hybridmem.offload import Offloader, ParamOffloader
from hybridmem.weight_sync.base import WeightSync
from hybridmem.weight_sync.shared_base import SharedBase, share_base

__all__ = ["lora_base_of", "engine_tags_stay", "keep_frozen_on_device", "share_with_engine",
           "hold_engine_weights"]


def lora_base_of(weight_sync: WeightSync | None, config: HybridConfig) -> LoraBase | None:
    """The config's :class:`LoraBase` when ``weight_sync`` moves adapters only, else ``None``."""
    if weight_sync is None or not weight_sync.adapters_only:
        return None
    return LoraBase(config.lora_base)


def engine_tags_stay(lora_base: LoraBase | None, engine: Any) -> frozenset[str]:
    """The engine's tags that stay resident through TRAIN: none, unless the base stays in the engine
    (``engine_resident``, ``shared``): then its weights, and its KV cache too where it cannot free that
    alone."""
    if lora_base not in (LoraBase.ENGINE_RESIDENT, LoraBase.SHARED) or engine is None:
        return frozenset()
    return frozenset({WEIGHTS} if capabilities_of(engine).releases_kv_alone else {WEIGHTS, KV_CACHE})


def keep_frozen_on_device(offloaders: Mapping[StateKind, Offloader]) -> None:
    """Leave the parameters that do not train out of every parameter offloader."""
    for offloader in offloaders.values():
        if isinstance(offloader, ParamOffloader):
            offloader.include_frozen = False


def hold_engine_weights(engine: Any, tags: frozenset[str]) -> None:
    """Resume the engine's ``tags`` that stay (:func:`engine_tags_stay`) if it was handed over with them
    released."""
    if not tags or not capabilities_of(engine).reports_residency:
        return
    asleep = [tag for tag in (WEIGHTS, KV_CACHE) if tag in tags and not engine.resident_nbytes(tag)]
    if asleep:
        engine.resume(asleep)


def share_with_engine(training: Any, engine: Any, weight_sync: WeightSync) -> SharedBase:
    """``lora_base="shared"``: the trainer's frozen base as views of the engine's weights, then the sync told
    that the engine holds the base.

    Raises:
        ValueError: The training state is not one torch model, or :func:`share_base` refuses (named).
    """
    module = training.module if training_capabilities_of(training).holds_module else None
    if module is None:
        raise ValueError(f"lora_base='shared' needs one torch model (a PEFT LoRA model) as the training "
                         f"state, got {type(training).__name__}")
    shared = share_base(module, engine)
    weight_sync.engine_holds_base()
    return shared
