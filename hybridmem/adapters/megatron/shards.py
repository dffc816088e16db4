"""What the resharding engine needs from Megatron: names, shard specs, the source layout, model shapes.

All of it is read from Megatron's own attributes rather than re-derived from names:

- per parameter: ``tensor_model_parallel`` (is it split over TP), ``partition_dim`` (which dim),
  ``partition_stride`` (interleaving; 1 for every layer of a GPTModel), ``allreduce`` (``False`` for
  expert params, which are split over EP and reduced over the expert data-parallel group);
- per layer: ``TransformerLayer.layer_number`` (1-based, global over pipeline stages);
- per expert: ``MoELayer.local_expert_indices`` (global index of each local expert);
- the ``TransformerConfig``: ``num_attention_heads``, ``num_query_groups``, ``kv_channels``,
  ``ffn_hidden_size``, ``gated_linear_unit``, ``num_moe_experts``, ``moe_ffn_hidden_size``;
- the ranks and sizes: ``megatron.core.parallel_state``.

[Note: Megatron fused layouts]
Two Megatron tensors are fused in a way a plain split does not describe. ``linear_qkv.weight`` is, per
query group, ``[q heads of the group; k; v]`` stacked on dim 0 (so a TP shard holds whole groups);
``fused="qkv"``. ``linear_fc1.weight`` with ``gated_linear_unit`` holds, on each TP rank, ``[gate
shard; up shard]`` (each half split separately, then concatenated); ``fused="gate_up"``. A consumer
must undo these per rank before concatenating shards.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ShardSpec",
    "MegatronSourceLayout",
    "unwrap_model",
    "megatron_named_weights",
    "megatron_shard_specs",
    "megatron_source_layout",
    "megatron_model_spec_dict",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardSpec:
    """How one of this rank's Megatron parameters relates to the full tensor."""

    name: str
    """Megatron name on this rank (no DDP ``module.`` prefix; layer and expert numbers local)."""
    global_name: str
    """The same name with the global layer number and global expert index."""
    local_shape: tuple[int, ...]
    """Shape on this rank."""
    global_shape: tuple[int, ...]
    """Shape of the full tensor (``local_shape`` times ``num_shards`` along ``partition_dim``)."""
    partition_dim: int | None
    """Dimension split over tensor parallelism; ``None`` if replicated."""
    partition_stride: int
    """Megatron's ``partition_stride`` (1: contiguous blocks)."""
    num_shards: int
    """Ranks the tensor is split over (TP size, or the expert TP size for experts); 1 if replicated."""
    shard_index: int
    """This rank's block along ``partition_dim``."""
    is_expert: bool
    """An expert parameter (``allreduce=False``): split over EP, one expert per tensor."""
    expert_index: int | None = None
    """Global expert index, for expert parameters."""
    layer_index: int | None = None
    """Global 0-based layer index, for decoder-layer parameters."""
    fused: str | None = None
    """``"qkv"`` or ``"gate_up"`` (see [Note: Megatron fused layouts]); ``None`` otherwise."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronSourceLayout:
    """This rank's place in Megatron's parallel layout."""

    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    ep: int
    """Expert-parallel size."""
    dp: int
    """Data-parallel size."""
    etp: int
    """Expert tensor-parallel size."""
    tp_rank: int
    pp_rank: int
    ep_rank: int
    dp_rank: int
    etp_rank: int


def unwrap_model(chunk: Any) -> Any:
    """The ``GPTModel`` under DDP / Float16Module wrappers (each keeps the wrapped one in ``.module``)."""
    seen = 0
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
        seen += 1
        if seen > 8:
            raise TypeError(f"model chunk nests more than 8 '.module' wrappers ({type(chunk).__name__})")
    return chunk


def _prefix(i: int, num_chunks: int) -> str:
    # Megatron's checkpoints name virtual-pipeline chunks model0, model1, ...; a single chunk has none.
    return "" if num_chunks == 1 else f"model{i}."


def megatron_named_weights(model_chunks: Iterable[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's parameters by Megatron name (as its state dict, without DDP's ``module.``), and the
    routers' ``expert_bias`` buffers (DeepSeek-V3's routing-score correction: persistent, updated outside
    the optimizer every step, so the engine needs it like a weight)."""
    chunks = list(model_chunks)
    for i, chunk in enumerate(chunks):
        model = unwrap_model(chunk)
        for name, p in model.named_parameters():
            yield _prefix(i, len(chunks)) + name, p
        for name, b in model.named_buffers():
            if name.endswith("router.expert_bias"):
                yield _prefix(i, len(chunks)) + name, b


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")


def _layer_numbers(model: Any) -> dict[int, int]:
    """Local layer index -> global 0-based layer index, from ``TransformerLayer.layer_number``."""
    layers = getattr(getattr(model, "decoder", None), "layers", None) or []
    return {i: int(layer.layer_number) - 1 for i, layer in enumerate(layers)}


def _expert_offset(model: Any, local_layer: int) -> int:
    """Global index of this rank's first expert in a layer: ``MoELayer.local_expert_indices[0]``
    (0.16 and 0.19), else ``ep_rank * experts.num_local_experts``."""
    mlp = getattr(model.decoder.layers[local_layer], "mlp", None)
    indices = getattr(mlp, "local_expert_indices", None)
    if indices:
        return int(indices[0])
    num_local = int(getattr(getattr(mlp, "experts", None), "num_local_experts", 0))
    from megatron.core import parallel_state  # noqa: PLC0415 - Megatron is optional

    return parallel_state.get_expert_model_parallel_rank() * num_local


def megatron_shard_specs(model_chunks: Iterable[Any]) -> dict[str, ShardSpec]:
    """A :class:`ShardSpec` for each of this rank's parameters, keyed by Megatron name.

    Call after ``parallel_state.initialize_model_parallel`` (the ranks come from it).
    """
    from megatron.core import parallel_state  # noqa: PLC0415 - Megatron is optional

    tp, tp_rank = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_tensor_model_parallel_rank())
    etp = _call(parallel_state, "get_expert_tensor_parallel_world_size", tp)
    etp_rank = _call(parallel_state, "get_expert_tensor_parallel_rank", tp_rank)
    chunks = list(model_chunks)
    specs: dict[str, ShardSpec] = {}
    for i, chunk in enumerate(chunks):
        model = unwrap_model(chunk)
        config = model.config
        layer_map = _layer_numbers(model)
        for name, p in model.named_parameters():
            is_expert = not getattr(p, "allreduce", True)
            split = bool(getattr(p, "tensor_model_parallel", False))
            size, rank = (etp, etp_rank) if is_expert else (tp, tp_rank)
            dim = int(p.partition_dim) if split and size > 1 else None
            shape = tuple(p.shape)
            global_shape = (shape if dim is None
                            else tuple(n * size if d == dim else n for d, n in enumerate(shape)))
            global_name, layer_index, expert_index = name, None, None
            m = _LAYER.match(name)
            if m:
                local_layer = int(m.group(1))
                layer_index = layer_map.get(local_layer, local_layer)
                global_name = _LAYER.sub(f"decoder.layers.{layer_index}.", global_name, count=1)
                e = _LOCAL_EXPERT.search(name)
                if e:
                    expert_index = _expert_offset(model, local_layer) + int(e.group(1))
                    global_name = _LOCAL_EXPERT.sub(f".experts.local_experts.{expert_index}.", global_name,
                                                    count=1)
            fused = None
            if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
                fused = "qkv"
            elif "linear_fc1." in name and config.gated_linear_unit:
                fused = "gate_up"
            full = _prefix(i, len(chunks)) + name
            specs[full] = ShardSpec(
                name=full,
                global_name=_prefix(i, len(chunks)) + global_name,
                local_shape=shape,
                global_shape=global_shape,
                partition_dim=dim,
                partition_stride=int(getattr(p, "partition_stride", 1)),
                num_shards=size if dim is not None else 1,
                shard_index=rank if dim is not None else 0,
                is_expert=is_expert,
                expert_index=expert_index,
                layer_index=layer_index,
                fused=fused,
            )
    return specs


def _call(module: Any, name: str, default: int) -> int:
    fn = getattr(module, name, None)
    return int(fn()) if callable(fn) else default


def megatron_source_layout() -> MegatronSourceLayout:
    """This rank's sizes and ranks from ``megatron.core.parallel_state``."""
    from megatron.core import parallel_state as ps  # noqa: PLC0415 - Megatron is optional

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    return MegatronSourceLayout(
        tp=tp,
        pp=ps.get_pipeline_model_parallel_world_size(),
        ep=_call(ps, "get_expert_model_parallel_world_size", 1),
        dp=ps.get_data_parallel_world_size(),
        etp=_call(ps, "get_expert_tensor_parallel_world_size", tp),
        tp_rank=tp_rank,
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=_call(ps, "get_expert_model_parallel_rank", 0),
        dp_rank=ps.get_data_parallel_rank(),
        etp_rank=_call(ps, "get_expert_tensor_parallel_rank", tp_rank),
    )


def _first_dense_layers(config: Any) -> int:
    """Leading dense layers of ``moe_layer_freq`` (1: none; a 0/1 list: its leading zeros, the rest all 1)."""
    freq = getattr(config, "moe_layer_freq", 1)
    if freq in (1, None):
        return 0
    if isinstance(freq, (list, tuple)) and set(freq) <= {0, 1}:
        k = next((i for i, v in enumerate(freq) if v), len(freq))
        if all(freq[k:]):
            return k
    raise ValueError(f"moe_layer_freq={freq!r} is not supported; expected 1 or a list of k zeros then ones "
                     f"(the first k layers dense)")


def megatron_model_spec_dict(config: Any, *, vocab_size: int, tie_word_embeddings: bool = False,
                             model_type: str | None = None) -> dict[str, Any]:
    """The HF-style config dict (``hybridmem.reshard``'s ``ModelSpec.from_hf_config`` input) of a
    ``TransformerConfig``.

    A GPTModel does not say which HF family it is; the names vLLM loads depend on it. ``model_type`` (the
    inference engine's, e.g. ``"mixtral"``, ``"glm4_moe"``, ``"qwen3"``) names the family; the dict then
    carries every key the families' config readers (:mod:`hybridmem.models`) take, and the spec the
    family reads from it must describe the same tensors as the ``TransformerConfig`` (q/k/v biases, q/k
    norms, experts, their widths, shared experts, router bias, leading dense layers), else a
    ``ValueError`` names each difference. Without ``model_type`` the family is the one the structure gives
    (:func:`hybridmem.models.structural_model_type`: Llama, Qwen2 with ``add_qkv_bias``, Qwen2-MoE for an MoE
    model without a shared expert, DeepSeek-V3 with multi-latent attention).

    Raises:
        ValueError: The config uses something no family here expresses (biases other than q/k/v, a
            non-gated MLP, MoE on a pattern other than leading dense layers), the family cannot be
            trained in Megatron-core, or the family's tensors differ from the config's.
    """
    from hybridmem.models import structural_model_type  # noqa: PLC0415

    unsupported = []
    mla = bool(getattr(config, "multi_latent_attention", False))
    if getattr(config, "add_bias_linear", False):
        unsupported.append("add_bias_linear=True")
    if getattr(config, "qk_layernorm", False) and model_type is None and not mla:  # MLA: its latent norms
        unsupported.append("qk_layernorm=True (name the family: model_type=)")
    if not config.gated_linear_unit:
        unsupported.append("gated_linear_unit=False")
    if getattr(config, "moe_layer_freq", 1) not in (1, None) and model_type is None and not mla:
        unsupported.append(f"moe_layer_freq={config.moe_layer_freq!r}")
    if unsupported:
        raise ValueError(f"TransformerConfig options without an HF-family equivalent: {unsupported}")
    heads = int(config.num_attention_heads)
    qkv_bias = bool(getattr(config, "add_qkv_bias", False))
    out: dict[str, Any] = {
        "model_type": structural_model_type(mla=False, moe=bool(config.num_moe_experts), qkv_bias=qkv_bias),
        "hidden_size": int(config.hidden_size),
        "num_attention_heads": heads,
        "num_key_value_heads": int(config.num_query_groups or heads),
        "head_dim": int(config.kv_channels or config.hidden_size // heads),
        "intermediate_size": int(config.ffn_hidden_size),
        "num_hidden_layers": int(config.num_layers),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": bool(tie_word_embeddings),
        "rms_norm_eps": float(config.layernorm_epsilon),
        "attention_bias": qkv_bias,
        "qkv_bias": qkv_bias,
    }
    if config.num_moe_experts:
        out.update(
            num_experts=int(config.num_moe_experts),
            moe_intermediate_size=int(config.moe_ffn_hidden_size or config.ffn_hidden_size),
            num_experts_per_tok=int(config.moe_router_topk),
            shared_expert_intermediate_size=0,
        )
    if mla:
        out.update(_mla_fields(config))
        model_type = model_type or structural_model_type(mla=True, moe=bool(config.num_moe_experts),
                                                         qkv_bias=qkv_bias)
    if model_type is None:
        return out
    return _family_spec_dict(config, out, model_type)


def _mla_fields(config: Any) -> dict[str, Any]:
    """DeepSeek-V3's HF config keys of an ``MLATransformerConfig``: the latent ranks and head widths
    (``qk_head_dim`` is the part without RoPE, ``qk_pos_emb_head_dim`` the RoPE part), and ``topk_method``
    ``"noaux_tc"`` when the router carries its expert bias (``moe_router_enable_expert_bias``)."""
    nope, rope = int(config.qk_head_dim), int(config.qk_pos_emb_head_dim)
    return {
        "q_lora_rank": int(config.q_lora_rank) if config.q_lora_rank else None,
        "kv_lora_rank": int(config.kv_lora_rank),
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": int(config.v_head_dim),
        "head_dim": nope + rope,
        "num_key_value_heads": int(config.num_attention_heads),
        "topk_method": "noaux_tc" if getattr(config, "moe_router_enable_expert_bias", False) else "greedy",
    }


def _family_spec_dict(config: Any, out: dict[str, Any], model_type: str) -> dict[str, Any]:
    """``out`` for the family of ``model_type``, checked against the ``TransformerConfig``."""
    from hybridmem.models import get_family  # noqa: PLC0415
    from hybridmem.reshard import ModelSpec  # noqa: PLC0415

    family = get_family(model_type)
    if family.megatron is not None:
        raise ValueError(f"model_type={model_type!r} cannot be trained in Megatron-core: {family.megatron}")
    if model_type in family.multimodal_types:
        raise ValueError(f"model_type={model_type!r} cannot be trained in Megatron-core: a multimodal model, "
                         f"and hybridmem's Megatron names are those of a text model alone ({family.name!r})")
    experts = int(config.num_moe_experts or 0)
    width = int(config.moe_ffn_hidden_size or config.ffn_hidden_size) if experts else 0
    shared = int(getattr(config, "moe_shared_expert_intermediate_size", None) or 0)
    first_dense = _first_dense_layers(config) if experts else 0
    out = dict(out, model_type=model_type, use_qk_norm=bool(getattr(config, "qk_layernorm", False)))
    if experts:
        out.update(num_local_experts=experts, n_routed_experts=experts,
                   shared_expert_intermediate_size=shared,
                   n_shared_experts=shared // width if width else 0, first_k_dense_replace=first_dense)
        if not first_dense:
            # No dense layer: intermediate_size is free to carry one expert's width, where a family's config
            # (Mixtral's) names it so.
            out["intermediate_size"] = width
    spec = ModelSpec.from_hf_config(out)
    pairs = (  # (what, the Megatron config's, the family's spec's)
        ("multi-latent attention (multi_latent_attention)",
         bool(getattr(config, "multi_latent_attention", False)), spec.is_mla),
        ("q/k/v bias (add_qkv_bias)", bool(getattr(config, "add_qkv_bias", False)), spec.qkv_bias),
        # A Llama's attention_bias also gives its output projection a bias, which add_qkv_bias does not.
        ("output-projection bias (add_bias_linear)", bool(getattr(config, "add_bias_linear", False)),
         spec.o_bias),
        ("MLP biases (add_bias_linear)", bool(getattr(config, "add_bias_linear", False)), spec.mlp_bias),
        ("q/k norms (qk_layernorm)", bool(getattr(config, "qk_layernorm", False)) and not spec.is_mla,
         spec.qk_norm),
        ("routed experts (num_moe_experts)", experts, spec.num_experts),
        ("expert width (moe_ffn_hidden_size)", width, spec.moe_intermediate_size),
        ("shared expert width (moe_shared_expert_intermediate_size)", shared,
         spec.shared_expert_intermediate_size),
        ("shared expert gate (moe_shared_expert_gate)",
         bool(getattr(config, "moe_shared_expert_gate", False)) and shared > 0, spec.has_shared_expert_gate),
        ("router bias (moe_router_enable_expert_bias)",
         bool(getattr(config, "moe_router_enable_expert_bias", False)) and experts > 0, spec.has_router_bias),
        ("leading dense layers (moe_layer_freq)", first_dense, spec.first_k_dense_replace),
    )
    differ = [f"{what}: Megatron {mine!r}, {spec.family} {family!r}" for what, mine, family in pairs
              if mine != family]
    if differ:
        raise ValueError(f"the Megatron model is not a {model_type} model as the engine serves it: "
                         f"{'; '.join(differ)}")
    return out
