"""Each family's description against transformers: the checkpoint it says a model has is the one
``save_pretrained`` writes (names and shapes), and its config reader takes the config transformers writes.

The per-rank vLLM tensors of every family are checked against vLLM's own classes and loaders in
tests/reshard/test_vllm_names.py; this file covers what needs only transformers.
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridmem.config import ParallelLayout
from hybridmem.models import ALIASES, FAMILIES, get_family
from hybridmem.reshard import ModelSpec, megatron_layout

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

_COMMON = dict(hidden_size=64, num_hidden_layers=3, vocab_size=100, max_position_embeddings=64)
CONFIGS = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=48),
    "mistral": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=48),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=48),
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48),
    "qwen2_moe": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, num_experts=4,
                      moe_intermediate_size=8, shared_expert_intermediate_size=12, num_experts_per_tok=2),
    "qwen3_moe": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                      num_experts=4, moe_intermediate_size=8, num_experts_per_tok=2),
    "deepseek_v3": dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=48,
                        n_routed_experts=4, n_shared_experts=2, moe_intermediate_size=6,
                        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                        q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4),
    "mixtral": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=24, num_local_experts=4,
                    num_experts_per_tok=2),
    "phi3": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2),
    "gemma3_text": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24, intermediate_size=48),
    "granite": dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                    embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                    logits_scaling=8.0),
    "ernie4_5": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48),
    "glm4_moe": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48,
                     n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=8, first_k_dense_replace=1,
                     num_experts_per_tok=2, n_group=1, topk_group=1, attention_bias=True, use_qk_norm=True),
    "gpt_oss": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=24,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    "llama4_text": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=24,
                        intermediate_size_mlp=40, num_local_experts=4, num_experts_per_tok=1,
                        interleave_moe_layer_step=2),
    "minimax_m2": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=24,
                       num_local_experts=4, num_experts_per_tok=2, rotary_dim=8, scoring_func="sigmoid",
                       use_routing_bias=True),
    # Gemma 4: the full-attention layers with their own head width and kv heads, values = keys (no v_proj).
    "gemma4_text": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                        num_global_key_value_heads=1, attention_k_eq_v=True, intermediate_size=48,
                        hidden_size_per_layer_input=0,
                        layer_types=["sliding_attention", "full_attention", "full_attention"]),
    "qwen3_5_text": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                         linear_value_head_dim=6, linear_conv_kernel_dim=4, full_attention_interval=2),
    "qwen3_5_moe_text": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                             linear_value_head_dim=6, linear_conv_kernel_dim=4, full_attention_interval=2,
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                             shared_expert_intermediate_size=12),
    # DeepSeek sparse attention: DeepSeek-V3's MLA and MoE with an indexer in every layer.
    "deepseek_v32": dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=48,
                         n_routed_experts=4, n_shared_experts=2, moe_intermediate_size=8,
                         num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                         q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4,
                         index_n_heads=2, index_head_dim=8, index_topk=4),
    "glm_moe_dsa": dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=48,
                        n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=8,
                        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                        q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=6, qk_rope_head_dim=2, v_head_dim=8,
                        index_n_heads=2, index_head_dim=8, index_topk=4),
}
UNTIED_ONLY = {"minimax_m2"}
"""Families whose vLLM model never ties the head to the embedding: a tied config is refused."""


def _checkpoint(path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint ``save_pretrained`` wrote in ``path``, by name."""
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(safetensors_torch.load_file(f))
    return tensors


def _saved(model_type: str, tmp_path, **overrides):
    cfg = transformers.AutoConfig.for_model(model_type, **{**_COMMON, **CONFIGS[model_type], **overrides})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    return cfg, {n: tuple(t.shape) for n, t in _checkpoint(tmp_path).items()}


def test_every_family_and_alias_is_covered_here():
    assert set(CONFIGS) == set(FAMILIES) | set(ALIASES)


def test_every_family_has_a_vllm_names_case():
    """A registered family without a model in tests/reshard/families.py would skip the check against vLLM's
    own loaders without a word: each family, alias or not, needs one."""
    from tests.reshard.families import MODELS

    covered = {get_family(model_type).name for model_type, _ in MODELS.values()}
    missing = sorted(set(FAMILIES) - covered)
    assert not missing, ("families without a vLLM names case (add a model to MODELS in "
                         f"tests/reshard/families.py): {missing}")


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_checkpoint_shapes_are_what_transformers_saves(model_type, tied, tmp_path):
    cfg, saved = _saved(model_type, tmp_path, tie_word_embeddings=tied)
    if tied and model_type in UNTIED_ONLY:
        with pytest.raises(ValueError, match=f"tie_word_embeddings=True is not supported for {model_type}"):
            ModelSpec.from_hf_config(cfg)
        return
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.family == get_family(model_type).name
    assert spec.full_shapes() == saved


def test_the_same_from_the_config_file(tmp_path):
    """A config.json read as a plain dict gives the same spec as transformers' config object."""
    for model_type in CONFIGS:
        cfg, _ = _saved(model_type, tmp_path / model_type)
        data = json.loads((tmp_path / model_type / "config.json").read_text())
        assert ModelSpec.from_hf_config(data) == ModelSpec.from_hf_config(cfg), model_type


def test_alias_and_unknown_model_types():
    assert get_family("mistral") is get_family("llama")
    assert ModelSpec(family="mistral", hidden_size=8, num_attention_heads=2, num_key_value_heads=2,
                     head_dim=4, intermediate_size=8, num_hidden_layers=1, vocab_size=8).family == "llama"
    with pytest.raises(ValueError,
                       match=r"model_type='gpt2' is not supported; expected one of \[.*'mistral'.*\]"):
        get_family("gpt2")


def test_a_family_megatron_cannot_express_is_refused_by_name(tmp_path):
    cfg, _ = _saved("gemma3_text", tmp_path)
    with pytest.raises(ValueError,
                       match="family='gemma3_text' has no Megatron-core layout: "
                             ".*post_feedforward_layernorm"):
        megatron_layout(ModelSpec.from_hf_config(cfg), ParallelLayout(), 1)
    cfg, _ = _saved("gpt_oss", tmp_path / "gpt_oss")
    with pytest.raises(ValueError, match="family='gpt_oss' has no Megatron-core layout: .*attention sinks"):
        megatron_layout(ModelSpec.from_hf_config(cfg), ParallelLayout(), 1)
    cfg, _ = _saved("minimax_m2", tmp_path / "minimax_m2")
    with pytest.raises(ValueError,
                       match="family='minimax_m2' has no Megatron-core layout: .*all heads together"):
        megatron_layout(ModelSpec.from_hf_config(cfg), ParallelLayout(), 1)
    cfg, _ = _saved("llama4_text", tmp_path / "llama4_text")
    with pytest.raises(ValueError,
                       match="family='llama4_text' has no Megatron-core layout: .*interleaved dense and MoE"):
        megatron_layout(ModelSpec.from_hf_config(cfg), ParallelLayout(), 1)


def test_llama4_multimodal_checkpoints_are_read_as_their_text_model(tmp_path):
    """The Hub's Llama 4 checkpoints are multimodal (``llama4``): a ``text_config`` nested in config.json,
    text weights under ``language_model.`` (``language_model.model.layers.*``,
    ``language_model.lm_head.weight``). Their config (object or config.json) gives the text model's spec; the
    text weights are the spec's checkpoint under that prefix; and transformers' causal LM of such a checkpoint
    has exactly the spec's module tensors, each equal to the checkpoint's values where the source layout
    says."""
    from hybridmem.reshard.hf_source import hf_module_tensors
    from hybridmem.reshard.transforms import build_local

    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                  image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                  projector_output_dim=64)
    cfg = transformers.AutoConfig.for_model("llama4", text_config={**_COMMON, **CONFIGS["llama4_text"]},
                                            vision_config=vision)
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(cfg).save_pretrained(tmp_path)
    saved = _checkpoint(tmp_path)
    spec = ModelSpec.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert spec == ModelSpec.from_hf_config(cfg) == ModelSpec.from_hf_config(cfg.text_config)
    assert spec.family == "llama4_text"
    prefix = "language_model."
    weights = {n[len(prefix):]: t for n, t in saved.items() if n.startswith(prefix)}
    assert {n: tuple(t.shape) for n, t in weights.items()} == spec.full_shapes()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    params = {n: p.detach() for n, p in model.named_parameters()}
    ours = hf_module_tensors(spec)
    assert sorted(ours) == sorted(params)
    for name, local in ours.items():
        assert torch.equal(build_local(local, weights, dtype=torch.float32), params[name]), name


def test_llama4_layers_experts_and_rotary_rows(tmp_path):
    """Llama 4 at vLLM TP 1: layer 1 of 3 is MoE (interleave_moe_layer_step 2), its experts are the
    checkpoint's stacked tensors sliced and transposed (gate then up), and each q/k head's rows are reordered
    from interleaved pairs to halves as vLLM's loader reorders them; MoE layers placed otherwise than vLLM
    places them are refused by name. tests/reshard/test_vllm_names.py checks the same against vLLM's
    loaders."""
    from hybridmem.reshard import shard, vllm_layout

    cfg, _ = _saved("llama4_text", tmp_path)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    spec = ModelSpec.from_hf_config(cfg)
    assert [spec.is_moe_layer(i) for i in range(3)] == [False, True, False]
    local = shard(weights, vllm_layout(spec, ParallelLayout(), 1), 0)
    x = "model.layers.1.feed_forward."
    assert torch.equal(local[x + "experts.routed_experts.w13_weight"],
                       weights[x + "experts.gate_up_proj"].transpose(1, 2))
    assert torch.equal(local[x + "experts.routed_experts.w2_weight"],
                       weights[x + "experts.down_proj"].transpose(1, 2))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    heads, hd = cfg.num_attention_heads, cfg.head_dim
    halves = q.view(heads, hd // 2, 2, -1).transpose(1, 2).reshape(q.shape)
    assert torch.equal(local["model.layers.0.self_attn.qkv_proj.weight"][: q.shape[0]], halves)
    with pytest.raises(ValueError, match=r"moe_layers=\[0, 2\] is not supported for llama4_text"):
        ModelSpec.from_hf_config({**cfg.to_dict(), "moe_layers": [0, 2]})


def test_minimax_m2_router_bias_and_configs_it_refuses(tmp_path):
    """The checkpoint's ``block_sparse_moe.e_score_correction_bias`` travels in fp32 like DeepSeek-V3's; a
    config without ``use_routing_bias`` (vLLM then builds no bias for the one transformers writes) is refused
    by name."""
    cfg, saved = _saved("minimax_m2", tmp_path)
    spec = ModelSpec.from_hf_config(cfg)
    bias = "model.layers.0.block_sparse_moe.e_score_correction_bias"
    assert bias in saved and spec.keeps_fp32(bias)
    assert not spec.keeps_fp32("model.layers.0.block_sparse_moe.gate.weight")
    with pytest.raises(ValueError, match="use_routing_bias=False is not supported for minimax_m2"):
        ModelSpec.from_hf_config({**cfg.to_dict(), "use_routing_bias": False})


def test_gpt_oss_experts_are_the_checkpoints_transposed_slices(tmp_path):
    """One expert's canonical tensors, as vLLM's TP 1 layout holds them, are the checkpoint's stacked tensors
    sliced at that expert and transposed (gate/up columns interleaved, kept so)."""
    from hybridmem.reshard import shard, vllm_layout

    cfg = transformers.AutoConfig.for_model("gpt_oss", **{**_COMMON, **CONFIGS["gpt_oss"]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    local = shard(weights, vllm_layout(ModelSpec.from_hf_config(cfg), ParallelLayout(), 1), 0)
    x = "model.layers.0.mlp.experts."
    assert torch.equal(local[x + "routed_experts.w13_weight"], weights[x + "gate_up_proj"].transpose(1, 2))
    assert torch.equal(local[x + "routed_experts.w2_weight"], weights[x + "down_proj"].transpose(1, 2))
    assert torch.equal(local[x + "routed_experts.w13_bias"], weights[x + "gate_up_proj_bias"])
    assert torch.equal(local["model.layers.0.attn.sinks"], weights["model.layers.0.self_attn.sinks"])


def test_shared_expert_on_a_family_without_one_is_refused():
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=8 given for family='mixtral'"):
        ModelSpec(family="mixtral", hidden_size=8, num_attention_heads=2, num_key_value_heads=2, head_dim=4,
                  intermediate_size=0, num_hidden_layers=1, vocab_size=8, num_experts=2,
                  moe_intermediate_size=4, shared_expert_intermediate_size=8)


def test_the_embedded_engine_runs_the_families_it_has_blocks_for(tmp_path):
    from hybridmem.engines import ReferenceEngine

    for model_type in ("llama", "mistral", "qwen2", "phi3"):
        cfg, _ = _saved(model_type, tmp_path / model_type)
        ReferenceEngine(cfg.to_dict())
    cfg, _ = _saved("gemma3_text", tmp_path / "gemma3")
    with pytest.raises(ValueError,
                       match=r"model_type='gemma3_text' does not run in the embedded engine \(Gemma 3's"):
        ReferenceEngine(cfg.to_dict())
    mistral = transformers.MistralConfig(**_COMMON, **dict(CONFIGS["mistral"], sliding_window=16))
    with pytest.raises(ValueError,
                       match="sliding_window=16 \\(max_position_embeddings=64\\) is not supported"):
        ReferenceEngine(mistral.to_dict())
    glm = dict(_saved("glm4_moe", tmp_path / "glm")[0].to_dict())
    with pytest.raises(ValueError, match="model_type='glm4_moe' does not run in the embedded engine"):
        ReferenceEngine(glm)
    with pytest.raises(ValueError, match="model_type='gpt_oss' does not run in the embedded engine"):
        ReferenceEngine(_saved("gpt_oss", tmp_path / "gpt_oss")[0].to_dict())
    with pytest.raises(ValueError,
                       match=r"model_type='minimax_m2' does not run in the embedded engine \(MiniMax-M2"):
        ReferenceEngine(_saved("minimax_m2", tmp_path / "minimax_m2")[0].to_dict())
    with pytest.raises(ValueError,
                       match=r"model_type='llama4_text' does not run in the embedded engine \(Llama 4"):
        ReferenceEngine(_saved("llama4_text", tmp_path / "llama4_text")[0].to_dict())


def test_gemma4_is_refused_by_the_embedded_engine_and_megatron(tmp_path):
    from hybridmem.engines import ReferenceEngine

    cfg, _ = _saved("gemma4_text", tmp_path)
    with pytest.raises(ValueError,
                       match=r"model_type='gemma4_text' does not run in the embedded engine \(Gemma 4's"):
        ReferenceEngine(cfg.to_dict())
    with pytest.raises(ValueError,
                       match="family='gemma4_text' has no Megatron-core layout: .*one head width"):
        megatron_layout(ModelSpec.from_hf_config(cfg), ParallelLayout(), 1)


@pytest.mark.parametrize("key,value,named", [
    ("num_kv_shared_layers", 1, "layers without their own keys and values"),
    ("attention_bias", True, "Gemma 4 has none"),
])
def test_gemma4_features_without_layout_rows_are_refused_by_name(key, value, named):
    config = dict(_COMMON, model_type="gemma4_text", **{**CONFIGS["gemma4_text"], key: value})
    with pytest.raises(ValueError, match=f"{key}={value} is not supported for gemma4_text \\(.*{named}"):
        ModelSpec.from_hf_config(config)


_GEMMA4_PLE = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=70)
"""Per-layer input embeddings as transformers builds them by default (its width there is 256, over a
vocabulary of 262144), tiny."""


@pytest.mark.parametrize("variant", [dict(tie_word_embeddings=True), dict(tie_word_embeddings=False),
                                     dict(enable_moe_block=True, num_experts=4, top_k_experts=2,
                                          moe_intermediate_size=8, attention_k_eq_v=False)],
                         ids=["tied", "untied", "moe"])
def test_gemma4_per_layer_input_embeddings_are_what_transformers_saves(variant, tmp_path):
    """hidden_size_per_layer_input > 0: embed_tokens_per_layer [vocab_size_per_layer_input, L * P], its model
    projection and norm, and each layer's gate, projection and norm, beside the other Gemma 4 features the
    layouts take (full-attention layers of their own width with and without values = keys, experts); read
    alike from transformers' config, its config.json and a config that lacks the keys (transformers'
    defaults)."""
    cfg, saved = _saved("gemma4_text", tmp_path, **_GEMMA4_PLE, **variant)
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.full_shapes() == saved
    assert (spec.hidden_size_per_layer_input, spec.vocab_size_per_layer_input) == (8, 70)
    assert saved["model.embed_tokens_per_layer.weight"] == (70, 3 * 8)
    assert saved["model.per_layer_model_projection.weight"] == (3 * 8, 64)
    assert saved["model.per_layer_projection_norm.weight"] == (8,)
    assert saved["model.layers.2.per_layer_input_gate.weight"] == (8, 64)
    assert saved["model.layers.2.per_layer_projection.weight"] == (64, 8)
    assert saved["model.layers.2.post_per_layer_input_norm.weight"] == (64,)
    assert ModelSpec.from_hf_config(json.loads((tmp_path / "config.json").read_text())) == spec
    hub = {k: v for k, v in dict(_COMMON, model_type="gemma4_text", **CONFIGS["gemma4_text"]).items()
           if k != "hidden_size_per_layer_input"}
    assert (ModelSpec.from_hf_config(hub).hidden_size_per_layer_input,
            ModelSpec.from_hf_config(hub).vocab_size_per_layer_input) == (256, 262_144)


def test_gemma4_default_config_is_the_model_transformers_builds():
    """transformers' default Gemma4TextConfig (per-layer input embeddings of 256 over 262144 tokens, 30
    layers), built on the meta device: the spec's tensors are its state dict's, the head tied to the
    embedding left out as save_pretrained leaves it out."""
    cfg = transformers.Gemma4TextConfig()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    state = {n: tuple(t.shape) for n, t in model.state_dict().items() if n != "lm_head.weight"}
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.hidden_size_per_layer_input == 256 and spec.tie_word_embeddings
    assert spec.full_shapes() == state


def test_gemma4_per_layer_input_embeddings_in_vllm_and_what_refuses_them(tmp_path):
    """At vLLM TP 2 the per-layer embedding's 70 rows are padded to 128 (a multiple of 64) and split: rank 1
    holds rows 64..69 then zeros; the model projection's 24 rows split 12 and 12; the norms, gates and
    projections are whole. The embedded engine and Megatron refuse such a model by name, as do a per-layer
    width whose layers' total TP does not divide and a family without such embeddings."""
    import dataclasses

    from hybridmem.engines import ReferenceEngine
    from hybridmem.reshard import shard, vllm_layout

    cfg = transformers.AutoConfig.for_model("gemma4_text", **{**_COMMON, **CONFIGS["gemma4_text"],
                                                              **_GEMMA4_PLE})
    torch.manual_seed(0)
    weights = transformers.AutoModelForCausalLM.from_config(cfg).state_dict()
    spec = ModelSpec.from_hf_config(cfg)
    local = shard(weights, vllm_layout(spec, ParallelLayout(tp=2), 2), 1)
    embed = weights["model.embed_tokens_per_layer.weight"]
    assert local["model.embed_tokens_per_layer.weight"].shape == (64, 24)
    assert torch.equal(local["model.embed_tokens_per_layer.weight"][:6], embed[64:70])
    assert not local["model.embed_tokens_per_layer.weight"][6:].any()
    assert torch.equal(local["model.per_layer_model_projection.weight"],
                       weights["model.per_layer_model_projection.weight"][12:24])
    for name in ("model.per_layer_projection_norm.weight", "model.layers.1.per_layer_input_gate.weight",
                 "model.layers.1.per_layer_projection.weight",
                 "model.layers.1.post_per_layer_input_norm.weight"):
        assert torch.equal(local[name], weights[name]), name
    with pytest.raises(ValueError, match=r"model_type='gemma4_text' does not run in the embedded engine "
                                         r"\(.*per-layer input embeddings"):
        ReferenceEngine(cfg.to_dict())
    with pytest.raises(ValueError, match="family='gemma4_text' has no Megatron-core layout: "
                                         r".*per-layer input embeddings \(hidden_size_per_layer_input\)"):
        megatron_layout(spec, ParallelLayout(), 1)
    odd = ModelSpec.from_hf_config({**cfg.to_dict(), "hidden_size_per_layer_input": 5})
    with pytest.raises(ValueError, match=r"inference tp=2 does not divide num_hidden_layers \* "
                                         r"hidden_size_per_layer_input=15"):
        vllm_layout(odd, ParallelLayout(tp=2), 2)
    llama = ModelSpec.from_hf_config(_saved("llama", tmp_path)[0])
    with pytest.raises(ValueError, match="hidden_size_per_layer_input=8 given for family='llama', which has "
                                         "no per-layer input embeddings"):
        dataclasses.replace(llama, hidden_size_per_layer_input=8, vocab_size_per_layer_input=70)
    with pytest.raises(ValueError, match="vocab_size_per_layer_input=70 given without "
                                         "hidden_size_per_layer_input"):
        dataclasses.replace(spec, hidden_size_per_layer_input=0)


@pytest.mark.parametrize("tied", [False, True])
def test_gemma4_moe_is_what_transformers_saves(tied, tmp_path):
    """enable_moe_block: experts beside the dense MLP, stacked in the checkpoint, the router's scales, three
    more norms."""
    cfg, saved = _saved("gemma4_text", tmp_path, enable_moe_block=True, num_experts=4, top_k_experts=2,
                        moe_intermediate_size=8, tie_word_embeddings=tied)
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.is_moe and spec.full_shapes() == saved
    assert saved["model.layers.0.experts.gate_up_proj"] == (4, 2 * 8, 64)
    assert not ModelSpec.from_hf_config(_saved("gemma4_text", tmp_path / "dense")[0]).is_moe


def test_gemma4_moe_experts_are_the_checkpoints_slices(tmp_path):
    """At TP 2 vLLM's w13 of an expert holds its rank's rows of the gate half, then of the up half."""
    from hybridmem.reshard import shard, vllm_layout

    cfg = transformers.AutoConfig.for_model("gemma4_text",
                                            **{**_COMMON, **CONFIGS["gemma4_text"], "enable_moe_block": True,
                                               "num_experts": 4, "top_k_experts": 2,
                                               "moe_intermediate_size": 8})
    torch.manual_seed(0)
    weights = transformers.AutoModelForCausalLM.from_config(cfg).state_dict()  # with the layer_scalar buffers
    local = shard(weights, vllm_layout(ModelSpec.from_hf_config(cfg), ParallelLayout(tp=2), 2), 1)
    fused = weights["model.layers.0.experts.gate_up_proj"]
    assert torch.equal(local["model.layers.0.experts.routed_experts.w13_weight"],
                       torch.cat([fused[:, 4:8], fused[:, 12:16]], dim=1))
    assert torch.equal(local["model.layers.0.router.per_expert_scale"],
                       weights["model.layers.0.router.per_expert_scale"])


def test_gemma4_full_attention_layers_have_their_own_heads_and_no_v_proj(tmp_path):
    """Read from transformers' config object, its config.json (``per_layer_config``) and the Hub's form
    (``global_head_dim``, ``num_global_key_value_heads``) alike; the widths are those transformers builds."""
    cfg, saved = _saved("gemma4_text", tmp_path)
    hub = dict(_COMMON, model_type="gemma4_text", **CONFIGS["gemma4_text"])
    saved_json = json.loads((tmp_path / "config.json").read_text())
    assert "global_head_dim" not in saved_json and "per_layer_config" in saved_json
    spec = ModelSpec.from_hf_config(cfg)
    assert ModelSpec.from_hf_config(hub) == ModelSpec.from_hf_config(saved_json) == spec
    assert spec.full_attention_layers == (1, 2) and spec.full_attention_k_eq_v
    assert (saved["model.layers.1.self_attn.k_proj.weight"] == (1 * 32, 64)
            and spec.attention_dims(1) == (32, 1))
    assert "model.layers.1.self_attn.v_proj.weight" not in saved
    assert saved["model.layers.0.self_attn.v_proj.weight"] == (2 * 16, 64)


_GEMMA4_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=8,
                   tie_word_embeddings=False)


@pytest.mark.parametrize("moe,ple", [(False, False), (True, False), (False, True)],
                         ids=["dense", "moe", "per-layer-inputs"])
def test_gemma4_multimodal_checkpoints_are_read_as_their_text_model(moe, ple, tmp_path):
    """The Hub's Gemma 4 checkpoints are multimodal (``gemma4``): a ``text_config`` nested in config.json,
    text weights under ``model.language_model.*`` beside the vision tower and its projection. Their config
    (object or config.json) gives the text model's spec marked ``gemma4``; the text weights are the spec's
    checkpoint with that prefix; and the model transformers builds of such a checkpoint
    (``AutoModelForCausalLM``: its multimodal class) holds exactly the source layout's module tensors
    (``model.language_model.*``, the ``layer_scalar`` buffers too) beside its vision tower, each equal to the
    checkpoint's values where the layout says (what a training copy of it syncs from)."""
    import dataclasses

    from hybridmem.reshard.hf_source import hf_module_tensors, looks_hf_named
    from hybridmem.reshard.transforms import build_local

    text = {**_COMMON, **CONFIGS["gemma4_text"], **(_GEMMA4_MOE if moe else {}),
            **(_GEMMA4_PLE if ple else {})}
    vision = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, position_embedding_size=16)
    cfg = transformers.AutoConfig.for_model("gemma4", text_config=text, vision_config=vision,
                                            tie_word_embeddings=not moe)
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(cfg).save_pretrained(tmp_path)
    saved = _checkpoint(tmp_path)
    assert any(n.startswith("model.vision_tower.") for n in saved)
    spec = ModelSpec.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert spec == ModelSpec.from_hf_config(cfg)
    assert spec.family == "gemma4_text" and spec.multimodal == "gemma4" and spec.is_moe == moe
    assert dataclasses.replace(spec, multimodal="") == ModelSpec.from_hf_config(cfg.text_config)
    prefix = "model.language_model."
    weights = {("model." + n[len(prefix):] if n.startswith(prefix) else n): t for n, t in saved.items()
               if not n.startswith(("model.vision_tower.", "model.embed_vision."))}
    assert {n: tuple(t.shape) for n, t in weights.items()} == spec.full_shapes()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    params = {n: p.detach() for n, p in model.named_parameters()}
    params.update((n, b) for n, b in model.named_buffers() if n in model.state_dict())  # layer_scalar
    text_params = {n: p for n, p in params.items()
                   if not n.startswith(("model.vision_tower.", "model.embed_vision."))}
    assert len(text_params) < len(params)  # the multimodal model, its vision tower left out
    assert looks_hf_named(params)
    ours = hf_module_tensors(spec)
    assert sorted(ours) == sorted(text_params)
    for name, local in ours.items():
        assert torch.equal(build_local(local, weights, dtype=torch.float32), text_params[name]), name


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_qwen3_5_is_refused_by_the_embedded_engine_and_megatron(model_type, tmp_path):
    from hybridmem.engines import ReferenceEngine

    cfg, _ = _saved(model_type, tmp_path)
    with pytest.raises(ValueError,
                       match=rf"model_type='{model_type}' does not run in the embedded engine \(gated "
                                         r"delta-net"):
        ReferenceEngine(cfg.to_dict())
    with pytest.raises(ValueError,
                       match=f"family='{model_type}' has no Megatron-core layout: .*gated delta-net"):
        megatron_layout(ModelSpec.from_hf_config(cfg), ParallelLayout(), 1)


@pytest.mark.parametrize("model_type,multimodal",
                         [("qwen3_5_text", "qwen3_5"), ("qwen3_5_moe_text", "qwen3_5_moe")])
def test_qwen3_5_multimodal_checkpoints_are_read_as_their_text_model(model_type, multimodal, tmp_path):
    """The Hub's Qwen3.5 checkpoints are multimodal: a ``text_config`` nested in config.json, text weights
    under ``model.language_model.*``. Their config (object or config.json) gives the text model's spec; the
    text weights are the spec's checkpoint with that prefix; and transformers' causal LM of such a checkpoint
    (its text model) has exactly the spec's module tensors, each equal to the checkpoint's values where the
    source layout says (what a training copy of it syncs from)."""
    from hybridmem.reshard.hf_source import hf_module_tensors
    from hybridmem.reshard.transforms import build_local

    text = {**_COMMON, **CONFIGS[model_type]}
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                  out_hidden_size=_COMMON["hidden_size"], num_position_embeddings=16)
    cfg = transformers.AutoConfig.for_model(multimodal, text_config=text, vision_config=vision)
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(cfg).save_pretrained(tmp_path)
    saved = _checkpoint(tmp_path)
    spec = ModelSpec.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert spec == ModelSpec.from_hf_config(cfg) == ModelSpec.from_hf_config(cfg.text_config)
    assert spec.family == model_type
    prefix = "model.language_model."
    weights = {("model." + n[len(prefix):] if n.startswith(prefix) else n): t for n, t in saved.items()
               if not n.startswith("model.visual.")}
    assert {n: tuple(t.shape) for n, t in weights.items()} == spec.full_shapes()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    params = {n: p.detach() for n, p in model.named_parameters()}
    ours = hf_module_tensors(spec)
    assert sorted(ours) == sorted(params)
    for name, local in ours.items():
        assert torch.equal(build_local(local, weights, dtype=torch.float32), params[name]), name


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_qwen3_5_module_tensors_are_transformers_parameters(model_type, tmp_path):
    """The FSDP2 source layout's tensors (``hf_module_tensors``) are transformers' own parameters: the same
    names (in_proj_qkv and conv1d fused as the checkpoint holds them; Qwen3.5-MoE's experts fused as
    transformers fuses them) and, built from the saved checkpoint, the same values."""
    from hybridmem.reshard.hf_source import hf_module_tensors
    from hybridmem.reshard.transforms import build_local

    cfg = transformers.AutoConfig.for_model(model_type, **{**_COMMON, **CONFIGS[model_type]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(tmp_path)
    weights = _checkpoint(tmp_path)
    params = {n: p.detach() for n, p in model.named_parameters()}
    ours = hf_module_tensors(ModelSpec.from_hf_config(cfg))
    assert sorted(ours) == sorted(params)
    for name, local in ours.items():
        assert torch.equal(build_local(local, weights, dtype=params[name].dtype), params[name]), name


def test_qwen3_5_layers_are_the_checkpoints_rows_as_vllm_splits_them(tmp_path):
    """At TP 2, vLLM's fused gated delta-net projections hold each rank's half of q, k, v (rows of the
    checkpoint's in_proj_qkv and conv1d) and z, and of b and a; A_log and dt_bias by value heads; the
    full-attention q_proj ([q_h; gate_h] per head) by heads. Slices of transformers' own tensors, cut as
    vLLM's loaders (``MergedColumnParallelLinear``, ``mamba_v2_sharded_weight_loader``) cut them."""
    from hybridmem.reshard import shard, vllm_layout

    cfg = transformers.AutoConfig.for_model("qwen3_5_text", **{**_COMMON, **CONFIGS["qwen3_5_text"]})
    torch.manual_seed(0)
    weights = {n: p.detach()
               for n, p in transformers.AutoModelForCausalLM.from_config(cfg).named_parameters()}
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.linear_attention_layers == (0, 2)
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    layout = vllm_layout(spec, ParallelLayout(tp=2), 2)
    for rank in range(2):
        local = shard(weights, layout, rank)

        def half(t, r=rank):
            return t.chunk(2)[r]

        la, at = "model.layers.0.linear_attn.", "model.layers.1.self_attn."
        for fused, parts in (("in_proj_qkv.weight", "in_proj_z.weight"), ("conv1d.weight", None)):
            q, k, v = weights[la + fused].split([key, key, value])
            want = [half(q), half(k), half(v)] + ([half(weights[la + parts])] if parts else [])
            name = la + ("in_proj_qkvz.weight" if parts else "conv1d.weight")
            assert torch.equal(local[name], torch.cat(want)), (rank, name)
        b, a = weights[la + "in_proj_b.weight"], weights[la + "in_proj_a.weight"]
        assert torch.equal(local[la + "in_proj_ba.weight"], torch.cat([half(b), half(a)]))
        for name in ("A_log", "dt_bias"):
            assert torch.equal(local[la + name], half(weights[la + name]))
        assert torch.equal(local[la + "out_proj.weight"],
                           weights[la + "out_proj.weight"].chunk(2, dim=1)[rank])
        qkv = local[at + "qkv_proj.weight"]
        q_rows = weights[at + "q_proj.weight"].shape[0] // 2  # this rank's heads, each [q_h; gate_h]
        assert torch.equal(qkv[:q_rows], half(weights[at + "q_proj.weight"]))
        assert "model.layers.0.self_attn.qkv_proj.weight" not in local and la + "A_log" in local


def test_ernie4_5_biases_and_the_embedded_engine_are_refused_by_name():
    """transformers' Ernie 4.5 gives every projection a bias with ``use_bias``; vLLM's Ernie class builds
    none."""
    from hybridmem.engines.nn.config import embedded_spec

    cfg = transformers.AutoConfig.for_model("ernie4_5", **{**_COMMON, **CONFIGS["ernie4_5"]})
    with pytest.raises(ValueError,
                       match=r"model_type='ernie4_5' does not run in the embedded engine \(Ernie 4.5"):
        embedded_spec(cfg)
    cfg = transformers.AutoConfig.for_model("ernie4_5", **{**_COMMON, **CONFIGS["ernie4_5"]}, use_bias=True)
    with pytest.raises(ValueError, match="use_bias=True is not supported for ernie4_5"):
        ModelSpec.from_hf_config(cfg)


@pytest.mark.parametrize("biases", [dict(attention_bias=True), dict(mlp_bias=True),
                                    dict(attention_bias=True, mlp_bias=True)],
                         ids=["attention", "mlp", "both"])
@pytest.mark.parametrize("model_type", ["llama", "granite"])
def test_llama_and_granite_biases_are_what_transformers_saves(model_type, biases, tmp_path):
    """``attention_bias`` gives q/k/v and o a bias, ``mlp_bias`` gate/up/down: every one is in the spec."""
    cfg, saved = _saved(model_type, tmp_path, **biases)
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.full_shapes() == saved
    assert ("model.layers.0.self_attn.o_proj.bias" in saved) is biases.get("attention_bias", False)
    assert ("model.layers.0.mlp.down_proj.bias" in saved) is biases.get("mlp_bias", False)


@pytest.mark.parametrize("biases,names", [
    (dict(attention_bias=True), "self_attn.o_proj.bias"),
    (dict(mlp_bias=True), "mlp.gate_proj.bias, mlp.up_proj.bias, mlp.down_proj.bias"),
], ids=["attention", "mlp"])
def test_the_embedded_engine_refuses_biases_it_has_no_place_for(biases, names, tmp_path):
    """The embedded engine's blocks add q/k/v biases only: a Llama whose o projection or MLP has biases
    is refused with the config key and the tensors it would drop."""
    from hybridmem.engines import ReferenceEngine

    cfg, _ = _saved("llama", tmp_path, **biases)
    key = next(iter(biases))
    with pytest.raises(ValueError, match=rf"{key}=True .*{names}"):
        ReferenceEngine(cfg.to_dict())


@pytest.mark.parametrize("tp,pp,ep", [(2, 1, 2), (4, 1, 4), (1, 2, 1), (2, 1, 1)])
def test_gpt_oss_down_bias_is_where_vllms_loader_puts_it(tp, pp, ep):
    """vLLM's gpt-oss loader (``_load_weights_other``, the same in 0.32 and 0.33) copies the checkpoint's
    ``down_proj_bias`` into ``w2_bias``: with expert parallelism every rank gets its own experts' rows
    whole; otherwise TP rank 0 of every pipeline stage gets them whole and the other TP ranks zeros (a
    row-parallel bias is added once). tests/reshard/test_vllm_names.py checks the same against the loader
    itself."""
    from hybridmem.reshard import shard, vllm_layout

    cfg = transformers.AutoConfig.for_model("gpt_oss",
                                            **{**_COMMON, **CONFIGS["gpt_oss"], "num_hidden_layers": 2,
                                               "num_key_value_heads": 4})
    spec = ModelSpec.from_hf_config(cfg)
    weights = {n: torch.arange(1, 1 + torch.Size(s).numel(), dtype=torch.float32).reshape(s)
               for n, s in spec.full_shapes().items()}
    layout = vllm_layout(spec, ParallelLayout(tp=tp, pp=pp, ep=ep), 4)
    experts = spec.num_experts // ep
    for rank in range(4):
        tp_rank, stage = rank % tp, (rank // tp) % pp
        biases = {n: t for n, t in shard(weights, layout, rank).items() if n.endswith(".w2_bias")}
        layers = range(stage * 2 // pp, (stage + 1) * 2 // pp)
        assert sorted(biases) == [f"model.layers.{i}.mlp.experts.routed_experts.w2_bias"
                                  for i in layers], rank
        for i in layers:
            full = weights[f"model.layers.{i}.mlp.experts.down_proj_bias"]
            if ep > 1:
                ep_rank = rank % ep
                want = full[ep_rank * experts:(ep_rank + 1) * experts]
            else:
                want = full if tp_rank == 0 else torch.zeros_like(full)
            assert torch.equal(biases[f"model.layers.{i}.mlp.experts.routed_experts.w2_bias"], want), (
                rank, i)


def _kimi_k25(tmp_path):
    """A Kimi-K2.5 checkpoint as the Hub holds it: a DeepSeek-V3 text model saved by transformers, its tensors
    under ``language_model.`` (``language_model.model.layers.*``, ``language_model.lm_head.weight``), and a
    config.json nesting its config (``model_type`` ``kimi_k2``, as the Hub's says) as ``text_config`` beside a
    vision config. transformers 5.19's save_pretrained of its multimodal class does not write these names (its
    reverse rename turns ``layers`` into ``blocks``), so the text model's checkpoint is the reference. Returns
    ``(config object, config.json dict, {checkpoint name: tensor})``."""
    text, _ = _saved("deepseek_v3", tmp_path / "text", tie_word_embeddings=False)
    weights = {"language_model." + n: t for n, t in _checkpoint(tmp_path / "text").items()}
    vision = dict(patch_size=14, num_attention_heads=2, num_hidden_layers=1, hidden_size=32,
                  intermediate_size=32, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2)
    cfg = transformers.AutoConfig.for_model("kimi_k25", text_config=text.to_dict(), vision_config=vision,
                                            projection_hidden_size=32, tie_word_embeddings=False)
    data = cfg.to_dict()
    data["architectures"] = ["KimiK25ForConditionalGeneration"]
    data["text_config"]["model_type"] = "kimi_k2"
    (tmp_path / "kimi").mkdir()
    (tmp_path / "kimi" / "config.json").write_text(json.dumps(data))
    safetensors_torch.save_file(weights, tmp_path / "kimi" / "model.safetensors")
    return cfg, data, weights


def test_kimi_k25_is_deepseek_v3_under_its_multimodal_names(tmp_path):
    """Kimi-K2.5 (``kimi_k25``): its config (object or config.json) gives DeepSeek-V3's spec of its
    ``text_config``, marked multimodal; the spec's checkpoint is the Hub's (the text model's under
    ``language_model.``); transformers' Kimi_K25ForConditionalGeneration of that checkpoint holds exactly the
    source layout's module tensors (``model.language_model.*``, ``lm_head.weight``) beside its vision tower
    and projector, each equal to the checkpoint's values where the layout says."""
    import dataclasses

    from hybridmem.reshard.hf_source import hf_module_tensors, looks_hf_named
    from hybridmem.reshard.transforms import build_local

    cfg, data, weights = _kimi_k25(tmp_path)
    spec = ModelSpec.from_hf_config(data)
    assert spec == ModelSpec.from_hf_config(cfg)
    assert spec.family == "deepseek_v3" and spec.multimodal == "kimi_k25"
    assert dataclasses.replace(spec, multimodal="") == ModelSpec.from_hf_config(cfg.text_config)
    assert spec.full_shapes() == {n: tuple(t.shape) for n, t in weights.items()}
    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "kimi", dtype=torch.float32)
    params = {n: p.detach() for n, p in model.named_parameters()}
    params.update((n, b) for n, b in model.named_buffers() if n in model.state_dict())  # the router bias
    text = {n: p for n, p in params.items()
            if not n.startswith(("model.vision_tower.", "model.mm_projector."))}
    assert len(text) < len(params)  # the multimodal model, vision tower and projector left out
    assert looks_hf_named(params)  # a sync takes the whole model's names as transformers'
    ours = hf_module_tensors(spec)
    assert sorted(ours) == sorted(text)
    for name, local in ours.items():
        assert torch.equal(build_local(local, weights, dtype=torch.float32), text[name]), name


def test_kimi_k25_is_refused_by_the_embedded_engine_and_megatron(tmp_path):
    from hybridmem.adapters.megatron import megatron_model_spec_dict
    from hybridmem.engines import ReferenceEngine

    _, data, _ = _kimi_k25(tmp_path)
    with pytest.raises(ValueError, match=r"model_type='kimi_k25' does not run in the embedded engine"):
        ReferenceEngine(data)
    with pytest.raises(ValueError,
                       match=r"multimodal='kimi_k25' \(family='deepseek_v3'\) has no Megatron-core layout"):
        megatron_layout(ModelSpec.from_hf_config(data), ParallelLayout(), 1)
    megatron = pytest.importorskip("megatron.core.transformer")
    config = megatron.TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                        add_bias_linear=False, gated_linear_unit=True,
                                        use_cpu_initialization=True)
    with pytest.raises(ValueError,
                       match="model_type='kimi_k25' cannot be trained in Megatron-core: a multimodal model"):
        megatron_model_spec_dict(config, vocab_size=100, model_type="kimi_k25")


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_families_are_refused_by_the_embedded_engine_and_megatron(model_type, tmp_path):
    from hybridmem.adapters.megatron import megatron_model_spec_dict
    from hybridmem.engines import ReferenceEngine

    cfg, _ = _saved(model_type, tmp_path)
    with pytest.raises(ValueError,
                       match=rf"model_type='{model_type}' does not run in the embedded engine \(DeepSeek "
                                         r"sparse attention"):
        ReferenceEngine(cfg.to_dict())
    with pytest.raises(ValueError, match=f"family='{model_type}' has no Megatron-core layout: .*indexer"):
        megatron_layout(ModelSpec.from_hf_config(cfg), ParallelLayout(), 1)
    megatron = pytest.importorskip("megatron.core.transformer")
    config = megatron.TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                                        add_bias_linear=False, gated_linear_unit=True,
                                        use_cpu_initialization=True)
    with pytest.raises(ValueError,
                       match=f"model_type='{model_type}' cannot be trained in Megatron-core: .*indexer"):
        megatron_model_spec_dict(config, vocab_size=100, model_type=model_type)


@pytest.mark.parametrize("model_type,overrides,named", [
    ("glm_moe_dsa", dict(index_topk_freq=2), r"layers \[2\] \(index_topk_freq=2\) reuse another layer"),
    ("glm_moe_dsa", dict(index_topk_pattern="FSF"), r"layers \[1\] .*reuse another layer's top-k"),
    ("deepseek_v32", dict(mlp_layer_types=["dense", "sparse", "dense"]),
     "mlp_layer_types=.* is not supported"),
])
def test_sparse_attention_configs_without_layout_rows_are_refused_by_name(model_type, overrides, named):
    cfg = transformers.AutoConfig.for_model(model_type, **{**_COMMON, **CONFIGS[model_type], **overrides})
    with pytest.raises(ValueError, match=named):
        ModelSpec.from_hf_config(cfg)
    # transformers' config object refuses q_lora_rank=None for these families; a config.json may still say it.
    config = dict(_COMMON, model_type=model_type, **{**CONFIGS[model_type], "q_lora_rank": None})
    with pytest.raises(ValueError, match=f"q_lora_rank=None is not supported for {model_type}"):
        ModelSpec.from_hf_config(config)


# Where vLLM's loaders put each tensor of DeepSeek sparse attention's indexer, written from vLLM's source (the
# same in 0.32 and 0.33), not from hybridmem's tables: {vLLM parameter of a layer: the checkpoint tensors
# whose rows it holds, in order}. Every TP rank holds each one whole:
# - vllm/model_executor/models/deepseek_v2.py, ``Indexer.__init__``: ``wq_b`` is a ``ReplicatedLinear``;
#   ``wk_weights_proj`` a ``MergedColumnParallelLinear(hidden, [head_dim, n_head], disable_tp=True)``;
#   ``k_norm`` a ``LayerNorm`` (weight and bias).
# - the same file, ``DeepseekV2Model.load_weights``: ``("wk_weights_proj", "wk", 0)`` and
#   ``("wk_weights_proj", "weights_proj", 1)``, so shard 0 (the first head_dim rows) is ``wk``, shard 1
#   ``weights_proj``.
# - the CUDA model vLLM builds on GPUs (vllm/models/deepseek_v32/attention.py ``DeepseekV32Indexer.__init__``
#   and nvidia/model.py ``DeepseekV32Model.load_weights``) has the same parameters and mapping
#   (benchmarks/gpu_suite.py's ``dsa`` part checks that class's loaded parameters on a GPU).
INDEXER_PLACEMENT = {
    "self_attn.indexer.wq_b.weight": ("self_attn.indexer.wq_b.weight",),
    "self_attn.indexer.wk_weights_proj.weight": ("self_attn.indexer.wk.weight",
                                                 "self_attn.indexer.weights_proj.weight"),
    "self_attn.indexer.k_norm.weight": ("self_attn.indexer.k_norm.weight",),
    "self_attn.indexer.k_norm.bias": ("self_attn.indexer.k_norm.bias",),
}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_indexer_is_where_vllms_loader_puts_it(model_type, tp):
    """Each TP rank's indexer tensors are :data:`INDEXER_PLACEMENT`'s rows of the checkpoint, whole on every
    rank; the layers' MLA and MoE tensors are DeepSeek-V3's (tests/reshard/test_vllm_names.py checks all of it
    against vLLM's loaders themselves)."""
    from hybridmem.reshard import shard, vllm_layout

    cfg = transformers.AutoConfig.for_model(model_type, **{**_COMMON, **CONFIGS[model_type]})
    spec = ModelSpec.from_hf_config(cfg)
    weights = {n: torch.arange(1, 1 + torch.Size(s).numel(), dtype=torch.float32).reshape(s) + 1000 * k
               for k, (n, s) in enumerate(spec.full_shapes().items())}
    layout = vllm_layout(spec, ParallelLayout(tp=tp), tp)
    for rank in range(tp):
        indexer = {n: t for n, t in shard(weights, layout, rank).items() if ".indexer." in n}
        want = {f"model.layers.{i}.{vllm}": torch.cat([weights[f"model.layers.{i}.{hf}"] for hf in parts])
                for i in range(_COMMON["num_hidden_layers"]) for vllm, parts in INDEXER_PLACEMENT.items()}
        assert sorted(indexer) == sorted(want), rank
        for name, tensor in want.items():
            assert torch.equal(indexer[name], tensor), (rank, name)
