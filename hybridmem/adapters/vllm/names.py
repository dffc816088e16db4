"""Check the tensors a weight sync will write against the parameters a vLLM worker really has.

[Note: vllm name check]
The resharding engine writes vLLM-layout tensors whose names and per-rank shapes come from a layout
table (:func:`hybridmem.reshard.vllm_layout`), and the ``reload_weights`` path streams HF tensors that
vLLM turns into the same parameters. A table that disagrees with the installed vLLM (a renamed
parameter, a tensor built on more pipeline stages than the table says) would otherwise fail halfway
through the first sync, or silently leave a parameter unwritten. So when the adapter attaches it reads
the worker's own ``named_parameters()`` (names and shapes) and compares them with the layout for the
worker's rank; :class:`~hybridmem.weight_sync.ReshardSync` repeats the check with the layout it will
really write (its ``infer_layout``). A mismatch raises before any tensor moves, naming both sides.

A persistent buffer of the model that the layout names is a weight vLLM's loader fills (Gemma 4's
``layer_scalar``) and is checked like a parameter; the other buffers are vLLM's own (an attention
layer's quantization scales) and no part of the check.

A multimodal model's parameters outside its text model (Kimi-K2.5's vision tower and projector,
``TextModelNames.vllm_not_synced`` of its family) are never synced and no part of the check either
(:func:`not_synced_prefixes`).

Both are one rule, :func:`synced_tensors`: which of a worker's tensors a sync writes. The in-process
adapter applies it to the worker's report (this check, and the buffers it writes in place); the server
adapter's workers apply it to their own model, given the layout's names and the prefixes
(:func:`sync_rule`), and stage and write exactly those tensors
(:mod:`hybridmem.adapters.vllm.server.transfer`).

Shapes are compared where the backend keeps them: the vLLM CPU backend repacks linear weights into
its kernels' format after loading and leaves those parameters with shape ``[0]``; for them only the
name is checked (and their values can only be updated through ``reload_weights``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any, TypeVar

from hybridmem.adapters.vllm.worker import WorkerInfo

__all__ = ["check_weight_names", "engine_layout_shapes", "not_synced_prefixes", "sync_rule", "synced_tensors"]

T = TypeVar("T")


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in getattr(value, "shape", value))


def synced_tensors(params: Iterable[tuple[str, T]], buffers: Iterable[tuple[str, T]],
                   layout_names: Collection[str], not_synced: tuple[str, ...] = ()) -> dict[str, T]:
    """The tensors of a vLLM worker's model that a weight sync writes (see [Note: vllm name check]): its
    parameters but those under a ``not_synced`` prefix (a multimodal model's vision tower), and its
    persistent buffers that the layout names (``layout_names``: Gemma 4's ``layer_scalar``, which vLLM's
    loader fills).

    Args:
        params: ``(name, value)`` of the model's parameters, in model order.
        buffers: ``(name, value)`` of its persistent buffers.
        layout_names: Names of the vLLM layout (of this rank, or of every rank: a buffer is named alike).
        not_synced: Prefixes of parameters no sync writes (:func:`not_synced_prefixes`).

    Returns:
        ``{name: value}``, parameters first.
    """
    out = {name: v for name, v in params if not (not_synced and name.startswith(not_synced))}
    out.update((name, v) for name, v in buffers if name in layout_names)
    return out


def check_weight_names(info: WorkerInfo, expected: Mapping[str, Any], *, what: str,
                       not_synced: tuple[str, ...] = ()) -> None:
    """Compare a worker's parameters with the tensors a sync will write (see [Note: vllm name check]).

    Args:
        info: What the worker reported (:func:`~hybridmem.adapters.vllm.worker.probe_worker`).
        expected: ``{name: shape}`` (or objects with ``.shape``, e.g. a layout's ``LocalTensor``).
        what: Names the expected side in the error (e.g. ``"the vLLM layout tp=2 pp=1 ep=1, rank 1"``).
        not_synced: Prefixes of the worker's parameters that no sync writes (:func:`not_synced_prefixes`).

    Raises:
        ValueError: A name on one side only, or a shape that differs (repacked ``[0]`` parameters are
            compared by name only); the message names both sides.
    """
    want = {name: _shape(v) for name, v in expected.items()}
    engine = synced_tensors(info.params, info.buffers, want, not_synced)
    only_engine = [n for n in engine if n not in want]
    only_layout = [n for n in want if n not in engine]
    repacked = set(info.repacked)
    shapes = [
        f"{n}: vLLM {engine[n]} vs {want[n]}"
        for n in want
        if n in engine and n not in repacked and engine[n] != want[n]
    ]
    if only_engine or only_layout or shapes:
        problems = []
        if only_layout:
            problems.append(f"{len(only_layout)} tensors the sync writes are not vLLM parameters: "
                            f"{only_layout[:6]}")
        if only_engine:
            problems.append(f"{len(only_engine)} vLLM parameters the sync never writes: {only_engine[:6]}")
        if shapes:
            problems.append(f"{len(shapes)} shapes differ: {shapes[:6]}")
        raise ValueError(
            f"vLLM worker rank {info.rank} does not match {what}: " + "; ".join(problems)
            + f" (the worker has {len(engine)} parameters, {len(repacked)} of them kept by the backend in "
            f"its kernels' format and checked by name only; the sync writes {len(want)})"
        )


def not_synced_prefixes(hf_config: Any) -> tuple[str, ...]:
    """Prefixes of the parameters of the engine's model (its HF config) that no sync writes: a multimodal
    model's outside its text model (Kimi-K2.5's vision tower and projector); ``()`` for a text model or one
    the resharding engine does not know."""
    from hybridmem.reshard import ModelSpec  # noqa: PLC0415 - keeps the adapter import light

    if hf_config is None:
        return ()
    try:
        return ModelSpec.from_hf_config(hf_config).text_names.vllm_not_synced
    except (ValueError, TypeError):
        return ()


def engine_layout_shapes(hf_config: Any, parallel: Any, rank: int) -> tuple[dict[str, Any], str]:
    """``({name: LocalTensor}, description)`` of the vLLM layout for the engine's own model and parallel
    configuration, on ``rank`` of its ``tp * pp`` world.

    Raises:
        ValueError: The model is not one the resharding engine knows (``ModelSpec.from_hf_config``).
    """
    from hybridmem.config import ParallelLayout  # noqa: PLC0415 - keeps the adapter import light
    from hybridmem.reshard import ModelSpec, VLLMConvention, vllm_layout  # noqa: PLC0415
    from hybridmem.reshard.fp8 import block_from_hf_config  # noqa: PLC0415

    spec = ModelSpec.from_hf_config(hf_config)
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    ep = tp if getattr(parallel, "enable_expert_parallel", False) and spec.num_experts else 1
    layout = ParallelLayout(tp=tp, pp=pp, ep=ep)
    world = tp * pp
    # an FP8 model's layout holds each quantized weight's scales beside it
    block = block_from_hf_config(hf_config)
    tensors = vllm_layout(spec, layout, world, convention=VLLMConvention(weight_block_size=block)).tensors(
        rank % world)
    fp8 = " in FP8 (128x128 blocks)" if block else ""
    return tensors, f"the vLLM layout tp={tp} pp={pp} ep={ep} of {spec.family}{fp8}, rank {rank % world}"


def sync_rule(hf_config: Any, world_size: int) -> tuple[list[str] | None, list[str]]:
    """``(layout names, not-synced prefixes)`` for a worker that applies :func:`synced_tensors` to its own
    model (the server adapter's, :mod:`hybridmem.adapters.vllm.server.transfer`): the names of the vLLM
    layout of every rank of a ``tensor_parallel_size=world_size`` engine of ``hf_config``, and
    :func:`not_synced_prefixes`. ``(None, [])`` where the resharding engine does not know the model (no
    buffer is then a weight, every parameter is)."""
    from hybridmem.config import ParallelLayout  # noqa: PLC0415 - keeps the adapter import light
    from hybridmem.reshard import ModelSpec, vllm_layout  # noqa: PLC0415

    if hf_config is None:
        return None, []
    try:
        spec = ModelSpec.from_hf_config(hf_config)
    except (ValueError, TypeError):
        return None, []
    layout = vllm_layout(spec, ParallelLayout(tp=world_size), world_size)
    names = sorted({name for rank in range(world_size) for name in layout.tensors(rank)})
    return names, list(spec.text_names.vllm_not_synced)
