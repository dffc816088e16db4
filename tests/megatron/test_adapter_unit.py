"""Adapter pieces that need no process group: input checks and the model spec dict."""

from __future__ import annotations

import pytest
import torch

from hybridmem.adapters.megatron import (
    MegatronTrainingState,
    leaf_optimizers,
    megatron_model_spec_dict,
)

pytestmark = pytest.mark.megatron


def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=3, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
                gated_linear_unit=True, add_bias_linear=False, use_cpu_initialization=True)
    return TransformerConfig(**{**base, **overrides})


def test_model_spec_dict_from_transformer_config():
    d = megatron_model_spec_dict(_config(kv_channels=16), vocab_size=100)
    assert (d["model_type"], d["num_attention_heads"], d["num_key_value_heads"],
            d["head_dim"]) == ("llama", 8, 2, 16)
    assert (d["intermediate_size"], d["num_hidden_layers"], d["vocab_size"]) == (96, 3, 100)
    # kv_channels defaults to hidden_size / heads in Megatron.
    assert megatron_model_spec_dict(_config(), vocab_size=100)["head_dim"] == 8


def test_model_spec_dict_names_what_it_cannot_express():
    with pytest.raises(ValueError, match=r"add_bias_linear=True.*gated_linear_unit=False"):
        megatron_model_spec_dict(_config(add_bias_linear=True, gated_linear_unit=False), vocab_size=100)


def _mla_config(**overrides):
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    base = dict(num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                gated_linear_unit=True, add_bias_linear=False, use_cpu_initialization=True,
                normalization="RMSNorm", qk_layernorm=True, multi_latent_attention=True, q_lora_rank=32,
                kv_lora_rank=24, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="rope",
                num_moe_experts=8, moe_ffn_hidden_size=12, moe_router_topk=2,
                moe_shared_expert_intermediate_size=12, moe_layer_freq=[0, 1, 1],
                moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
    return MLATransformerConfig(**{**base, **overrides})


@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["q-lora", "no-q-lora"])
def test_model_spec_dict_of_multi_latent_attention_is_deepseek_v3s(q_lora_rank):
    """A DeepSeek-V3-style MLATransformerConfig gives the spec transformers' DeepseekV3Config of the same
    model gives, with or without the engine naming the family."""
    import transformers

    from hybridmem.reshard import ModelSpec

    want = ModelSpec.from_hf_config(transformers.DeepseekV3Config(
        num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=96, vocab_size=100, q_lora_rank=q_lora_rank, kv_lora_rank=24, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, moe_intermediate_size=12, n_shared_experts=1,
        first_k_dense_replace=1, num_experts_per_tok=2, n_group=1, topk_group=1, topk_method="noaux_tc",
        tie_word_embeddings=False))
    config = _mla_config(q_lora_rank=q_lora_rank)
    for model_type in (None, "deepseek_v3"):
        got = ModelSpec.from_hf_config(megatron_model_spec_dict(config, vocab_size=100,
                                                                model_type=model_type))
        assert got == want, model_type


def test_multi_latent_attention_for_another_family_is_refused():
    with pytest.raises(ValueError,
                       match=r"not a glm4_moe model as the engine serves it: multi-latent attention "
                                         r"\(multi_latent_attention\): Megatron True, glm4_moe False"):
        megatron_model_spec_dict(_mla_config(), vocab_size=100, model_type="glm4_moe")
    with pytest.raises(ValueError,
                       match=r"router bias \(moe_router_enable_expert_bias\): Megatron False, "
                             r"deepseek_v3 True"):
        megatron_model_spec_dict(_mla_config(moe_router_enable_expert_bias=False,
                                             moe_router_score_function="softmax"),
                                 vocab_size=100)


def test_model_spec_dict_maps_qkv_bias_to_qwen2():
    d = megatron_model_spec_dict(_config(add_qkv_bias=True), vocab_size=100)
    assert (d["model_type"], d["qkv_bias"], d["attention_bias"]) == ("qwen2", True, True)


def test_training_state_rejects_an_unwrapped_chunk():
    with pytest.raises(TypeError, match=r"model chunk 0 \(Linear\) is not wrapped"):
        MegatronTrainingState([torch.nn.Linear(2, 2)], None)


def test_leaf_optimizers_flattens_nested_chains():
    class Chain:
        def __init__(self, *opts):
            self.chained_optimizers = list(opts)

    a, b, c = object(), object(), object()
    assert leaf_optimizers(Chain(a, Chain(b, c))) == [a, b, c]
    assert leaf_optimizers(a) == [a]


def test_named_weights_carry_the_router_expert_bias_buffer():
    import torch

    from hybridmem.adapters.megatron import megatron_named_weights

    class Router(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 8))
            self.register_buffer("expert_bias", torch.arange(4.0))
            self.register_buffer("local_tokens_per_expert", torch.zeros(4))

    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.router = Router()
    named = dict(megatron_named_weights([model]))
    assert set(named) == {"mlp.router.weight", "mlp.router.expert_bias"}
    assert named["mlp.router.expert_bias"] is model.mlp.router.expert_bias


def _hf_spec(model_type: str, **kw):
    from hybridmem.reshard import ModelSpec

    transformers = pytest.importorskip("transformers")
    return ModelSpec.from_hf_config(transformers.AutoConfig.for_model(model_type, **kw))


@pytest.mark.parametrize("model_type,megatron,hf", [
    # Mixtral: every layer MoE, no shared expert; its HF config names one expert's width intermediate_size.
    ("mixtral", dict(num_moe_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2),
     dict(num_local_experts=4, intermediate_size=32, num_experts_per_tok=2)),
    # GLM-4.5: q/k/v bias, the first layer dense, shared expert, router bias.
    ("glm4_moe", dict(add_qkv_bias=True, num_moe_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
                      moe_shared_expert_intermediate_size=16, moe_router_enable_expert_bias=True,
                      moe_layer_freq=[0, 1, 1], moe_router_score_function="sigmoid"),
     dict(attention_bias=True, n_routed_experts=4, moe_intermediate_size=16, n_shared_experts=1,
          first_k_dense_replace=1, num_experts_per_tok=2, n_group=1, topk_group=1)),
    # Qwen3: q/k norms.
    ("qwen3", dict(qk_layernorm=True), dict()),
    ("phi3", dict(), dict()),
])
def test_model_spec_dict_of_the_engines_family_is_the_hf_configs_spec(model_type, megatron, hf):
    """The spec read from a GPTModel's config for the family the engine serves equals the one transformers'
    config of that model gives."""
    from hybridmem.reshard import ModelSpec

    got = ModelSpec.from_hf_config(megatron_model_spec_dict(_config(**megatron), vocab_size=100,
                                                            model_type=model_type))
    want = _hf_spec(model_type, num_hidden_layers=3, hidden_size=64, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=8, vocab_size=100, tie_word_embeddings=False,
                    **({"intermediate_size": 96} | hf))
    assert got == want


def test_model_spec_dict_names_what_differs_from_the_engines_family():
    with pytest.raises(ValueError,
                       match=r"not a qwen3 model as the engine serves it: q/k norms \(qk_layernorm\): "
                                         r"Megatron False, qwen3 True"):
        megatron_model_spec_dict(_config(), vocab_size=100, model_type="qwen3")
    with pytest.raises(ValueError,
                       match=r"router bias \(moe_router_enable_expert_bias\): Megatron False, glm4_moe True"):
        megatron_model_spec_dict(_config(num_moe_experts=4, moe_router_topk=2,
                                         moe_shared_expert_intermediate_size=96),
                                 vocab_size=100, model_type="glm4_moe")
    with pytest.raises(ValueError, match="model_type='gemma3_text' cannot be trained in Megatron-core"):
        megatron_model_spec_dict(_config(), vocab_size=100, model_type="gemma3_text")
    with pytest.raises(ValueError,
                       match="model_type='qwen3_5_text' cannot be trained in Megatron-core: "
                             ".*gated delta-net"):
        megatron_model_spec_dict(_config(), vocab_size=100, model_type="qwen3_5_text")
    with pytest.raises(ValueError,
                       match="model_type='qwen3_5_moe_text' cannot be trained in Megatron-core: .*gated"):
        megatron_model_spec_dict(_config(num_moe_experts=4, moe_router_topk=2), vocab_size=100,
                                 model_type="qwen3_5_moe_text")
    with pytest.raises(ValueError,
                       match="model_type='gemma4_text' cannot be trained in Megatron-core: .*head width"):
        megatron_model_spec_dict(_config(), vocab_size=100, model_type="gemma4_text")
    # A Llama's attention_bias biases o_proj as well; Megatron's add_qkv_bias does not.
    with pytest.raises(ValueError, match=r"not a llama model .*output-projection bias \(add_bias_linear\): "
                                         r"Megatron False, llama True"):
        megatron_model_spec_dict(_config(add_qkv_bias=True), vocab_size=100, model_type="llama")
