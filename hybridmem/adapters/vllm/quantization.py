"""What quantization a vLLM engine serves, read from its model's config: FP8 with 128x128 blocks, or nothing
(both the in-process and the own-process adapter take their answer from here).

[Note: vllm quantization]
hybridmem syncs into vLLM engines serving the training dtype and ones serving block FP8 as the Hub's FP8
checkpoints have it (the config's ``quantization_config``: ``quant_method="fp8"``,
``weight_block_size=[128, 128]``, dynamic activations; read with
:func:`~hybridmem.reshard.fp8.block_from_hf_config`): an adapter then declares ``reports_quantization`` and
hands its ``quantization_config`` on, and the resharding sync quantizes ([Note: fp8 sync] in
:mod:`hybridmem.weight_sync.fp8`). Any other quantization is refused by name where the adapter is built,
before a sync could write weights vLLM would read as something else: another method or block, FP8 per
tensor, and vLLM asked to quantize an unquantized checkpoint when it loads it (``quantization="fp8"``
without a ``quantization_config``: vLLM makes per-tensor scales at load time, which a sync of the training
weights does not give).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridmem.reshard.fp8 import block_from_hf_config

__all__ = ["served_fp8_block", "quantization_config_of"]


def quantization_config_of(hf_config: Any) -> dict[str, Any] | None:
    """The model config's ``quantization_config`` as a dict (``None``: unquantized)."""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return None
    return dict(quant) if isinstance(quant, Mapping) else dict(quant.to_dict())


def served_fp8_block(hf_config: Any, where: str, quantization: Any = None) -> tuple[int, int] | None:
    """The FP8 block a vLLM engine serves its model in (``(128, 128)``; ``None``: unquantized), from the
    model's config and, where known, vLLM's own ``model_config.quantization`` (see [Note: vllm quantization]).

    Raises:
        ValueError: Another quantization, named with the engine (``where``).
    """
    try:
        block = block_from_hf_config(hf_config)
    except ValueError as exc:
        raise ValueError(f"the model the vLLM engine {where} serves has {exc}") from None
    if block is None and quantization:
        raise ValueError(f"the vLLM engine {where} was built with quantization={quantization!r} for a model "
                         "whose config has no quantization_config: vLLM quantizes such a checkpoint when it "
                         "loads it (per-tensor scales), which a sync of the training weights does not give; "
                         "serve an FP8 checkpoint with 128x128 blocks (its config's quantization_config), or "
                         "the unquantized model")
    return block
