"""Worker task for test_vllm_fp8.py: vLLM's own classes built on CPU with ``quantization="fp8"`` and 128x128
blocks, filled by the model's own ``load_weights`` from an FP8 checkpoint.

As in :mod:`tests.reshard._vllm_tasks` (whose worker set-up this reuses), no engine is started. vLLM refuses
to build an FP8 linear layer on a CPU without its AMX kernel ("Failed to find a kernel that can implement the
ScaledMM linear layer", from ``choose_scaled_mm_linear_kernel`` in ``vllm/model_executor/kernels/linear``):
only that choice is replaced, by :class:`_StandIn`, a subclass of vLLM's own
``Fp8BlockScaledMMLinearKernel`` that keeps the base class's ``process_weights_after_loading`` (the one the
Triton, CUTLASS and torch block kernels run) and cannot compute. ``create_weights``, the weight loaders, the
checkpoint reading and the MoE method are vLLM's.
"""

from __future__ import annotations

import contextlib
import os

from tests.reshard import _vllm_tasks


@contextlib.contextmanager
def _stand_in_scaled_mm_kernel():
    """vLLM's ``choose_scaled_mm_linear_kernel`` answers :class:`_StandIn` for FP8 block layers while inside;
    the function comes back afterwards."""
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )

    class _StandIn(Fp8BlockScaledMMLinearKernel):
        """Builds and processes as vLLM's block kernels without an override do; never computes."""

        @classmethod
        def is_supported(cls, compute_capability=None):
            return True, None

        def apply_block_scaled_mm(self, A, B, As, Bs):  # noqa: N803 (vLLM's names)
            raise NotImplementedError("a stand-in for vLLM's FP8 block GEMM: builds and loads only")

    original = linear.choose_scaled_mm_linear_kernel
    linear.choose_scaled_mm_linear_kernel = lambda *args, **kwargs: _StandIn
    try:
        yield
    finally:
        linear.choose_scaled_mm_linear_kernel = original


def quantize_with_vllm(tensors: dict, quantized: list) -> dict:
    """The FP8 checkpoint vLLM's own block quantizer (``per_block_cast_to_fp8``, vllm/utils/deep_gemm.py,
    torch-compiled as vLLM runs it) makes of ``tensors``: each name in ``quantized`` as e4m3 values and its
    ``weight_scale_inv``, the others unchanged."""
    _vllm_tasks._environment()
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    out = {}
    for name, tensor in tensors.items():
        if name in quantized:
            out[name], out[name + "_scale_inv"] = per_block_cast_to_fp8(tensor, [128, 128])
        else:
            out[name] = tensor
    return out


def fp8_loaded_parameters(ctx, model_dir: str, tp: int, pp: int, ep: int) -> dict:
    """``{"loaded": {name: tensor}, "processed": {name: tensor}, "kernels": {module: class name}}`` of this
    rank's vLLM model of the FP8 checkpoint in ``model_dir``: its parameters right after ``load_weights``,
    and after vLLM's ``process_weights_after_loading`` (those it left as parameters), and the kernel or MoE
    backend each FP8 module was built with."""
    _vllm_tasks._environment()
    import safetensors.torch
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading

    model_config, vllm_config = _vllm_tasks.vllm_configs(model_dir, tp, pp, ep, dtype="bfloat16")
    assert model_config.quantization == "fp8", model_config.quantization
    weights = safetensors.torch.load_file(os.path.join(model_dir, "model.safetensors"))
    with _vllm_tasks.vllm_groups(ctx, vllm_config, tp, pp):
        with (torch.device("cpu"), _stand_in_scaled_mm_kernel(),
              _vllm_tasks._sparse_attention_builds_on_cpu(model_config.hf_config)):
            model = initialize_model(vllm_config=vllm_config)
        _vllm_tasks._BUILT.append(model)
        model.load_weights(iter(sorted(weights.items())))
        loaded = {name: p.detach().clone() for name, p in model.named_parameters()}
        kernels = {}
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            kernel = getattr(method, "fp8_linear", None) or getattr(method, "fp8_backend", None)
            if kernel is not None:
                kernels[name] = type(kernel).__name__ if hasattr(kernel, "apply_weights") else str(kernel)
        processed = {}
        try:
            process_weights_after_loading(model, model_config, torch.device("cpu"))
            processed = {name: p.detach().clone() for name, p in model.named_parameters()}
        except Exception as exc:  # the MoE backends' processing needs their GPU kernels
            processed = {"error": repr(exc)[:500]}
        return {"loaded": loaded, "processed": processed, "kernels": kernels}


def fp8_refusal(ctx, model_dir: str, tp: int, pp: int, ep: int) -> str | None:
    """What vLLM raises building this rank's model of the FP8 checkpoint in ``model_dir`` as
    :func:`fp8_loaded_parameters` builds it, or else loading the checkpoint with ``load_weights``: the
    ``ValueError``'s or ``RuntimeError``'s message, prefixed ``build:`` or ``load:``; ``None``: both
    succeed."""
    _vllm_tasks._environment()
    import safetensors.torch
    import torch
    from vllm.model_executor.model_loader.utils import initialize_model

    _, vllm_config = _vllm_tasks.vllm_configs(model_dir, tp, pp, ep, dtype="bfloat16")
    with _vllm_tasks.vllm_groups(ctx, vllm_config, tp, pp):
        step = "build"
        try:
            with torch.device("cpu"), _stand_in_scaled_mm_kernel():
                model = initialize_model(vllm_config=vllm_config)
            _vllm_tasks._BUILT.append(model)
            step = "load"
            weights = safetensors.torch.load_file(os.path.join(model_dir, "model.safetensors"))
            model.load_weights(iter(sorted(weights.items())))
        except (ValueError, RuntimeError) as exc:
            return f"{step}: {exc}"
    return None


def fp8_streamed(ctx, config: dict, bf16: dict, tp: int, pp: int, ep: int) -> dict:
    """What the resharding sync hands this rank of an FP8 engine at (tp, pp, ep) from the bf16 weights
    ``bf16`` held as FSDP2 holds them (every tensor's rows split over all ranks, ``Shard(0)``): the plan into
    the rank's unquantized vLLM shards with the FP8 weights' cells moving quantized where they are whole
    blocks and in bf16 where a row split falls inside one, over this pool's gloo group, assembled by
    :func:`~hybridmem.reshard.fp8_stream.iter_fp8_layout_tensors` (small buckets, so cells are cut too)."""
    import torch

    from hybridmem.config import ParallelLayout
    from hybridmem.reshard import ModelSpec, build_plan, hf_source_layout, vllm_layout
    from hybridmem.reshard.conventions import VLLMConvention
    from hybridmem.reshard.fp8_stream import iter_fp8_layout_tensors
    from hybridmem.reshard.transforms import build_local
    from hybridmem.weight_sync.fp8 import Fp8Target

    spec = ModelSpec.from_hf_config(config)
    layout = vllm_layout(spec, ParallelLayout(tp=tp, pp=pp, ep=ep), ctx.world_size,
                         convention=VLLMConvention(weight_block_size=(128, 128)))
    target = Fp8Target(layout, ctx.rank)
    source = hf_source_layout(spec, ctx.world_size, shard_size=ctx.world_size)
    src = {name: build_local(local, bf16, dtype=torch.bfloat16)
           for name, local in source.tensors(ctx.rank).items()}
    plan = build_plan(source, target.plan_layout(), itemsize=2, bucket_nbytes=1 << 16, rank=ctx.rank,
                      quantized=target.quantized_names())
    handed = dict(iter_fp8_layout_tensors(plan, target.tensors(), rank=ctx.rank, src=src, group=ctx.group,
                                          dtype=torch.bfloat16))
    quantized_cells = sum(plan.quantizes(t) for step in plan.buckets for t in step)
    loose_cells = sum(t.hf_name in plan.quantized and not plan.quantizes(t)
                      for step in plan.buckets for t in step)
    return {"handed": handed, "quantized_cells": quantized_cells, "loose_cells": loose_cells}
