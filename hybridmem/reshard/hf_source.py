"""Source layouts for HF-named training weights: replicated (one process, DDP) and FSDP2-sharded.

PyTorch-native trainers (plain modules, DDP, ``torch.distributed.fsdp.fully_shard``) keep transformers'
own parameter names. An :class:`HFSourceLayout` describes what every rank holds of them, as pieces of
the HF-full tensors (see [Note: pieces] in :mod:`hybridmem.reshard.transforms`), so the same plan,
execution and checksums that serve Megatron sources serve these too, and each rank receives only the
slices of its inference shards it lacks.

[Note: FSDP2 shards]
``fully_shard`` turns each parameter into a DTensor placed ``Shard(0)`` over its data-parallel mesh of
``S`` ranks. It cuts dim 0 as ``torch.chunk`` does: chunks of ``ceil(N / S)`` rows, the last non-empty
chunk shorter, and ranks past it holding 0 rows (``_chunk_with_empty`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``). The local tensor is a view of the first
rows of a storage padded to ``ceil(N / S)`` rows; the padding is no part of any piece (it is never
sent). Mesh coordinate ``s`` of rank ``r`` is ``r % S`` with replicas (HSDP's replicate dimension, or
``S = 1`` for a replicated model) outermost. Buffers (DeepSeek-V3's ``e_score_correction_bias``) and
parameters of modules no ``fully_shard`` reached stay full on every rank (``replicated`` names).

[Note: transformers experts]
transformers 5 stores the routed experts of a MoE layer fused, as ``mlp.experts.gate_up_proj``
``[E, 2 * I, H]`` (per expert ``[gate; up]``: its forward does ``linear(x, gate_up_proj[e]).chunk(2)``)
and ``mlp.experts.down_proj`` ``[E, H, I]``; :class:`~hybridmem.reshard.spec.ModelSpec` names the
checkpoint's per-expert tensors (``mlp.experts.{e}.gate_proj.weight``). The source layout maps one to
the other (``fused_experts=True``); FSDP2 then shards the fused tensors over experts (dim 0).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import Enum

from hybridmem.config import ParallelLayout
from hybridmem.reshard.layouts import PartGroups, to_checkpoint_names
from hybridmem.reshard.spec import ModelSpec
from hybridmem.reshard.transforms import LocalTensor, Piece, concat, replicate, stack

__all__ = [
    "HFSourceSide",
    "HFSourceLayout",
    "hf_module_tensors",
    "hf_source_layout",
    "looks_hf_named",
    "rows_of",
    "fsdp_rows",
]

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")


class HFSourceSide(Enum):
    """How an :class:`HFSourceLayout` holds the HF-named tensors."""

    REPLICATED = "hf-replicated"
    """Every rank holds every tensor whole (one process, DDP)."""
    FSDP = "hf-fsdp"
    """Tensors are ``Shard(0)`` over a data-parallel mesh (FSDP2 / HSDP), see [Note: FSDP2 shards]."""


def fsdp_rows(num_rows: int, shard: int, num_shards: int) -> tuple[int, int]:
    """``[start, stop)`` rows shard ``shard`` of ``num_shards`` holds under FSDP2's ``Shard(0)``
    (``torch.chunk`` sizes; trailing shards may be empty, see [Note: FSDP2 shards])."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard={shard} outside num_shards={num_shards}")
    step = -(-num_rows // num_shards)
    return min(num_rows, shard * step), min(num_rows, (shard + 1) * step)


def rows_of(local: LocalTensor, start: int, stop: int) -> LocalTensor:
    """Rows ``[start, stop)`` (dim 0) of a local tensor, as pieces; a stacked axis counts as dim 0."""
    pieces = []
    for p in local.pieces:
        if p.dst_prefix:
            if start <= p.dst_prefix[0] < stop:
                prefix = (p.dst_prefix[0] - start, *p.dst_prefix[1:])
                pieces.append(replace(p, dst_prefix=prefix))
            continue
        if p.transposed or len(p.src) != len(p.dst_start):
            raise ValueError(f"{p.hf_name}: rows of a transposed or stacked-checkpoint piece are not "
                             "supported")
        (a, b), lo = p.src[0], p.dst_start[0]
        keep_lo, keep_hi = max(lo, start), min(lo + b - a, stop)
        if keep_lo >= keep_hi:
            continue
        src = ((a + keep_lo - lo, a + keep_hi - lo), *p.src[1:])
        pieces.append(Piece(p.hf_name, src, (), (keep_lo - start, *p.dst_start[1:])))
    return LocalTensor((stop - start, *local.shape[1:]), tuple(pieces))


@functools.lru_cache(maxsize=64)
def hf_module_tensors(spec: ModelSpec, fused_experts: bool = True) -> dict[str, LocalTensor]:
    """The model's HF module tensors (what ``named_parameters()`` of a transformers model yields, plus
    the buffers the spec carries), each as pieces of the spec's HF-full tensors.

    With ``fused_experts`` (transformers >= 5), each MoE layer's routed experts are the two fused
    tensors of [Note: transformers experts]; otherwise the per-expert checkpoint names. Module names are
    the family's (``Family.module_names``): the canonical names (renamed where ``Family.module_renames``
    says, MiniMax-M2's router bias), or the checkpoint's as stored (Phi-3's fused ``qkv_proj``); pieces always
    name checkpoint tensors (see [Note: canonical names] in :mod:`hybridmem.models.family`). A multimodal spec
    (:attr:`~hybridmem.reshard.ModelSpec.multimodal`, Kimi-K2.5) gives its text model's tensors under the
    multimodal model's module names, pieces naming its checkpoint.
    """
    if spec.multimodal:
        names = spec.text_names
        text = hf_module_tensors(replace(spec, multimodal=""), fused_experts)
        return {names.module_name(n):
                LocalTensor(t.shape, tuple(replace(p, hf_name=names.checkpoint_name(p.hf_name))
                                           for p in t.pieces))
                for n, t in text.items()}
    if spec.description.module_names == "checkpoint":
        return {name: replicate(name, shape) for name, shape in spec.full_shapes().items()}
    shapes = spec.canonical_shapes()
    out: dict[str, LocalTensor] = {}
    experts: dict[str, dict[int, dict[str, str]]] = {}
    # A checkpoint tensor fused of canonical ones is one module tensor too (Qwen3.5-MoE's in_proj_qkv).
    fused_suffixes = {part for parts, _ in spec.description.checkpoint_fused for part in parts}
    fused: dict[str, list[str]] = {}
    for name, shape in shapes.items():
        m = _EXPERT.match(name) if fused_experts else None
        if m is None:
            if (fused_suffixes and name.startswith("model.layers.")
                    and name.split(".", 3)[3] in fused_suffixes):
                whole = spec.checkpoint_names()[name].name
                out.setdefault(whole, None)  # placeholder keeps HF order
                fused.setdefault(whole, []).append(name)
                continue
            out[name] = replicate(name, shape)
            continue
        prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
        if prefix not in experts:
            experts[prefix] = {}
            out[prefix + "gate_up_proj"] = None  # placeholder keeps HF order
            out[prefix + "down_proj"] = None
        experts[prefix].setdefault(e, {})[proj] = name
    for whole, parts in fused.items():
        out[whole] = concat([replicate(part, shapes[part]) for part in parts])
    for prefix, by_expert in experts.items():
        order = sorted(by_expert)
        if order != list(range(len(order))):
            raise RuntimeError(f"experts of {prefix} are not numbered 0..{len(order) - 1}: {order}")
        out[prefix + "gate_up_proj"] = stack([
            concat([replicate(by_expert[e][p], shapes[by_expert[e][p]]) for p in ("gate", "up")])
            for e in order
        ])
        out[prefix + "down_proj"] = stack([replicate(by_expert[e]["down"], shapes[by_expert[e]["down"]])
                                           for e in order])
    where = spec.checkpoint_names()
    return {_module_name(spec, name): to_checkpoint_names(where, local) for name, local in out.items()}


def _module_name(spec: ModelSpec, name: str) -> str:
    """transformers' module name of canonical tensor ``name`` (``Family.module_renames``)."""
    family = spec.description
    if not family.module_renames or not name.startswith("model.layers."):
        return name
    layer, _, suffix = name[len("model.layers."):].partition(".")
    return f"model.layers.{layer}.{family.module_suffix(suffix)}"


@dataclass(frozen=True, kw_only=True, slots=True)
class HFSourceLayout:
    """HF-named training tensors over ``world_size`` ranks; hashable and pure, like
    :class:`~hybridmem.reshard.layouts.ShardLayout` (the plan takes either).

    Build with :func:`hf_source_layout`.
    """

    spec: ModelSpec
    world_size: int
    shard_size: int
    """Ranks of one FSDP2 mesh (``Shard(0)`` over them); 1: every rank holds every tensor whole."""
    replicated: frozenset[str] = field(default_factory=frozenset)
    """Module tensor names held whole on every rank even when ``shard_size > 1`` (buffers, parameters
    no ``fully_shard`` reached)."""
    fused_experts: bool = True
    """transformers 5's fused expert tensors (see [Note: transformers experts])."""

    @property
    def side(self) -> HFSourceSide:
        return HFSourceSide.FSDP if self.shard_size > 1 else HFSourceSide.REPLICATED

    @property
    def parallel(self) -> ParallelLayout:
        """The training model-parallel layout: none (tp = pp = ep = 1); data parallel only."""
        return ParallelLayout()

    def tensors(self, rank: int) -> dict[str, LocalTensor]:
        """``{HF module name: LocalTensor}`` of ``rank`` (cached)."""
        return _tensors(self, rank)

    def part_groups(self) -> tuple[PartGroups, ...]:
        """One part: the ranks of each FSDP2 shard index hold the same tensors (see [Note: layout
        parts] in :mod:`hybridmem.reshard.layouts`)."""
        groups = {s: tuple(range(s, self.world_size, self.shard_size)) for s in range(self.shard_size)}
        return (PartGroups(groups, functools.partial(_tensors, self)),)

    def __repr__(self) -> str:
        return (f"HFSourceLayout({self.side.value}, world={self.world_size}, shard_size={self.shard_size}, "
                f"replicated={len(self.replicated)} tensors, fused_experts={self.fused_experts})")


@functools.lru_cache(maxsize=4096)
def _tensors(layout: HFSourceLayout, rank: int) -> dict[str, LocalTensor]:
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank={rank} outside world_size={layout.world_size}")
    shard = rank % layout.shard_size
    out = {}
    for name, full in hf_module_tensors(layout.spec, layout.fused_experts).items():
        if layout.shard_size == 1 or name in layout.replicated:
            out[name] = full
        else:
            out[name] = rows_of(full, *fsdp_rows(full.shape[0], shard, layout.shard_size))
    return out


def hf_source_layout(spec: ModelSpec, world_size: int, *, shard_size: int = 1,
                     replicated: Iterable[str] = (), fused_experts: bool = True) -> HFSourceLayout:
    """The layout of HF-named training tensors.

    Args:
        spec: The model.
        world_size: Ranks of the resharding group.
        shard_size: FSDP2 mesh size (``Shard(0)``); 1 for a replicated model (one process or DDP).
            Must divide ``world_size``; replicas are outermost (rank ``r`` is shard ``r % shard_size``).
        replicated: Module tensor names held whole on every rank despite ``shard_size > 1``.
        fused_experts: Routed experts as transformers 5 fuses them (see [Note: transformers experts]).

    Raises:
        ValueError: ``shard_size`` does not divide ``world_size``, or ``replicated`` names a tensor
            the model does not have.
    """
    if world_size < 1 or shard_size < 1 or world_size % shard_size:
        raise ValueError(f"shard_size={shard_size} must be >= 1 and divide world_size={world_size}")
    replicated = frozenset(replicated)
    names = hf_module_tensors(spec, fused_experts)
    unknown = sorted(replicated - set(names))
    if unknown:
        raise ValueError(f"replicated names {unknown[:5]} are not tensors of this {spec.family} model; "
                         f"expected names like {next(iter(names))!r}")
    return HFSourceLayout(spec=spec, world_size=world_size, shard_size=shard_size, replicated=replicated,
                          fused_experts=fused_experts)


def looks_hf_named(names: Iterable[str]) -> bool:
    """Whether training weight names are transformers' (``model.embed_tokens.weight``; a multimodal model's
    ``model.language_model.embed_tokens.weight``) rather than Megatron-core's
    (``embedding.word_embeddings.weight``)."""
    names = set(names)
    hf = "model.embed_tokens.weight" in names or "model.language_model.embed_tokens.weight" in names
    return hf and "embedding.word_embeddings.weight" not in names
