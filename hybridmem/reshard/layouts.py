"""Layouts as data: where every rank's tensors come from, for Megatron-core, vLLM and HF-full.

A :class:`ShardLayout` is (ModelSpec, ParallelLayout, world size, convention). ``layout.tensors(rank)``
gives that rank's tensor names and, for each, a :class:`~hybridmem.reshard.transforms.LocalTensor`
(see [Note: pieces] in :mod:`hybridmem.reshard.transforms`). The per-layer mapping is one table,
:data:`LAYER_RULES`: each row names the HF tensors, the Megatron name, the vLLM name and the transform kind,
over the canonical names of [Note: canonical names] in :mod:`hybridmem.models.family`; a family's own
checkpoint and vLLM names come from its description, and pieces are rewritten to the checkpoint's names last
(:func:`_to_checkpoint`).

Rank order:

- Megatron (training): tp fastest, then dp, pp outermost; EP inside DP (``ep_rank = dp_rank % ep``),
  expert tensor-parallel size = tp (Megatron's default ``expert_tensor_parallel_size``).
- vLLM (inference): replicas of ``tp * pp`` consecutive ranks; inside one, tp fastest. ``ep > 1``
  turns on vLLM's expert-parallel mode: MoE layers use expert TP 1 and
  ``ep_rank = (replica * tp + tp_rank) % ep`` (vLLM uses ``ep = dp * tp``; smaller ``ep`` replicates).

The pieces of this package each have one job: :mod:`~hybridmem.reshard.vllm_versions` (which vLLM release a
layout follows, [Note: vLLM versions] in :mod:`hybridmem.reshard.vllm_versions`),
:mod:`~hybridmem.reshard.conventions` (each side's naming options, a rank's coordinates),
:mod:`~hybridmem.reshard.stages` (layers per pipeline stage, [Note: uneven stages] in
:mod:`hybridmem.reshard.stages`), :mod:`~hybridmem.reshard.rules` (the table and its kinds); this module
assembles a rank's tensors from them and checks that a layout is valid.

[Note: layout parts]
A rank's tensors are two parts that depend on different coordinates: the dense part (embedding,
attention, dense MLP, norms, head) on the tp rank and the stage, the expert part (routed experts) on
the expert-parallel and expert-tp ranks and the stage. Ranks with equal coordinates for a part hold
the same tensors of it, so a plan can learn who holds a tensor from one build per group of such ranks
(:meth:`ShardLayout.part_groups`) instead of one per rank: a few dense groups and, for a MoE model,
the expert groups of the experts it asks about. ``_tensors`` is the union of the two parts, built by
the same function (``_part_tensors``); tests/reshard/test_rank_plan.py checks they agree. An HF layout
has one part (each stage holds whole tensors). Layouts of other kinds (the HF source layouts of
FSDP2) give one part grouped their own way; a plan uses only ``part_groups``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from hybridmem.config import ParallelLayout
from hybridmem.reshard.conventions import (
    HFConvention,
    MegatronConvention,
    RankCoords,
    Side,
    VLLMConvention,
)
from hybridmem.reshard.fp8 import (
    FP8_BLOCK,
    FP8_FAMILIES,
    QUANTIZED_VLLM_RULES,
    fp8_full_shapes,
    scale_name,
    scale_of,
)
from hybridmem.reshard.rules import (
    EXPERT_KINDS,
    LAYER_RULES,
    build_rule,
    expert_range,
    rotary_permuted,
    vllm_loaded_hf_names,
    vocab_rows,
)
from hybridmem.reshard.spec import ModelSpec, Placement
from hybridmem.reshard.stages import engine_stage_layers, stage_range, validate_stages
from hybridmem.reshard.transforms import LocalTensor, pad_rows, replicate, split
from hybridmem.reshard.vllm_versions import resolve_vllm_version

__all__ = [
    "Part",
    "PartGroups",
    "ShardLayout",
    "megatron_layout",
    "vllm_layout",
    "hf_layout",
    "to_checkpoint_names",
    "fp8_quantized_names",
    "with_scales",
    "layout_full_shapes",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardLayout:
    """One side's sharding of a model over ``world_size`` ranks; hashable and pure.

    Build with :func:`megatron_layout`, :func:`vllm_layout` or :func:`hf_layout`; they check the
    layout is valid (``ValueError`` naming the numbers).
    """

    spec: ModelSpec
    parallel: ParallelLayout
    world_size: int
    side: Side
    convention: MegatronConvention | VLLMConvention | HFConvention

    def coords(self, rank: int) -> RankCoords:
        """Where ``rank`` sits (tp/pp/ep ranks and the layers of its stage)."""
        return _coords(self, rank)

    def tensors(self, rank: int) -> dict[str, LocalTensor]:
        """``{name: LocalTensor}`` of every tensor ``rank`` holds, in model order (cached)."""
        return _tensors(self, rank)

    def part_groups(self) -> tuple[PartGroups, ...]:
        """The dense part's rank groups and, for a MoE model outside an HF layout, the expert part's
        (see [Note: layout parts]); cached."""
        return _part_groups(self)


@functools.lru_cache(maxsize=16)
def _part_groups(layout: ShardLayout) -> tuple[PartGroups, ...]:
    spec = layout.spec
    dense: dict[RankCoords, list[int]] = {}
    experts: dict[RankCoords, list[int]] = {}
    with_experts = spec.num_experts > 0 and layout.side is not Side.HF
    for rank in range(layout.world_size):
        c = _coords.__wrapped__(layout, rank)  # not through the cache: one call per rank, once
        dense.setdefault(replace(c, moe_tp_rank=0, moe_tp=1, ep_rank=0, ep=1), []).append(rank)
        if with_experts:
            experts.setdefault(replace(c, tp_rank=0, tp=1), []).append(rank)
    groups = [PartGroups({k: tuple(v) for k, v in dense.items()},
                           functools.partial(_part_tensors, layout, part=Part.DENSE))]
    if with_experts:
        by_expert: dict[int, list[RankCoords]] = {}
        for key in experts:
            for e in range(*expert_range(spec.num_experts, key.ep_rank, key.ep)):
                by_expert.setdefault(e, []).append(key)
        groups.append(PartGroups({k: tuple(v) for k, v in experts.items()},
                                   functools.partial(_part_tensors, layout, part=Part.EXPERTS),
                                   functools.partial(_expert_keys, spec, by_expert)))
    return tuple(groups)


_EXPERT_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def _expert_keys(spec: ModelSpec,
                 by_expert: Mapping[int, list[RankCoords]], hf_name: str) -> list[RankCoords]:
    """The expert groups holding a piece of checkpoint tensor ``hf_name``: those of its experts' ep ranks
    whose stage has its layer."""
    keys: dict[RankCoords, None] = {}
    for canonical in spec.canonical_names_of(hf_name):
        m = _EXPERT_NAME.match(canonical)
        if m is None:
            continue
        layer = int(m[1])
        for key in by_expert.get(int(m[2]), ()):
            if key.layers and key.layers[0] <= layer <= key.layers[-1]:
                keys[key] = None
    return list(keys)


class Part(Enum):
    """Which of a rank's tensors to build (see [Note: layout parts])."""

    ALL = "all"
    DENSE = "dense"
    EXPERTS = "experts"


@dataclass(frozen=True, eq=False)
class PartGroups:
    """The rank groups of one part: ranks grouped by the coordinates the part of their tensors depends on (see
    [Note: layout parts])."""

    groups: Mapping[Any, tuple[int, ...]]
    """Group key -> its ranks, ascending; every rank is in exactly one group."""
    build: Callable[[Any], dict[str, LocalTensor]]
    """Group key -> the part's tensors, as each rank of the group holds them (cached by the caller)."""
    locate: Callable[[str], Iterable[Any]] | None = None
    """HF tensor name -> the keys of the groups that may hold a piece of it; ``None``: any group."""


@functools.lru_cache(maxsize=4096)
def _coords(layout: ShardLayout, rank: int) -> RankCoords:
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank={rank} outside world_size={layout.world_size}")
    p, n = layout.parallel, layout.spec.num_hidden_layers
    tp, pp, ep = p.tp, p.pp, p.ep
    # resolved when the layout was built ([Note: uneven stages] in :mod:`hybridmem.reshard.stages`)
    stages = layout.convention.stage_layers
    if layout.side is Side.MEGATRON:
        dp = layout.world_size // (tp * pp)
        dp_rank, pp_rank = (rank // tp) % dp, rank // (tp * dp)
        layers = (stage_range(stages, pp_rank) if stages is not None
                  else tuple(range(pp_rank * (n // pp), (pp_rank + 1) * (n // pp))))
        return RankCoords(rank % tp, tp, pp_rank, pp, rank % tp, tp, dp_rank % ep, ep, layers)
    replica, tp_rank, pp_rank = rank // (tp * pp), rank % tp, (rank // tp) % pp
    layers = stage_range(stages, pp_rank)
    if layout.side is Side.HF:
        return RankCoords(0, 1, pp_rank, pp, 0, 1, 0, 1, layers)
    if ep > 1:
        return RankCoords(tp_rank, tp, pp_rank, pp, 0, 1, (replica * tp + tp_rank) % ep, ep, layers)
    return RankCoords(tp_rank, tp, pp_rank, pp, tp_rank, tp, 0, 1, layers)


@functools.lru_cache(maxsize=4096)
def _tensors(layout: ShardLayout, rank: int) -> dict[str, LocalTensor]:
    return _part_tensors(layout, layout.coords(rank), Part.ALL)


def _part_tensors(layout: ShardLayout, c: RankCoords, part: Part) -> dict[str, LocalTensor]:
    """The tensors of a rank at ``c``, or only those of one :class:`Part` (see [Note: layout parts])."""
    spec, side = layout.spec, layout.side
    if spec.multimodal:
        return _multimodal_names(spec, side,
                                 _part_tensors(replace(layout, spec=replace(spec, multimodal="")), c, part))
    if part is Part.EXPERTS and side is Side.HF:
        return {}  # an HF stage holds whole tensors: all of them are in its dense part
    dense, experts = part is not Part.EXPERTS, part is not Part.DENSE
    shapes = spec.canonical_shapes()
    out: dict[str, LocalTensor] = {}
    embed = "model.embed_tokens.weight"
    head = embed if spec.tie_word_embeddings else "lm_head.weight"
    if side is Side.HF:
        # Every rank of a stage holds the full tensors that vLLM's loaders of that stage take: its layers'
        # tensors that have a vLLM name (not DeepSeek's router bias without noaux_tc), and the embedding,
        # final norm and head where vLLM builds them (tied embeddings on the last stage too; some families
        # on every stage).
        every_stage = layout.convention.every_stage
        embed_everywhere = every_stage or spec.description.vllm_embedding_every_stage
        if c.first_stage or (spec.tie_word_embeddings and c.last_stage) or embed_everywhere:
            out[embed] = replicate(embed, shapes[embed])
        # Gemma 4's per-layer input embeddings: vLLM builds them on every stage.
        out.update((n, replicate(n, shape)) for n, shape in spec.per_layer_input_shapes().items())
        for i in c.layers:
            for name in vllm_loaded_hf_names(spec, i):
                out[name] = replicate(name, shapes[name])
        if c.last_stage or every_stage:
            out["model.norm.weight"] = replicate("model.norm.weight", shapes["model.norm.weight"])
            if not spec.tie_word_embeddings:
                out[head] = replicate(head, shapes[head])
        # Phi-3's fused checkpoint tensors: one full tensor for its canonical parts.
        full, where = spec.full_shapes(), spec.checkpoint_names()
        names = dict.fromkeys(where[n].name for n in out)
        return {n: replicate(n, full[n]) for n in names}

    def vocab(name: str) -> LocalTensor:
        rows = vocab_rows(side, spec, layout.convention, c)
        return pad_rows(name, shapes[name], padded_rows=rows, rank=c.tp_rank, num=c.tp)

    # vLLM builds some families' embedding, final norm and head on every stage ([Note: vLLM versions] in
    # :mod:`hybridmem.reshard.vllm_versions`).
    every_stage = side is Side.VLLM and spec.description.vllm_every_stage
    if not dense:
        pass
    elif side is Side.MEGATRON:
        if c.first_stage:
            out["embedding.word_embeddings.weight"] = vocab(embed)
    elif (c.first_stage or (spec.tie_word_embeddings and c.last_stage) or every_stage
          or (side is Side.VLLM and spec.description.vllm_embedding_every_stage)):
        out[spec.description.vllm_embedding] = vocab(embed)
    if dense and side is Side.VLLM and spec.hidden_size_per_layer_input:
        out.update(_per_layer_inputs(spec, layout.convention, c))
    fp8 = side is Side.VLLM and layout.convention.weight_block_size is not None
    quantized: list[str] = []
    for local, layer in enumerate(c.layers):
        for rule in LAYER_RULES:
            if (experts if rule.kind in EXPERT_KINDS else dense) and rule.when(spec, layer):
                built = build_rule(rule, spec, side, layout.convention, c, layer, local, shapes)
                if rule.kind == "qkv" and side is Side.VLLM and spec.description.vllm_rotary_permute:
                    qk = tuple(f"model.layers.{layer}.self_attn.{p}_proj.weight" for p in ("q", "k"))
                    built = {n: rotary_permuted(t, qk, spec.head_dim) for n, t in built.items()}
                out.update(built)
                if fp8 and rule.vllm in QUANTIZED_VLLM_RULES:
                    quantized.extend(built)
    if dense and (c.last_stage or every_stage):
        if side is Side.MEGATRON:
            out["decoder.final_layernorm.weight"] = replicate("model.norm.weight",
                                                              shapes["model.norm.weight"])
            # Tied: Megatron keeps a copy of the embedding as output_layer on the last stage when pp > 1.
            if not spec.tie_word_embeddings or c.pp > 1:
                out["output_layer.weight"] = vocab(head)
        else:
            out["model.norm.weight"] = replicate("model.norm.weight", shapes["model.norm.weight"])
            if not spec.tie_word_embeddings:
                out["lm_head.weight"] = vocab(head)
    out = _to_checkpoint(spec, out)
    if quantized:
        out = with_scales(spec, out, quantized)
    return out


def with_scales(spec: ModelSpec, out: Mapping[str, LocalTensor],
                quantized: Iterable[str]) -> dict[str, LocalTensor]:
    """``out`` with the block scales of each ``quantized`` tensor right after it (see [Note: fp8 block layout]
    in :mod:`hybridmem.reshard.fp8`): an FP8 vLLM layout's tensors, or an HF layout's as an FP8 checkpoint
    holds them (each quantized weight's ``weight_scale_inv`` beside it)."""
    shapes, names = spec.full_shapes(), set(quantized)
    result: dict[str, LocalTensor] = {}
    for name, local in out.items():
        result[name] = local
        if name in names:
            result[scale_name(name)] = scale_of(name, local, shapes)
    return result


def fp8_quantized_names(spec: ModelSpec) -> tuple[str, ...]:
    """The checkpoint tensors an FP8 checkpoint of ``spec`` holds in FP8 with block scales: those of the layer
    rows vLLM quantizes (:data:`~hybridmem.reshard.fp8.QUANTIZED_VLLM_RULES`), in checkpoint order."""
    wanted: set[str] = set()
    for layer in range(spec.num_hidden_layers):
        for rule in LAYER_RULES:
            if rule.vllm not in QUANTIZED_VLLM_RULES or not rule.when(spec, layer):
                continue
            for suffix in rule.hf:
                suffix = suffix.replace("{shared}", spec.shared_expert_name)
                experts = range(spec.num_experts) if "{e}" in suffix else (None,)
                wanted.update(f"model.layers.{layer}." + suffix.format(e=e) for e in experts)
    where = spec.checkpoint_names()
    names = {where[n].name for n in wanted if n in where}
    return tuple(n for n in spec.full_shapes() if n in names)


def layout_full_shapes(layout: ShardLayout) -> dict[str, tuple[int, ...]]:
    """The HF-full tensors ``layout``'s pieces are cut from, by name, with their shapes: the model's
    checkpoint (:meth:`~hybridmem.reshard.ModelSpec.full_shapes`), or, for an FP8 vLLM layout, the FP8
    checkpoint's (each quantized weight's ``weight_scale_inv`` too)."""
    shapes = layout.spec.full_shapes()
    if layout.side is Side.VLLM and layout.convention.weight_block_size is not None:
        return fp8_full_shapes(shapes, fp8_quantized_names(layout.spec))
    return shapes


def _per_layer_inputs(spec: ModelSpec, conv: VLLMConvention, c: RankCoords) -> dict[str, LocalTensor]:
    """The per-layer input embeddings' tensors outside the layers on a vLLM rank at ``c``, every stage (see
    :attr:`hybridmem.models.Family.per_layer_inputs`): the embedding's vocabulary padded and split as the
    token embedding's (a ``VocabParallelEmbedding`` of its own rows), the model projection's rows split (a
    ``ColumnParallelLinear``), the norm whole."""
    shapes = spec.per_layer_input_shapes()
    embed, projection, norm = shapes
    padded = conv.padded_vocab(spec.vocab_size_per_layer_input)
    return {embed: pad_rows(embed, shapes[embed], padded_rows=padded, rank=c.tp_rank, num=c.tp),
            projection: split(projection, shapes[projection], axis=0, rank=c.tp_rank, num=c.tp),
            norm: replicate(norm, shapes[norm])}


def _multimodal_names(spec: ModelSpec, side: Side, text: dict[str, LocalTensor]) -> dict[str, LocalTensor]:
    """The text model's tensors ``text`` of a layout under the multimodal model's names (Kimi-K2.5's
    ``language_model.``, :attr:`~hybridmem.reshard.ModelSpec.text_names`): pieces name its checkpoint tensors,
    an HF stage's tensors are those, vLLM's tensors its vLLM class's."""
    names = spec.text_names
    rename = names.checkpoint_name if side is Side.HF else names.vllm_name
    return {rename(n): LocalTensor(t.shape, tuple(replace(p, hf_name=names.checkpoint_name(p.hf_name))
                                                  for p in t.pieces)) for n, t in text.items()}


def to_checkpoint_names(where: Mapping[str, Placement], local: LocalTensor) -> LocalTensor:
    """``local`` with its pieces naming checkpoint tensors instead of canonical ones (a renamed tensor;
    rows of a fused one: the box shifted by the block's first row; one expert of a stacked one: the box
    under a leading ``(e, e + 1)``, transposed where the checkpoint is; see [Note: canonical names] in
    :mod:`hybridmem.models.family`); ``where`` is the spec's
    :meth:`~hybridmem.reshard.ModelSpec.checkpoint_names`."""
    pieces = []
    for p in local.pieces:
        at = where[p.hf_name]
        if p.transposed or len(p.src) != len(p.dst_start):
            raise ValueError(f"{p.hf_name}: a piece already in checkpoint form cannot be placed again")
        src = p.src if not at.row else ((p.src[0][0] + at.row, p.src[0][1] + at.row), *p.src[1:])
        if at.transposed:
            src = (*src[:-2], src[-1], src[-2])
        src = (*((i, i + 1) for i in at.index), *src)
        pieces.append(replace(p, hf_name=at.name, src=src, transposed=at.transposed))
    return LocalTensor(local.shape, tuple(pieces))


def _to_checkpoint(spec: ModelSpec, out: dict[str, LocalTensor]) -> dict[str, LocalTensor]:
    family = spec.description
    if not (family.checkpoint_renames or family.checkpoint_fused or family.checkpoint_stacked):
        return out
    where = spec.checkpoint_names()
    return {name: to_checkpoint_names(where, local) for name, local in out.items()}


def _check_world(parallel: ParallelLayout, world_size: int, what: str) -> int:
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if world_size % (parallel.tp * parallel.pp):
        raise ValueError(
            f"{what}: world_size={world_size} is not divisible by tp*pp={parallel.tp}*{parallel.pp}"
        )
    return world_size // (parallel.tp * parallel.pp)


def megatron_layout(spec: ModelSpec, parallel: ParallelLayout, world_size: int, *,
                    convention: MegatronConvention | None = None) -> ShardLayout:
    """The Megatron-core training layout.

    Raises:
        ValueError: world size not divisible by tp*pp, tp not dividing the query groups (including
            tp > num_key_value_heads), heads/ffn/experts not divisible, layers not divisible by pp, or
            ep not dividing dp (each message names the numbers), or a family megatron-core's
            ``GPTModel`` cannot express (its description's ``megatron`` says why).
    """
    if spec.description.megatron is not None:
        raise ValueError(f"family={spec.family!r} has no Megatron-core layout: {spec.description.megatron}")
    if spec.multimodal:
        raise ValueError(f"multimodal={spec.multimodal!r} (family={spec.family!r}) has no Megatron-core "
                         "layout: hybridmem's Megatron names are those of the text model alone")
    dp = _check_world(parallel, world_size, "training layout")
    tp, pp, ep = parallel.tp, parallel.pp, parallel.ep
    if tp > spec.num_key_value_heads or spec.num_key_value_heads % tp:
        raise ValueError(
            f"training tp={tp} must divide the query groups num_key_value_heads={spec.num_key_value_heads} "
            f"(Megatron splits QKV by whole query groups)"
        )
    conv = convention or MegatronConvention()
    if conv.stage_layers is not None:
        validate_stages(conv.stage_layers, spec.num_hidden_layers, pp, "Megatron")
    elif spec.num_hidden_layers % pp:
        raise ValueError(
            f"training pp={pp} does not divide num_hidden_layers={spec.num_hidden_layers}: give the stages' "
            "layer counts (MegatronConvention(stage_layers=...), megatron_stage_layers(first=, last=))"
        )
    if spec.has_dense_layers and spec.intermediate_size % tp:
        raise ValueError(f"training tp={tp} does not divide intermediate_size={spec.intermediate_size}")
    if spec.is_mla:
        _check_megatron_mla(spec, tp, conv)
    if spec.is_moe:
        if dp % ep:
            raise ValueError(f"training ep={ep} does not divide dp={dp} (world_size={world_size}, tp={tp}, "
                             f"pp={pp})")
        if spec.num_experts % ep:
            raise ValueError(f"training ep={ep} does not divide num_experts={spec.num_experts}")
        if spec.moe_intermediate_size % tp or spec.shared_expert_intermediate_size % tp:
            raise ValueError(
                f"training tp={tp} does not divide moe_intermediate_size={spec.moe_intermediate_size} "
                f"or shared_expert_intermediate_size={spec.shared_expert_intermediate_size}"
            )
    elif ep != 1:
        raise ValueError(f"ep={ep} given for a dense model")
    return ShardLayout(spec=spec, parallel=parallel, world_size=world_size,
                       side=Side.MEGATRON, convention=conv)


def _check_megatron_mla(spec: ModelSpec, tp: int, conv: MegatronConvention) -> None:
    if conv.norm_style != "local":
        raise ValueError(f"norm_style={conv.norm_style!r} is not supported for MLA (deepseek_v3); expected "
                         "'local'")
    # The local spec's MLA down-projections are column-parallel too, so their rows must split evenly.
    kv_a = spec.kv_lora_rank + spec.qk_rope_head_dim
    if spec.q_lora_rank % tp or kv_a % tp:
        raise ValueError(
            f"training tp={tp} must divide q_lora_rank={spec.q_lora_rank} and kv_lora_rank + "
            f"qk_rope_head_dim={kv_a} (Megatron's MLA splits both down-projections by rows)"
        )


def vllm_layout(spec: ModelSpec, parallel: ParallelLayout, world_size: int, *,
                convention: VLLMConvention | None = None, vllm_version: str | None = None) -> ShardLayout:
    """The vLLM inference layout, for one vLLM release series (see [Note: vLLM versions] in
    :mod:`hybridmem.reshard.vllm_versions`).

    Args:
        spec: The model.
        parallel: vLLM's tp/pp/ep.
        world_size: Ranks in all (replicas of ``tp * pp``).
        convention: vLLM options; its ``version``, when set, names the release.
        vllm_version: The release to follow (``"0.32"``, ``"0.33"``, or a full version string), for
            planning without that vLLM installed; ``None``: the convention's, else the installed vLLM's,
            else :data:`DEFAULT_VLLM_VERSION`.

    Raises:
        ValueError: an unsupported vLLM version (named, with the supported ones), ``vllm_version``
            and ``convention.version`` disagreeing, world size not divisible by tp*pp, heads or kv heads
            not divisible by tp (nor tp by kv heads when tp exceeds them), ffn or padded vocab (the
            per-layer input embeddings' too, and their layers' total width) not divisible, ep not dividing
            tp*dp or num_experts, pp > num_hidden_layers.
    """
    conv = convention or VLLMConvention()
    if vllm_version is not None and conv.version is not None and (
            resolve_vllm_version(vllm_version) != resolve_vllm_version(conv.version)):
        raise ValueError(f"vllm_version={vllm_version!r} disagrees with convention.version={conv.version!r}")
    conv = dataclasses.replace(conv, version=resolve_vllm_version(vllm_version or conv.version))
    dp = _check_world(parallel, world_size, "inference layout")
    tp, pp, ep = parallel.tp, parallel.pp, parallel.ep
    nq = spec.num_attention_heads
    if nq % tp:
        raise ValueError(f"inference tp={tp} does not divide num_attention_heads={nq}")
    for nkv in spec.kv_head_counts:
        if (tp >= nkv and tp % nkv) or (tp < nkv and nkv % tp):
            raise ValueError(f"inference tp={tp} and num_key_value_heads={nkv}: one must divide the other")
    if spec.linear_attention_layers and (spec.linear_num_key_heads % tp or spec.linear_num_value_heads % tp):
        raise ValueError(f"inference tp={tp} must divide linear_num_key_heads={spec.linear_num_key_heads} "
                         f"and linear_num_value_heads={spec.linear_num_value_heads} (vLLM splits the gated "
                         "delta-net by heads)")
    if pp > spec.num_hidden_layers:
        raise ValueError(f"inference pp={pp} exceeds num_hidden_layers={spec.num_hidden_layers}")
    # [Note: uneven stages] in :mod:`hybridmem.reshard.stages`: the split is fixed here, so a later change of
    # the environment cannot move it.
    conv = dataclasses.replace(conv, stage_layers=engine_stage_layers(conv.stage_layers,
                                                                      spec.num_hidden_layers, pp))
    padded = conv.padded_vocab(spec.vocab_size)
    if padded % tp:
        raise ValueError(f"inference tp={tp} does not divide the padded vocab {padded} "
                         f"(vocab_size={spec.vocab_size})")
    if spec.has_dense_layers and spec.intermediate_size % tp:
        raise ValueError(f"inference tp={tp} does not divide intermediate_size={spec.intermediate_size}")
    if spec.per_layer_inputs_size % tp:
        raise ValueError(f"inference tp={tp} does not divide num_hidden_layers * hidden_size_per_layer_input="
                         f"{spec.per_layer_inputs_size} (vLLM splits per_layer_model_projection by rows)")
    padded = conv.padded_vocab(spec.vocab_size_per_layer_input)
    if padded % tp:
        raise ValueError(f"inference tp={tp} does not divide the padded per-layer input vocab {padded} "
                         f"(vocab_size_per_layer_input={spec.vocab_size_per_layer_input})")
    if spec.is_moe:
        if (dp * tp) % ep or ep > spec.num_experts:
            raise ValueError(
                f"inference ep={ep} must divide dp*tp={dp}*{tp} and not exceed num_experts={spec.num_experts}"
            )
        moe_tp = 1 if ep > 1 else tp
        if spec.moe_intermediate_size % moe_tp or spec.shared_expert_intermediate_size % tp:
            raise ValueError(
                f"inference tp={tp} does not divide moe_intermediate_size={spec.moe_intermediate_size} "
                f"or shared_expert_intermediate_size={spec.shared_expert_intermediate_size}"
            )
    elif ep != 1:
        raise ValueError(f"ep={ep} given for a dense model")
    layout = ShardLayout(spec=spec, parallel=parallel, world_size=world_size, side=Side.VLLM, convention=conv)
    if conv.weight_block_size is not None:
        _check_fp8(layout)
    return layout


def _check_fp8(layout: ShardLayout) -> None:
    """An FP8 layout's family is one checked against vLLM's FP8 classes, and every quantized shard of the
    first replica's ranks (the others repeat them) is whole 128x128 blocks
    (:func:`~hybridmem.reshard.fp8.scale_of` raises naming the first that is not)."""
    spec = layout.spec
    if spec.family not in FP8_FAMILIES or spec.multimodal:
        raise ValueError(f"family={spec.family!r}: no FP8 layout (weight_block_size="
                         f"{list(layout.convention.weight_block_size)}); the families checked against vLLM's "
                         f"FP8 classes are {list(FP8_FAMILIES)}")
    if spec.is_mla and spec.q_lora_rank % FP8_BLOCK[0]:
        raise ValueError(f"q_lora_rank={spec.q_lora_rank} (family={spec.family!r}) is not a multiple of 128: "
                         "vLLM fuses q_a_proj and kv_a_proj_with_mqa into fused_qkv_a_proj, where a "
                         "128-block would hold rows of both, each scaled by its own checkpoint block, which "
                         "one block scale cannot hold; no FP8 layout")
    for rank in range(min(layout.world_size, layout.parallel.tp * layout.parallel.pp)):
        layout.tensors(rank)


def hf_layout(spec: ModelSpec, parallel: ParallelLayout, world_size: int, *,
              vllm_version: str | None = None, stage_layers: tuple[int, ...] | None = None) -> ShardLayout:
    """Full HF-named tensors of each inference pipeline stage on every rank of that stage (tp, ep ignored
    except in the rank order): the layout ``load_weights``-only engines take, and what vLLM's loaders of
    each stage accept: the stage's layers' tensors vLLM has (no DeepSeek-V3 router bias without
    ``noaux_tc``), and the embedding, final norm and head on the stages where the vLLM release
    (``vllm_version``, default: the installed one, see :func:`vllm_layout`) builds them: first and last
    stage, or every stage for the families it builds so (Qwen2-MoE, Qwen3-MoE). Stages split layers as
    the vLLM engine does (``stage_layers``, else ``VLLM_PP_LAYER_PARTITION``, else vLLM's own split)."""
    _check_world(parallel, world_size, "HF layout")
    if parallel.pp > spec.num_hidden_layers:
        raise ValueError(f"pp={parallel.pp} exceeds num_hidden_layers={spec.num_hidden_layers}")
    resolve_vllm_version(vllm_version)
    convention = HFConvention(every_stage=spec.description.vllm_every_stage,
                              stage_layers=engine_stage_layers(stage_layers,
                                                               spec.num_hidden_layers, parallel.pp))
    return ShardLayout(spec=spec, parallel=parallel, world_size=world_size,
                       side=Side.HF, convention=convention)
