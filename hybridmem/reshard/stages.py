"""How many consecutive decoder layers each pipeline stage holds, as Megatron-core and vLLM split them.

[Note: uneven stages]
A pipeline stage holds a run of consecutive layers; how many each stage holds is part of a layout. Real
models need uneven splits: DeepSeek-V3's 61 layers split over 4 or 8 stages only unevenly. Megatron-core
gives the first and the last stage their own counts (``num_layers_in_first_pipeline_stage``,
``num_layers_in_last_pipeline_stage``) and splits the rest evenly over the middle stages
(:func:`megatron_stage_layers`; MindSpeed-RL's ``num_layer_list`` names every stage's count); vLLM
splits evenly with the remainder on the stages before the last (:func:`vllm_stage_layers`), or as
``VLLM_PP_LAYER_PARTITION`` says. A layout takes the counts from its convention (``stage_layers``);
Megatron's names number layers from 0 on each stage, vLLM's and HF's globally.
"""

from __future__ import annotations

import os

__all__ = ["megatron_stage_layers", "vllm_stage_layers", "vllm_pp_layers", "engine_stage_layers",
           "stage_range", "check_stage_layers", "validate_stages"]


def check_stage_layers(stage_layers: tuple[int, ...] | None) -> None:
    """Refuse a convention's ``stage_layers`` that is not ``None`` or a non-empty tuple of positive counts."""
    if stage_layers is not None and (not stage_layers
                                     or any(not isinstance(n, int) or n < 1 for n in stage_layers)):
        raise ValueError(f"stage_layers={stage_layers!r} must be a non-empty tuple of positive layer counts")


def validate_stages(stage_layers: tuple[int, ...], num_layers: int, pp: int, what: str) -> tuple[int, ...]:
    """``stage_layers`` when it has ``pp`` counts summing to ``num_layers``; else a ``ValueError`` starting
    ``what``."""
    if len(stage_layers) != pp or sum(stage_layers) != num_layers:
        raise ValueError(
            f"{what} stage_layers={stage_layers} must have pp={pp} counts summing to "
            f"num_hidden_layers={num_layers}"
        )
    return tuple(stage_layers)


def megatron_stage_layers(num_layers: int, pp: int, *,
                          first: int | None = None, last: int | None = None) -> tuple[int, ...]:
    """Layers per stage as megatron-core splits them: ``first``/``last`` stage counts when given
    (``num_layers_in_first_pipeline_stage``/``num_layers_in_last_pipeline_stage``), the rest evenly over
    the other stages (see [Note: uneven stages]).

    Raises:
        ValueError: The rest does not split evenly, or a stage would hold no layer.
    """
    counts: list[int | None] = [None] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last if pp > 1 or first is None else counts[-1]
    rest = num_layers - sum(c for c in counts if c is not None)
    free = counts.count(None)
    if (free and rest % free) or (not free and rest) or rest < 0:
        raise ValueError(
            f"num_layers={num_layers} with first={first}, last={last} does not split evenly over the other "
            f"{free} of pp={pp} stages"
        )
    out = tuple(c if c is not None else rest // free for c in counts)
    return validate_stages(out, num_layers, pp, "Megatron")


def vllm_stage_layers(num_layers: int, pp: int, partition: str | None = None) -> tuple[int, ...]:
    """Layers per stage as vLLM's ``get_pp_indices`` splits them: ``partition`` (the text of
    ``VLLM_PP_LAYER_PARTITION``, ``"16,15,15,15"``) when given, else evenly with the extra layers on the
    stages before the last, counting back from the second-to-last (see [Note: uneven stages])."""
    if partition is not None:
        try:
            parts = tuple(int(x) for x in partition.split(","))
        except ValueError as exc:
            raise ValueError(f"VLLM_PP_LAYER_PARTITION={partition!r} is not a comma-separated list of "
                             "ints") from exc
        return validate_stages(parts, num_layers, pp, f"VLLM_PP_LAYER_PARTITION={partition!r}:")
    parts_list = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts_list[-i] += 1
    return tuple(parts_list)


def stage_range(stage_layers: tuple[int, ...], pp_rank: int) -> tuple[int, ...]:
    """Global indices of the layers of stage ``pp_rank``."""
    start = sum(stage_layers[:pp_rank])
    return tuple(range(start, start + stage_layers[pp_rank]))


def vllm_pp_layers(num_layers: int, pp_rank: int, pp: int) -> tuple[int, ...]:
    """Layers of stage ``pp_rank`` as vLLM's ``get_pp_indices`` splits them by default."""
    return stage_range(vllm_stage_layers(num_layers, pp), pp_rank)


def engine_stage_layers(stage_layers: tuple[int, ...] | None, num_layers: int, pp: int) -> tuple[int, ...]:
    """The vLLM engine's split: ``stage_layers``, else ``VLLM_PP_LAYER_PARTITION``, else vLLM's own."""
    if stage_layers is not None:
        return validate_stages(stage_layers, num_layers, pp, "vLLM")
    return vllm_stage_layers(num_layers, pp, os.environ.get("VLLM_PP_LAYER_PARTITION"))
