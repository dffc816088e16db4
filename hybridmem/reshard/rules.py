"""The per-layer mapping as one table, :data:`LAYER_RULES`, and the kinds that build one row's tensors on one
rank.

Each row names the HF tensors (canonical names, see [Note: canonical names] in
:mod:`hybridmem.models.family`), the Megatron name, the vLLM name and the transform kind; :func:`build_rule`
gives a row's tensors on a rank of a layout (:mod:`hybridmem.reshard.layouts` assembles them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hybridmem.reshard.conventions import (
    HFConvention,
    MegatronConvention,
    RankCoords,
    Side,
    VLLMConvention,
)
from hybridmem.reshard.spec import ModelSpec
from hybridmem.reshard.transforms import (
    LocalTensor,
    Piece,
    block,
    chunk,
    concat,
    replicate,
    split,
    stack,
)

__all__ = ["LayerRule", "LAYER_RULES", "EXPERT_KINDS", "Shapes", "build_rule", "expert_range",
           "rotary_permuted", "vocab_rows", "vllm_loaded_hf_names"]


# The table.


@dataclass(frozen=True, slots=True)
class LayerRule:
    """One row of the per-layer mapping.

    ``hf`` are suffixes after ``model.layers.{i}.``; ``megatron`` after ``decoder.layers.{l}.`` (``l``
    the stage-local index); ``vllm`` after ``model.layers.{i}.``, or ``<field>``: that field of the
    release's :class:`VLLMNames` (see [Note: vLLM versions] in :mod:`hybridmem.reshard.vllm_versions`);
    ``None`` where that side has no such tensor (DeepSeek's fused ``q_a``/``kv_a`` in vLLM are two tensors in
    Megatron). ``{e}`` in an ``hf`` suffix is a global expert index, ``{j}`` in a Megatron name a local expert
    index. ``when(spec, i)`` says whether global layer ``i`` has the tensor.
    """

    hf: tuple[str, ...]
    megatron: str | None
    vllm: str | None
    kind: str
    when: Callable[[ModelSpec, int], bool] = field(default=lambda spec, i: True)
    megatron_te: str | None = None
    """Megatron name under the TE spec where it differs (fused norms)."""


def _gqa(spec: ModelSpec, i: int) -> bool:
    return not spec.is_mla and not spec.is_linear_attention_layer(i)


def _attention(spec: ModelSpec, i: int) -> bool:
    return not spec.is_linear_attention_layer(i)


def _linear_attention(spec: ModelSpec, i: int) -> bool:
    return spec.is_linear_attention_layer(i)


def _per_head_qk_norm(spec: ModelSpec, i: int) -> bool:
    return spec.qk_norm and not spec.description.qk_norm_all_heads and _attention(spec, i)


def _all_heads_qk_norm(spec: ModelSpec, i: int) -> bool:
    return spec.qk_norm and spec.description.qk_norm_all_heads and _attention(spec, i)


def _dense_mlp(spec: ModelSpec, i: int) -> bool:
    return not spec.is_moe_layer(i) or spec.description.dense_mlp_with_experts


def _dense_mlp_bias(spec: ModelSpec, i: int) -> bool:
    return spec.mlp_bias and not spec.is_moe_layer(i)


def _moe(spec: ModelSpec, i: int) -> bool:
    return spec.is_moe_layer(i)


def _split_experts(spec: ModelSpec, i: int) -> bool:
    d = spec.description
    return spec.is_moe_layer(i) and not d.experts_interleaved and not d.experts_fused_gate_up


def _fused_gate_up_experts(spec: ModelSpec, i: int) -> bool:
    return spec.is_moe_layer(i) and spec.description.experts_fused_gate_up


def _moe_norm(norm: str) -> Callable[[ModelSpec, int], bool]:
    return lambda spec, i: spec.is_moe_layer(i) and norm in spec.description.moe_norms


def _interleaved_experts(spec: ModelSpec, i: int) -> bool:
    return spec.is_moe_layer(i) and spec.description.experts_interleaved


def _shared(spec: ModelSpec, i: int) -> bool:
    return spec.is_moe_layer(i) and spec.shared_expert_intermediate_size > 0


def _extra_norm(norm: str) -> Callable[[ModelSpec, int], bool]:
    return lambda spec, i: norm in spec.description.extra_norms


def _mla_q_lora(spec: ModelSpec, i: int) -> bool:
    return spec.is_mla and spec.q_lora_rank > 0


def _mla_no_q_lora(spec: ModelSpec, i: int) -> bool:
    return spec.is_mla and not spec.q_lora_rank


def _mla(spec: ModelSpec, i: int) -> bool:
    return spec.is_mla


def _indexer(spec: ModelSpec, i: int) -> bool:
    return spec.is_mla and spec.description.sparse_attention_indexer


LAYER_RULES: tuple[LayerRule, ...] = (
    LayerRule(("input_layernorm.weight",), "input_layernorm.weight", "input_layernorm.weight", "replicate",
              megatron_te="self_attention.linear_qkv.layer_norm_weight"),
    LayerRule(("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
              "self_attention.linear_qkv.weight", "self_attn.qkv_proj.weight", "qkv", when=_gqa),
    LayerRule(("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
              "self_attention.linear_qkv.bias", "self_attn.qkv_proj.bias", "qkv",
              when=lambda s, i: s.qkv_bias and _attention(s, i)),
    LayerRule(("self_attn.q_norm.weight",), "self_attention.q_layernorm.weight", "self_attn.q_norm.weight",
              "replicate", when=_per_head_qk_norm),
    LayerRule(("self_attn.k_norm.weight",), "self_attention.k_layernorm.weight", "self_attn.k_norm.weight",
              "replicate", when=_per_head_qk_norm),
    # MiniMax-M2: one norm over all heads, split by heads as q_proj's and k_proj's rows (no Megatron form).
    LayerRule(("self_attn.q_norm.weight",), None, "self_attn.q_norm.weight",
              "column", when=_all_heads_qk_norm),
    LayerRule(("self_attn.k_norm.weight",), None, "self_attn.k_norm.weight",
              "kv_rows", when=_all_heads_qk_norm),
    # DeepSeek MLA. Megatron's local spec makes both down-projections column-parallel; vLLM keeps them
    # whole on every rank, q_a and kv_a fused into one tensor ([q_a; kv_a_with_mqa]).
    LayerRule(("self_attn.q_a_proj.weight",), "self_attention.linear_q_down_proj.weight", None, "column",
              when=_mla_q_lora),
    LayerRule(("self_attn.kv_a_proj_with_mqa.weight",), "self_attention.linear_kv_down_proj.weight", None,
              "column", when=_mla),
    LayerRule(("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"), None,
              "self_attn.fused_qkv_a_proj.weight", "concat", when=_mla_q_lora),
    LayerRule(("self_attn.kv_a_proj_with_mqa.weight",), None, "self_attn.kv_a_proj_with_mqa.weight",
              "replicate", when=_mla_no_q_lora),
    LayerRule(("self_attn.q_a_layernorm.weight",), "self_attention.q_layernorm.weight",
              "self_attn.q_a_layernorm.weight", "replicate", when=_mla_q_lora),
    LayerRule(("self_attn.q_b_proj.weight",), "self_attention.linear_q_up_proj.weight",
              "self_attn.q_b_proj.weight", "column", when=_mla_q_lora),
    LayerRule(("self_attn.q_proj.weight",), "self_attention.linear_q_proj.weight", "self_attn.q_proj.weight",
              "column", when=_mla_no_q_lora),
    LayerRule(("self_attn.kv_a_layernorm.weight",), "self_attention.kv_layernorm.weight",
              "self_attn.kv_a_layernorm.weight", "replicate", when=_mla),
    LayerRule(("self_attn.kv_b_proj.weight",), "self_attention.linear_kv_up_proj.weight",
              "self_attn.kv_b_proj.weight", "column", when=_mla),
    # DeepSeek sparse attention's indexer: vLLM keeps it whole on every rank, wk and weights_proj fused into
    # one tensor ([wk; weights_proj]); no Megatron form.
    LayerRule(("self_attn.indexer.wq_b.weight",), None, "self_attn.indexer.wq_b.weight",
              "replicate", when=_indexer),
    LayerRule(("self_attn.indexer.wk.weight", "self_attn.indexer.weights_proj.weight"), None,
              "self_attn.indexer.wk_weights_proj.weight", "concat", when=_indexer),
    *(LayerRule((f"self_attn.indexer.k_norm.{t}",), None, f"self_attn.indexer.k_norm.{t}",
                "replicate", when=_indexer)
      for t in ("weight", "bias")),
    LayerRule(("self_attn.sinks",), None, "self_attn.sinks", "column",
              when=lambda s, i: s.description.attention_sinks),
    LayerRule(("self_attn.o_proj.weight",), "self_attention.linear_proj.weight", "self_attn.o_proj.weight",
              "row", when=_attention),
    LayerRule(("self_attn.o_proj.bias",), "self_attention.linear_proj.bias", "self_attn.o_proj.bias",
              "replicate", when=lambda s, i: s.o_bias and _attention(s, i)),
    # Qwen3.5's gated delta-net layers (no Megatron form). vLLM fuses [q; k; v; z] and [b; a] into one
    # projection each, and every TP rank holds its rows of each part in turn (the checkpoint's in_proj_qkv is
    # [q; k; v]: canonically three tensors); the depthwise convolution over [q; k; v] is split the same way.
    LayerRule(tuple(f"linear_attn.in_proj_{x}.weight" for x in "qkvz"), None,
              "linear_attn.in_proj_qkvz.weight", "gate_up", when=_linear_attention),
    LayerRule(("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"), None,
              "linear_attn.in_proj_ba.weight", "gate_up", when=_linear_attention),
    LayerRule(tuple(f"linear_attn.conv1d_{x}.weight" for x in "qkv"), None, "linear_attn.conv1d.weight",
              "gate_up", when=_linear_attention),
    LayerRule(("linear_attn.dt_bias",), None, "linear_attn.dt_bias", "column", when=_linear_attention),
    LayerRule(("linear_attn.A_log",), None, "linear_attn.A_log", "column", when=_linear_attention),
    LayerRule(("linear_attn.norm.weight",), None, "linear_attn.norm.weight",
              "replicate", when=_linear_attention),
    LayerRule(("linear_attn.out_proj.weight",), None, "linear_attn.out_proj.weight",
              "row", when=_linear_attention),
    LayerRule(("post_attention_layernorm.weight",), "pre_mlp_layernorm.weight",
              "post_attention_layernorm.weight", "replicate", megatron_te="mlp.linear_fc1.layer_norm_weight"),
    # Gemma 3's sandwich norms (no Megatron equivalent: such a family is refused by megatron_layout).
    *(LayerRule((norm,), None, norm, "replicate", when=_extra_norm(norm))
      for norm in ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")),
    # Gemma 4's per-layer scalar: a buffer in transformers and vLLM that the loaders fill.
    LayerRule(("layer_scalar",), None, "layer_scalar", "replicate",
              when=lambda s, i: s.description.layer_scalar),
    # Gemma 4's per-layer input embeddings: each layer's gate, projection and norm, whole on every rank
    # (vLLM's ReplicatedLinear); no Megatron form.
    *(LayerRule((name,), None, name, "replicate", when=lambda s, i: s.hidden_size_per_layer_input > 0)
      for name in ("per_layer_input_gate.weight", "per_layer_projection.weight",
                   "post_per_layer_input_norm.weight")),
    # Dense MLP (every layer of a dense family; DeepSeek-V3's first k layers).
    LayerRule(("mlp.gate_proj.weight", "mlp.up_proj.weight"), "mlp.linear_fc1.weight",
              "mlp.gate_up_proj.weight", "gate_up", when=_dense_mlp),
    LayerRule(("mlp.gate_proj.bias", "mlp.up_proj.bias"), "mlp.linear_fc1.bias", "mlp.gate_up_proj.bias",
              "gate_up", when=_dense_mlp_bias),
    LayerRule(("mlp.down_proj.weight",), "mlp.linear_fc2.weight",
              "mlp.down_proj.weight", "row", when=_dense_mlp),
    # A row-parallel bias is whole on every TP rank (vLLM adds it on TP rank 0 only).
    LayerRule(("mlp.down_proj.bias",), "mlp.linear_fc2.bias", "mlp.down_proj.bias",
              "replicate", when=_dense_mlp_bias),
    # MoE: the TE spec keeps pre_mlp_layernorm unfused for MoE layers.
    LayerRule(("mlp.gate.weight",), "mlp.router.weight", "mlp.gate.weight", "replicate", when=_moe),
    # Gemma 4: the router's input and per-expert scales, and the norms around its experts.
    *(LayerRule((f"mlp.gate.{scale}",), None, f"mlp.gate.{scale}", "replicate",
                when=lambda s, i: s.is_moe_layer(i) and s.description.router_scales)
      for scale in ("scale", "per_expert_scale")),
    *(LayerRule((norm,), None, norm, "replicate", when=_moe_norm(norm))
      for norm in ("pre_feedforward_layernorm_2.weight", "post_feedforward_layernorm_1.weight",
                   "post_feedforward_layernorm_2.weight")),
    # A persistent fp32 buffer in HF and Megatron, a parameter in vLLM, which has it only for noaux_tc
    # routing.
    LayerRule(("mlp.gate.e_score_correction_bias",), "mlp.router.expert_bias", None, "replicate",
              when=lambda s, i: s.is_moe_layer(i) and s.has_router_bias),
    LayerRule(("mlp.gate.e_score_correction_bias",), None, "mlp.gate.e_score_correction_bias", "replicate",
              when=lambda s, i: s.is_moe_layer(i) and s.vllm_router_bias),
    LayerRule(("mlp.gate.bias",), None, "mlp.gate.bias", "replicate",
              when=lambda s, i: s.is_moe_layer(i) and s.description.router_linear_bias),
    LayerRule(("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
              "mlp.experts.local_experts.{j}.linear_fc1.weight", "<experts_w13>", "experts_gate_up",
              when=_split_experts),
    # gpt-oss: one interleaved gate/up tensor per expert, contiguous row blocks per TP rank; the down bias is
    # whole on MoE-TP rank 0 of every stage and zero (no piece: padding) on the others; with expert
    # parallelism MoE-TP is 1, so every rank holds its experts' biases whole.
    LayerRule(("mlp.experts.{e}.gate_up_proj.weight",), None, "<experts_w13>", "experts_column",
              when=_interleaved_experts),
    # Gemma 4: one expert's [gate; up] in one tensor; each MoE-TP rank takes its rows of either half.
    LayerRule(("mlp.experts.{e}.gate_up_proj.weight",), None, "<experts_w13>", "experts_gate_up",
              when=_fused_gate_up_experts),
    LayerRule(("mlp.experts.{e}.gate_up_proj.bias",), None, "<experts_w13_bias>", "experts_column",
              when=_interleaved_experts),
    LayerRule(("mlp.experts.{e}.down_proj.bias",), None, "<experts_w2_bias>", "experts_first_rank",
              when=_interleaved_experts),
    LayerRule(("mlp.experts.{e}.down_proj.weight",), "mlp.experts.local_experts.{j}.linear_fc2.weight",
              "<experts_w2>", "experts_row", when=_moe),
    # {shared}: the family's shared-expert module name (shared_expert, shared_experts).
    LayerRule(("mlp.{shared}.gate_proj.weight", "mlp.{shared}.up_proj.weight"),
              "mlp.shared_experts.linear_fc1.weight",
              "mlp.{shared}.gate_up_proj.weight", "gate_up", when=_shared),
    LayerRule(("mlp.{shared}.down_proj.weight",), "mlp.shared_experts.linear_fc2.weight",
              "mlp.{shared}.down_proj.weight", "row", when=_shared),
    LayerRule(("mlp.shared_expert_gate.weight",), "mlp.shared_experts.gate_weight",
              "mlp.shared_expert_gate.weight",
              "replicate", when=lambda s, i: s.is_moe_layer(i) and s.has_shared_expert_gate),
)


# ----------------------------------------------------------------------------------------------------
# Kinds: each builds {name: LocalTensor} for one rule on one rank.

Shapes = dict[str, tuple[int, ...]]


def _qkv(side: Side, spec: ModelSpec, hf: tuple[str, ...], shapes: Shapes,
         c: RankCoords, layer: int) -> LocalTensor:
    q, k, v = hf
    if spec.values_from_keys(layer):
        v = k  # no v_proj: the value rows are the key projection's (Gemma 4's attention_k_eq_v)
    (hd, nkv), nq, tp = spec.attention_dims(layer), spec.num_attention_heads, c.tp
    if side is Side.MEGATRON:
        # Rows per query group g: [q heads of g; k_g; v_g]; TP splits whole groups.
        lo, hi = chunk(nkv, c.tp_rank, tp, what="query groups (num_key_value_heads)")
        per = nq // nkv
        parts = []
        for g in range(lo, hi):
            parts += [block(q, shapes[q], g * per * hd, (g + 1) * per * hd),
                      block(k, shapes[k], g * hd, (g + 1) * hd), block(v, shapes[v], g * hd, (g + 1) * hd)]
        return concat(parts)
    # vLLM QKVParallelLinear: [q_r; k_r; v_r], kv heads replicated when tp > num_kv_heads; with an output
    # gate a query head's rows are [q_h; gate_h] (Qwen3.5), split by heads alike.
    q_lo, q_hi = chunk(nq, c.tp_rank, tp, what="num_attention_heads")
    qh = 2 * hd if spec.description.attention_output_gate else hd
    if tp >= nkv:
        if tp % nkv:
            raise ValueError(f"inference tp={tp} is not a multiple of num_key_value_heads={nkv}")
        kv_lo = c.tp_rank // (tp // nkv)
        kv_hi = kv_lo + 1
    else:
        kv_lo, kv_hi = chunk(nkv, c.tp_rank, tp, what="num_key_value_heads")
    return concat([block(q, shapes[q], q_lo * qh, q_hi * qh), block(k, shapes[k], kv_lo * hd, kv_hi * hd),
                   block(v, shapes[v], kv_lo * hd, kv_hi * hd)])


def _kv_rows(spec: ModelSpec, name: str, shapes: Shapes, c: RankCoords) -> LocalTensor:
    """Rows of a [num_key_value_heads * head_dim] tensor split by kv heads as vLLM splits k_proj's: a run of
    heads per TP rank, or, with more ranks than kv heads, the one head ``tp // num_key_value_heads``
    consecutive ranks share (MiniMax-M2's k_norm)."""
    hd, nkv, tp = spec.head_dim, spec.num_key_value_heads, c.tp
    if tp >= nkv:
        if tp % nkv:
            raise ValueError(f"inference tp={tp} is not a multiple of num_key_value_heads={nkv}")
        lo = c.tp_rank // (tp // nkv)
        return block(name, shapes[name], lo * hd, (lo + 1) * hd)
    lo, hi = chunk(nkv, c.tp_rank, tp, what="num_key_value_heads")
    return block(name, shapes[name], lo * hd, hi * hd)


def rotary_permuted(local: LocalTensor, names: tuple[str, ...], head_dim: int) -> LocalTensor:
    """``local`` with the rows of each q and k head (``names``, canonical) reordered as vLLM's Llama 4 loader
    reorders them before splitting: row ``2i + j`` of a head goes to ``j * head_dim / 2 + i``. Every piece of
    q or k covers whole heads; it becomes one piece per row."""
    half, pieces = head_dim // 2, []
    for p in local.pieces:
        if p.hf_name not in names:
            pieces.append(p)
            continue
        (a, b), rest = p.src[0], p.src[1:]
        for row in range(a, b):
            o = row % head_dim
            dst = p.dst_start[0] + (row - o - a) + (o % 2) * half + o // 2
            pieces.append(Piece(p.hf_name, ((row, row + 1), *rest), p.dst_prefix, (dst, *p.dst_start[1:])))
    return LocalTensor(local.shape, tuple(pieces))


def _gate_up(hf: tuple[str, ...], shapes: Shapes, rank: int, num: int) -> LocalTensor:
    return concat([split(name, shapes[name], axis=0, rank=rank, num=num) for name in hf])


def _halves(name: str, shapes: Shapes, rank: int, num: int) -> LocalTensor:
    """Rank ``rank``'s rows of each half of ``name`` ([gate; up] in one tensor), as :func:`_gate_up` takes
    them of two tensors."""
    rows = shapes[name][0] // 2
    lo, hi = chunk(rows, rank, num, what=f"rows of either half of {name}")
    return concat([block(name, shapes[name], lo, hi), block(name, shapes[name], rows + lo, rows + hi)])


def vocab_rows(side: Side, spec: ModelSpec, conv: MegatronConvention | VLLMConvention, c: RankCoords) -> int:
    """The padded vocabulary rows over all TP ranks as ``side`` holds them."""
    v = spec.vocab_size
    if side is Side.MEGATRON and conv.padded_vocab_size is not None:
        if conv.padded_vocab_size < v or conv.padded_vocab_size % c.tp:
            raise ValueError(
                f"Megatron padded_vocab_size={conv.padded_vocab_size} must be >= vocab_size={v} and "
                f"divisible by tp={c.tp}"
            )
        return conv.padded_vocab_size
    if side is not Side.MEGATRON:
        return conv.padded_vocab(v)
    multiple = conv.make_vocab_size_divisible_by * c.tp
    return -(-v // multiple) * multiple


def expert_range(num_experts: int, ep_rank: int, ep: int) -> tuple[int, int]:
    """Contiguous experts of ``ep_rank``: vLLM's "linear" placement (``determine_expert_map``), where the
    first ``num_experts % ep`` ranks take one extra expert; Megatron requires ``ep | num_experts``, for
    which both rules agree."""
    base, extra = divmod(num_experts, ep)
    start = ep_rank * base + min(ep_rank, extra)
    return start, start + base + (1 if ep_rank < extra else 0)


EXPERT_KINDS = frozenset({"experts_gate_up", "experts_row", "experts_column", "experts_first_rank"})
"""The :class:`LayerRule` kinds of routed experts: the expert part."""


def build_rule(rule: LayerRule, spec: ModelSpec, side: Side,
               convention: MegatronConvention | VLLMConvention | HFConvention,
               c: RankCoords, layer: int, local_layer: int, shapes: Shapes) -> dict[str, LocalTensor]:
    """Rule ``rule``'s tensors, by name, on the rank at ``c`` of global layer ``layer`` (``local_layer`` on
    its stage) of a ``side`` layout with ``convention``; empty where that side has no such tensor."""
    hf_prefix = f"model.layers.{layer}."
    if side is Side.MEGATRON:
        te_name = (convention.norm_style == "te" and rule.megatron_te
                   and not (spec.is_moe_layer(layer) and rule.megatron_te.startswith("mlp.")))
        name = rule.megatron_te if te_name else rule.megatron
        prefix = f"decoder.layers.{local_layer}."
    else:
        name, prefix = rule.vllm, hf_prefix
        if name is not None and name.startswith("<"):
            name = getattr(convention.names, name[1:-1])
        if name is not None:
            name = spec.description.vllm_suffix(name.format(shared=spec.shared_expert_name))
    if name is None:
        return {}
    hf = tuple(hf_prefix + s.replace("{shared}", spec.shared_expert_name) for s in rule.hf)
    if rule.kind == "replicate":
        return {prefix + name: replicate(hf[0], shapes[hf[0]])}
    if rule.kind == "concat":
        return {prefix + name: concat([replicate(n, shapes[n]) for n in hf])}
    if rule.kind == "column":
        return {prefix + name: split(hf[0], shapes[hf[0]], axis=0, rank=c.tp_rank, num=c.tp)}
    if rule.kind == "qkv":
        return {prefix + name: _qkv(side, spec, hf, shapes, c, layer)}
    if rule.kind == "kv_rows":
        return {prefix + name: _kv_rows(spec, hf[0], shapes, c)}
    if rule.kind == "row":
        return {prefix + name: split(hf[0], shapes[hf[0]], axis=1, rank=c.tp_rank, num=c.tp)}
    if rule.kind == "gate_up":
        return {prefix + name: _gate_up(hf, shapes, c.tp_rank, c.tp)}
    if rule.kind in ("experts_gate_up", "experts_row", "experts_column", "experts_first_rank"):
        lo, hi = expert_range(spec.num_experts, c.ep_rank, c.ep)
        parts = []
        for e in range(lo, hi):
            names = tuple(s.format(e=e) for s in hf)
            if rule.kind == "experts_gate_up" and len(names) == 1:
                parts.append(_halves(names[0], shapes, c.moe_tp_rank, c.moe_tp))
            elif rule.kind == "experts_gate_up":
                parts.append(_gate_up(names, shapes, c.moe_tp_rank, c.moe_tp))
            elif rule.kind == "experts_column":
                parts.append(split(names[0], shapes[names[0]], axis=0, rank=c.moe_tp_rank, num=c.moe_tp))
            elif rule.kind == "experts_first_rank":
                whole = replicate(names[0], shapes[names[0]])
                parts.append(whole if c.moe_tp_rank == 0 else LocalTensor(whole.shape, ()))
            else:
                parts.append(split(names[0], shapes[names[0]], axis=1, rank=c.moe_tp_rank, num=c.moe_tp))
        if side is Side.MEGATRON:
            return {prefix + name.format(j=j): part for j, part in enumerate(parts)}
        return {prefix + name: stack(parts)}
    raise ValueError(f"unknown rule kind {rule.kind!r}")


def vllm_loaded_hf_names(spec: ModelSpec, layer: int) -> list[str]:
    """The HF names of layer ``layer``'s tensors that vLLM loads (rows of :data:`LAYER_RULES` with a vLLM
    name that apply to the layer), experts expanded."""
    names, shapes = [], spec.canonical_shapes()
    for rule in LAYER_RULES:
        if rule.vllm is None or not rule.when(spec, layer):
            continue
        for suffix in rule.hf:
            suffix = suffix.replace("{shared}", spec.shared_expert_name)
            experts = range(spec.num_experts) if "{e}" in suffix else (None,)
            names += [f"model.layers.{layer}." + suffix.format(e=e) for e in experts]
    # A tensor of a row the layer lacks (Gemma 4's v_proj where values are the keys) is not sent.
    return [name for name in names if name in shapes]
