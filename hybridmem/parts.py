"""Turn what the user hands :class:`~hybridmem.ShardingManager` into its parts: the training state, and a
config whose layouts agree with the training state and the engine.

[Note: layouts from the parts]
The training and inference layouts are facts about the parts, not choices: a Megatron model runs at the
TP/PP/EP its ``parallel_state`` was initialised with, a vLLM engine at the ``tensor_parallel_size`` it was
built with. A part that knows its layout declares ``reports_layout`` in its capabilities and says so
through a ``parallel_layout`` attribute: a
:class:`~hybridmem.config.ParallelLayout`, a mapping of the fields it knows (``{"tp": 2, "pp": 1}``), or
``None`` when it cannot tell. An unset layout key of the
config (``None``, the default) takes the value the part reports, or 1 when it reports nothing; a key the
user set must equal what the part reports, else the manager is not built and the error names the key,
both values and the part. The manager keeps the resolved copy (``manager.config``); everything after it
(weight sync, memory plan, reports) reads the resolved layouts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridmem.adapters.torch import TorchTrainingState
from hybridmem.config import HybridConfig, ParallelLayout
from hybridmem.contract.engine import InferenceEngine, capabilities_of
from hybridmem.contract.training import TrainingState, training_capabilities_of
from hybridmem.errors import ConfigError

__all__ = ["training_state_of", "resolve_layouts", "TRAIN_LAYOUT_KEYS", "INFER_LAYOUT_KEYS"]

TRAIN_LAYOUT_KEYS = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                     "ep": "expert_model_parallel_size"}
"""Config keys of the training layout, by :class:`ParallelLayout` field."""
INFER_LAYOUT_KEYS = {"tp": "infer_tensor_parallel_size", "pp": "infer_pipeline_parallel_size",
                     "ep": "infer_expert_parallel_size"}
"""Config keys of the inference layout, by :class:`ParallelLayout` field."""


def training_state_of(model: Any, optimizer: Any) -> TrainingState:
    """The training state of what the user passed as ``model``: itself when it is one (the Megatron
    adapter), FSDP2's when ``fully_shard`` was applied to the module, else a plain PyTorch one.

    Raises:
        ValueError: ``optimizer`` given with a training state that carries its own.
        TypeError: ``model`` is neither a training state nor a module (or a list of modules).
    """
    if isinstance(model, TrainingState):
        if optimizer is not None:
            raise ValueError(f"optimizer= is for plain PyTorch models; {type(model).__name__} carries "
                             "its own")
        return model
    from hybridmem.adapters.fsdp import FSDPTrainingState, is_fsdp_model  # noqa: PLC0415 - torch.distributed.fsdp

    if is_fsdp_model(model):
        return FSDPTrainingState(model, optimizer)
    return TorchTrainingState(model, optimizer)


def _reported(part: Any, reports: bool) -> dict[str, int]:
    """The layout ``part`` runs at, when its capabilities say it reports one (``reports_layout``)."""
    layout = part.parallel_layout if reports else None
    if isinstance(layout, ParallelLayout):
        return {"tp": layout.tp, "pp": layout.pp, "ep": layout.ep}
    return ({k: int(v) for k, v in layout.items() if k in TRAIN_LAYOUT_KEYS} if isinstance(layout, Mapping)
            else {})


def resolve_layouts(config: HybridConfig, training: TrainingState,
                    engine: InferenceEngine | None) -> HybridConfig:
    """``config`` with every unset layout key taken from the part that knows it (see [Note: layouts from
    the parts]).

    Raises:
        ConfigError: A layout key set to another value than the part reports; names the key, both values
            and the part.
    """
    changes: dict[str, int] = {}
    sides = ((training, TRAIN_LAYOUT_KEYS, "the training state"), (engine, INFER_LAYOUT_KEYS, "the engine"))
    for part, keys, what in sides:
        if part is None:
            reports = False
        elif part is engine:
            reports = capabilities_of(engine).reports_layout
        else:
            reports = training_capabilities_of(part).reports_layout
        reported = _reported(part, reports)
        if part is engine and not reported and capabilities_of(engine).loads_training_names:
            # A copy of the training module (TorchCopyEngine) is laid out as training is.
            reported = {f: getattr(config, TRAIN_LAYOUT_KEYS[f]) or changes.get(TRAIN_LAYOUT_KEYS[f], 1)
                        for f in TRAIN_LAYOUT_KEYS}
        for field_name, key in keys.items():
            given = getattr(config, key)
            actual = reported.get(field_name)
            if given is None:
                changes[key] = 1 if actual is None else actual
            elif actual is not None and given != actual:
                raise ConfigError(
                    key, given,
                    f"{actual}, what {what} {type(part).__name__} runs at (or leave {key} unset to take it "
                    "from there)",
                )
    return config.replace(**changes) if changes else config
