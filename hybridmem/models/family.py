"""What one model family is: how to read its HF config, and how its tensors are named and split.

[Note: canonical names]
Every family is described against one set of *canonical* per-layer tensor names, the Llama/Qwen ones
(``self_attn.q_proj.weight``, ``mlp.gate_proj.weight``, ``mlp.experts.{e}.gate_proj.weight``, ...). The
layout tables of :mod:`hybridmem.reshard.layouts` are written once over those names; a family says, as
data, where its own names differ:

- ``checkpoint_renames``: regex substitutions from a canonical layer suffix to the checkpoint's
  (Mixtral's ``block_sparse_moe.experts.{e}.w1.weight`` for ``mlp.experts.{e}.gate_proj.weight``);
- ``checkpoint_fused``: canonical tensors the checkpoint stores as row blocks of one tensor, in order
  (Phi-3's ``self_attn.qkv_proj.weight`` = [q; k; v]);
- ``checkpoint_stacked``: per-expert canonical tensors the checkpoint stores as slices of one tensor
  stacked over experts, maybe transposed (gpt-oss's ``mlp.experts.gate_up_proj`` [E, H, 2I]);
- ``vllm_renames``: substitutions from the canonical vLLM name to the family's vLLM name;
- ``module_names``: whether transformers' modules hold the canonical tensors (experts fused, see [Note:
  transformers experts] in :mod:`hybridmem.reshard.hf_source`) or the checkpoint's.

Pieces of a layout refer to checkpoint names (what ``load_weights`` of vLLM takes, what a checkpoint
holds); a canonical tensor stored as rows ``[o, o + n)`` of a fused one is that fused tensor's box shifted
by ``o``; one stored as slice ``[e]`` of a stacked tensor is the box with a leading ``(e, e + 1)`` the
local tensor drops, its last two axes swapped when stored transposed (``Piece.transposed``). A family file is
one :class:`Family` plus its config reader; :mod:`hybridmem.models.registry` lists them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["RouterBias", "Family", "TextModelNames", "ConfigGetter", "getter"]

ConfigGetter = Callable[..., Any]
"""``get(key, default=None)`` over a transformers config object or a dict."""


def getter(cfg: Any) -> ConfigGetter:
    """``get(key, default=None)`` reading a ``transformers`` config object or a plain mapping."""
    if isinstance(cfg, Mapping):
        return lambda k, d=None: cfg.get(k, d)
    return lambda k, d=None: _attribute(cfg, k, d)


def _attribute(cfg: Any, key: str, default: Any) -> Any:
    """``getattr(cfg, key, default)``; for a key a heterogeneous transformers config (>= 5.19, Gemma 4) keeps
    per layer, which it refuses to read globally (a ``RuntimeError``), the config's own global value: the
    family's reader takes the layers' values from ``per_layer_config``."""
    try:
        return getattr(cfg, key, default)
    except RuntimeError:
        return vars(cfg).get(key, default)


class RouterBias(Enum):
    """Whether a MoE router carries a routing-score correction bias (``e_score_correction_bias``)."""

    NONE = "none"
    """No bias anywhere."""
    ALWAYS = "always"
    """HF, Megatron (``router.expert_bias``) and vLLM all hold it (GLM-4.5)."""
    NOAUX_TC = "noaux_tc"
    """HF and Megatron always hold it; vLLM only when the config's ``topk_method`` is ``"noaux_tc"``
    (DeepSeek-V3)."""


def _renamed(pairs: tuple[tuple[str, str], ...], name: str) -> str:
    for old, new in pairs:
        if name.startswith(old):
            return new + name[len(old):]
    return name


@dataclass(frozen=True, kw_only=True, slots=True)
class TextModelNames:
    """Where a multimodal model keeps its text model's tensors: ``(text prefix, multimodal prefix)`` pairs
    that rename a text model's name (``model.layers.0.mlp.gate.weight``, ``lm_head.weight``), the first pair
    whose text prefix the name starts with applying (``("", "language_model.")`` prefixes every name). Only
    the text model's tensors are described (and synced); the vision tower and projector are not."""

    checkpoint: tuple[tuple[str, str], ...] = ()
    """The checkpoint's names (Kimi-K2.5's ``language_model.model.layers.*``,
    ``language_model.lm_head.weight``)."""
    vllm: tuple[tuple[str, str], ...] = ()
    """vLLM's multimodal model class's names (its text model built under ``language_model.``)."""
    modules: tuple[tuple[str, str], ...] = ()
    """transformers' module names of the multimodal model (``model.language_model.*``, ``lm_head.weight``)."""
    vllm_not_synced: tuple[str, ...] = ()
    """Prefixes of vLLM's parameters that are not the text model's (Kimi-K2.5's ``vision_tower.``,
    ``mm_projector.``): never synced, and no part of the vLLM adapter's name check."""

    def checkpoint_name(self, name: str) -> str:
        """The checkpoint's name of the text model's checkpoint tensor ``name``."""
        return _renamed(self.checkpoint, name)

    def vllm_name(self, name: str) -> str:
        """vLLM's name of the text model's vLLM tensor ``name``."""
        return _renamed(self.vllm, name)

    def module_name(self, name: str) -> str:
        """transformers' module name of the text model's module tensor ``name``."""
        return _renamed(self.modules, name)


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """One model family (see [Note: canonical names])."""

    name: str
    """The HF ``model_type``; a :class:`~hybridmem.reshard.ModelSpec`'s ``family``."""
    read_config: Callable[[ConfigGetter], dict[str, Any]]
    """``get -> ModelSpec keyword arguments`` (all but ``family``); raises ``ValueError`` naming a key the
    family does not support."""
    aliases: tuple[str, ...] = ()
    """Other ``model_type`` values described by this family (``mistral`` by ``llama``)."""
    multimodal_types: tuple[str, ...] = ()
    """``model_type`` values of multimodal configs that nest this family's config as ``text_config``
    (Qwen3.5's ``qwen3_5``): a spec of such a config is the text model's, read from its ``text_config``."""
    multimodal_names: tuple[tuple[str, TextModelNames], ...] = ()
    """``(multimodal model_type, names)``: where that multimodal model keeps the text model's tensors; its
    spec carries the type (``ModelSpec.multimodal``) and names its tensors so (Kimi-K2.5's
    ``language_model.``). A type of :attr:`multimodal_types` not listed is read as the text model with the
    text model's names (Qwen3.5's)."""
    architectures: tuple[str, ...] = ()
    """transformers' and vLLM's class names of the family's text model (``config.architectures``): a config
    without ``model_type`` is read as the family of its class (:func:`hybridmem.models.model_type_of`)."""
    moe: bool = False
    """Routed experts (every layer from ``first_k_dense_replace`` on)."""
    mla: bool = False
    """DeepSeek's multi-latent attention instead of grouped-query attention."""
    router_bias: RouterBias = RouterBias.NONE
    """See :class:`RouterBias`."""
    shared_expert: str | None = None
    """Module name of the MoE layers' shared expert (``shared_expert``, ``shared_experts``);
    ``None``: none."""
    shared_expert_gate: bool = False
    """The shared expert has a [1, H] sigmoid gate (``mlp.shared_expert_gate.weight``, Qwen2-MoE)."""
    attention_sinks: bool = False
    """Every attention layer has a learned per-head sink logit, ``self_attn.sinks`` [num_attention_heads]
    (gpt-oss), split by heads under TP."""
    qk_norm_all_heads: bool = False
    """With ``qk_norm``, one RMSNorm over all heads of q and one over all of k (MiniMax-M2):
    ``self_attn.q_norm.weight`` [num_attention_heads * head_dim] and ``k_norm.weight``
    [num_key_value_heads * head_dim], split under TP by heads as q_proj's and k_proj's rows are (k's
    replicated with its kv heads)."""
    attention_output_gate: bool = False
    """``self_attn.q_proj`` gives every head its query and an output gate, ``[q_h; gate_h]`` per head:
    ``2 * num_attention_heads * head_dim`` rows (Qwen3.5); vLLM splits them by heads as it splits queries."""
    sparse_attention_indexer: bool = False
    """MLA with DeepSeek sparse attention's lightning indexer in every layer (DeepSeek-V3.2, GLM-5):
    ``self_attn.indexer.wq_b.weight`` [index_n_heads * index_head_dim, q_lora_rank], ``wk.weight``
    [index_head_dim, hidden_size], ``k_norm.weight`` and ``k_norm.bias`` [index_head_dim] (a LayerNorm) and
    ``weights_proj.weight`` [index_n_heads, hidden_size]; vLLM keeps them whole on every rank, ``wk`` and
    ``weights_proj`` fused into ``indexer.wk_weights_proj.weight`` ([wk; weights_proj])."""
    router_linear_bias: bool = False
    """The router is a linear layer with a bias, ``mlp.gate.bias`` [num_experts] canonically (gpt-oss)."""
    experts_interleaved: bool = False
    """One expert's gate and up projections are one tensor with interleaved rows, canonically
    ``mlp.experts.{e}.gate_up_proj.weight`` [2I, H], each expert projection with a bias (gpt-oss); vLLM
    splits the 2I rows into contiguous blocks per TP rank."""
    extra_norms: tuple[str, ...] = ()
    """Per-layer norm weights beyond ``input_layernorm`` and ``post_attention_layernorm`` (Gemma 3's
    sandwich norms), each a [hidden_size] tensor replicated on every rank."""
    experts_optional: bool = False
    """A MoE family whose configs may have no experts: a config without ``num_experts`` is dense (Gemma 4's
    ``enable_moe_block``)."""
    dense_mlp_with_experts: bool = False
    """MoE layers keep a dense MLP of ``intermediate_size`` beside the experts (Gemma 4)."""
    experts_fused_gate_up: bool = False
    """One expert's gate and up projections are one tensor, canonically
    ``mlp.experts.{e}.gate_up_proj.weight`` [2I, H] of contiguous [gate; up] rows (Gemma 4's checkpoint stacks
    them over experts); vLLM takes rows of each half per TP rank, as for separate gate and up tensors."""
    router_scales: bool = False
    """The router has a per-dimension input scale ``mlp.gate.scale`` [hidden_size] and a per-expert output
    scale ``mlp.gate.per_expert_scale`` [num_experts] canonically, both whole on every rank (Gemma 4)."""
    moe_norms: tuple[str, ...] = ()
    """Norm weights [hidden_size] of the MoE layers only, replicated (Gemma 4's
    ``pre_feedforward_layernorm_2``, ``post_feedforward_layernorm_1`` and
    ``post_feedforward_layernorm_2``)."""
    per_layer_inputs: bool = False
    """The family may have per-layer input embeddings (Gemma 4's PLE), present where the config gives them
    (:attr:`~hybridmem.reshard.ModelSpec.hidden_size_per_layer_input` P > 0, over L layers): outside the
    layers ``model.embed_tokens_per_layer.weight`` [vocab_size_per_layer_input, L * P],
    ``model.per_layer_model_projection.weight`` [L * P, H] and ``model.per_layer_projection_norm.weight`` [P];
    in every layer ``per_layer_input_gate.weight`` [P, H], ``per_layer_projection.weight`` [H, P] and
    ``post_per_layer_input_norm.weight`` [H]. vLLM splits the embedding by vocabulary rows (padded, as the
    token embedding) and the model projection by rows, keeps the rest whole on every rank, and builds the
    three outside the layers on every pipeline stage."""
    layer_scalar: bool = False
    """Every layer has a ``layer_scalar`` [1] (Gemma 4), replicated on every rank. transformers and vLLM
    hold it as a persistent buffer, not a parameter: the checkpoint has it and vLLM's loader fills it, so
    a weight sync writes it like a parameter."""
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    """``(pattern, replacement)`` regex substitutions, canonical layer suffix -> checkpoint layer suffix."""
    checkpoint_fused: tuple[tuple[tuple[str, ...], str], ...] = ()
    """``((canonical suffixes, in row order), checkpoint suffix)``: tensors stored as row blocks of one."""
    checkpoint_stacked: tuple[tuple[str, str, bool], ...] = ()
    """``(canonical suffix regex with the expert index as group 1, checkpoint suffix, transposed)``: one
    expert's tensor is slice ``[e]`` of a checkpoint tensor stacked over experts, its last two axes swapped
    when ``transposed`` (gpt-oss's ``mlp.experts.gate_up_proj`` [E, H, 2I]). Entries naming the same
    checkpoint suffix are row blocks of it in entry order, each of one expert tensor's rows (Llama 4's
    ``feed_forward.experts.gate_up_proj`` [E, H, 2I] holds gate then up, transposed)."""
    module_names: str = "canonical"
    """``"canonical"``: transformers' modules hold the canonical tensors (experts fused); ``"checkpoint"``:
    they hold the checkpoint's tensors as stored."""
    module_renames: tuple[tuple[str, str], ...] = ()
    """With canonical ``module_names``: ``(pattern, replacement)`` regex substitutions, canonical layer suffix
    -> transformers' module suffix where its modules name a canonical tensor otherwise (MiniMax-M2's router
    bias is ``mlp.e_score_correction_bias``, a buffer of the MoE block)."""
    vllm_renames: tuple[tuple[str, str], ...] = ()
    """``(pattern, replacement)`` regex substitutions, canonical vLLM layer suffix -> the family's."""
    vllm_rotary_permute: bool = False
    """vLLM's loader reorders each q and k head's rows from interleaved rotary pairs to halves (row ``2i + j``
    of a head to ``j * head_dim / 2 + i``) before splitting them (Llama 4's
    ``permute_qk_weight_for_rotary``)."""
    vllm_embedding: str = "model.embed_tokens.weight"
    """vLLM's name of the token embedding (gpt-oss: ``model.embedding.weight``)."""
    vllm_every_stage: bool = False
    """vLLM builds ``embed_tokens``, the final ``norm`` and ``lm_head`` on every pipeline stage."""
    vllm_embedding_every_stage: bool = False
    """vLLM builds ``embed_tokens`` on every pipeline stage, the final norm and the head on the last only
    (Qwen3.5)."""
    megatron: str | None = None
    """``None``: megatron-core's ``GPTModel`` expresses the family; otherwise why it does not."""
    embedded_engine: str | None = "no decoder block of this family in the embedded engine"
    """``None``: hybridmem's embedded engine runs the family; otherwise why it does not."""

    def __post_init__(self) -> None:
        if self.module_names not in ("canonical", "checkpoint"):
            raise ValueError(f"module_names={self.module_names!r}; expected 'canonical' or 'checkpoint'")
        for pattern, _ in (*self.checkpoint_renames, *self.vllm_renames, *self.module_renames):
            re.compile(pattern)

    def checkpoint_suffix(self, suffix: str) -> str:
        """The checkpoint's layer suffix of a canonical one (before fusing, see :attr:`checkpoint_fused`)."""
        for pattern, replacement in self.checkpoint_renames:
            suffix = re.sub(pattern, replacement, suffix)
        return suffix

    def module_suffix(self, suffix: str) -> str:
        """transformers' module suffix of a canonical layer suffix (see :attr:`module_renames`)."""
        for pattern, replacement in self.module_renames:
            suffix = re.sub(pattern, replacement, suffix)
        return suffix

    def vllm_suffix(self, suffix: str) -> str:
        """The family's vLLM layer suffix of a canonical vLLM one."""
        for pattern, replacement in self.vllm_renames:
            suffix = re.sub(pattern, replacement, suffix)
        return suffix
