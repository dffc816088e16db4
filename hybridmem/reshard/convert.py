"""Single-process conversions: shard, unshard, and :func:`reshard_offline` (the plan run in one process).

Useful for debugging and checkpoint conversion, and the entry point of the exhaustive tests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hybridmem.config import ParallelLayout
from hybridmem.reshard.conventions import MegatronConvention, VLLMConvention
from hybridmem.reshard.layouts import ShardLayout, megatron_layout, vllm_layout
from hybridmem.reshard.plan import DEFAULT_BUCKET_NBYTES, build_plan
from hybridmem.reshard.spec import ModelSpec
from hybridmem.reshard.transforms import build_local, piece_view, scatter_local

__all__ = ["shard", "unshard", "reshard_offline", "allocate_local"]


def shard(full: Mapping[str, torch.Tensor], layout: ShardLayout, rank: int) -> dict[str, torch.Tensor]:
    """``rank``'s tensors in ``layout``, cut from HF-full tensors (padding rows zero)."""
    return {name: build_local(local, full) for name, local in layout.tensors(rank).items()}


def unshard(per_rank: Sequence[Mapping[str, torch.Tensor]], layout: ShardLayout) -> dict[str, torch.Tensor]:
    """HF-full tensors rebuilt from every rank's tensors in ``layout`` (the inverse of :func:`shard`).

    Each full tensor takes the dtype of the first rank's tensor holding a slice of it (Megatron may keep
    norms in fp32 beside bf16 weights).

    Raises:
        ValueError: ``len(per_rank)`` is not the layout's world size, or a shape does not match.
    """
    if len(per_rank) != layout.world_size:
        raise ValueError(f"got {len(per_rank)} ranks for a layout of world_size={layout.world_size}")
    first = next(t for tensors in per_rank for t in tensors.values())
    dtypes: dict[str, torch.dtype] = {}
    for rank, tensors in enumerate(per_rank):
        for name, local in layout.tensors(rank).items():
            for piece in local.pieces:
                dtypes.setdefault(piece.hf_name, tensors[name].dtype)
    full = {name: torch.empty(shape, dtype=dtypes.get(name, first.dtype), device=first.device)
            for name, shape in layout.spec.full_shapes().items()}
    for rank, tensors in enumerate(per_rank):
        for name, local in layout.tensors(rank).items():
            scatter_local(local, tensors[name], full)
    return full


def allocate_local(layout: ShardLayout, rank: int, *, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Zeroed tensors of ``rank``'s shapes in ``layout``."""
    return {name: torch.zeros(local.shape, dtype=dtype, device=device)
            for name, local in layout.tensors(rank).items()}


def reshard_offline(train_shards: Sequence[Mapping[str, torch.Tensor]], *, model: ModelSpec,
                    src: ParallelLayout, dst: ParallelLayout,
                    megatron: MegatronConvention | None = None, vllm: VLLMConvention | None = None,
                    bucket_nbytes: int = DEFAULT_BUCKET_NBYTES) -> list[dict[str, torch.Tensor]]:
    """Convert per-rank Megatron state dicts to per-rank vLLM state dicts, in one process.

    Runs the same :func:`~hybridmem.reshard.plan.build_plan` plan as the distributed path, copying each
    transfer directly.

    Args:
        train_shards: One Megatron state dict per training rank (world size ``len(train_shards)``).
        model: The model's shapes.
        src: Training layout.
        dst: Inference layout (on the same world size).
        megatron: Megatron naming/padding options.
        vllm: vLLM padding options.
        bucket_nbytes: Bucket size (only changes how transfers are grouped).

    Returns:
        One dict per inference rank, vLLM names to tensors (padding rows zero).

    Raises:
        ValueError: An invalid layout (see :func:`megatron_layout`, :func:`vllm_layout`), or a missing
            tensor.
    """
    world = len(train_shards)
    src_layout = megatron_layout(model, src, world, convention=megatron)
    dst_layout = vllm_layout(model, dst, world, convention=vllm)
    first = next(t for shards in train_shards for t in shards.values())
    plan = build_plan(src_layout, dst_layout, itemsize=first.element_size(), bucket_nbytes=bucket_nbytes)
    for rank, shards in enumerate(train_shards):
        missing = set(src_layout.tensors(rank)) - set(shards)
        if missing:
            raise ValueError(f"training rank {rank} lacks {sorted(missing)[:5]} ({len(missing)} tensors)")
    out = [allocate_local(dst_layout, r, dtype=first.dtype, device=first.device) for r in range(world)]
    with torch.no_grad():
        for transfers in (*plan.local, *plan.buckets):
            for t in transfers:
                src_t = piece_view(train_shards[t.src_rank][t.src_name], t.src_piece, t.box)
                piece_view(out[t.dst_rank][t.dst_name], t.dst_piece, t.box).copy_(src_t)
    return out
