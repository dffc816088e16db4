"""Single-process conversions: shard, unshard, and :func:`reshard_offline` (the plan run in one process).

Useful for debugging and checkpoint conversion, and the entry point of the exhaustive tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from hybridmem.config import ParallelLayout
from hybridmem.reshard.conventions import MegatronConvention, VLLMConvention
from hybridmem.reshard.layouts import ShardLayout, layout_full_shapes, megatron_layout, vllm_layout
from hybridmem.reshard.plan import DEFAULT_BUCKET_NBYTES, build_plan
from hybridmem.reshard.spec import ModelSpec
from hybridmem.reshard.transforms import build_local, piece_view, scatter_local

__all__ = ["shard", "iter_shard", "unshard", "reshard_offline", "allocate_local"]


def shard(full: Mapping[str, torch.Tensor], layout: ShardLayout, rank: int) -> dict[str, torch.Tensor]:
    """``rank``'s tensors in ``layout``, cut from HF-full tensors (padding rows zero)."""
    return {name: build_local(local, full) for name, local in layout.tensors(rank).items()}


def iter_shard(full: Iterable[tuple[str, torch.Tensor | None]], layout: ShardLayout, rank: int, *,
               dtypes: Mapping[str, torch.dtype] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`shard` over a stream of HF-full tensors: ``rank``'s tensors in ``layout``, each yielded once the
    HF tensors it is cut from have all arrived (a fused tensor waits for all its parts), and each HF tensor
    dropped once every local tensor cut from it was built; so it holds the HF tensors of the local tensors
    not yet complete, never the model.

    Args:
        full: ``(HF name, full tensor)`` in any order; a ``None`` tensor (another rank's) is skipped, as is an
            HF tensor no tensor of ``rank`` is cut from.
        layout: The destination layout.
        rank: The destination rank.
        dtypes: The dtype of a local tensor that is all padding (it is yielded first); default: float32.

    Raises:
        ValueError: A name that is no HF tensor of the model, one given twice, a shape other than the model's,
            or, at the end, an HF tensor never given that a local tensor needs; each names it.
    """
    shapes = layout_full_shapes(layout)
    tensors = layout.tensors(rank)
    missing: dict[str, set[str]] = {}  # local name -> HF names still to come
    users: dict[str, list[str]] = {}  # HF name -> local names cut from it
    for name, local in tensors.items():
        if not local.pieces:
            yield name, build_local(local, {}, dtype=(dtypes or {}).get(name, torch.float32))
            continue
        missing[name] = {p.hf_name for p in local.pieces}
        for hf_name in missing[name]:
            users.setdefault(hf_name, []).append(name)
    left = {hf_name: len(names) for hf_name, names in users.items()}
    held: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    for hf_name, tensor in full:
        if tensor is None:
            continue
        if hf_name not in shapes:
            raise ValueError(f"{hf_name!r} is not an HF tensor of the {layout.spec.family} model (e.g. "
                             f"{list(shapes)[:3]})")
        if hf_name in seen:
            raise ValueError(f"{hf_name} was given twice")
        seen.add(hf_name)
        if tuple(tensor.shape) != tuple(shapes[hf_name]):
            raise ValueError(f"{hf_name}: the stream gives shape {tuple(tensor.shape)}, the model's is "
                             f"{tuple(shapes[hf_name])}")
        if hf_name not in users:
            continue
        held[hf_name] = tensor
        for name in users[hf_name]:
            waiting = missing[name]
            waiting.discard(hf_name)
            if waiting:
                continue
            del missing[name]
            local = tensors[name]
            out = build_local(local, held)
            for part in {p.hf_name for p in local.pieces}:
                left[part] -= 1
                if not left[part]:
                    del held[part]
            yield name, out
    if missing:
        absent = sorted(set().union(*missing.values()))
        raise ValueError(f"the stream ended without {absent[:3]} ({len(absent)} HF tensors), from which rank "
                         f"{rank}'s {sorted(missing)[:3]} are cut")


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
