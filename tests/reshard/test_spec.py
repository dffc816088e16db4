"""ModelSpec.from_hf_config and full_shapes against real transformers models built from configs."""

from __future__ import annotations

import pytest
import torch

from hybridmem.reshard import ModelSpec

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=24,
            num_hidden_layers=2, vocab_size=50)


def _config(family: str, tied: bool):
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "deepseek_v3": transformers.DeepseekV3Config,
    }[family]
    extra = {}
    if family == "deepseek_v3":
        return cls(**dict(TINY, num_key_value_heads=4, num_hidden_layers=3), tie_word_embeddings=tied,
                   n_routed_experts=4, n_shared_experts=2, moe_intermediate_size=6, num_experts_per_tok=2,
                   n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=8, kv_lora_rank=6,
                   qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)
    if family in ("qwen3", "qwen3_moe"):
        extra["head_dim"] = 8  # not hidden/heads, to catch a spec that derives it
    if family.endswith("moe"):
        extra.update(num_experts=4, moe_intermediate_size=6, num_experts_per_tok=2)
    if family == "qwen2_moe":
        extra["shared_expert_intermediate_size"] = 10
    return cls(**TINY, tie_word_embeddings=tied, **extra)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_full_shapes_match_hf_model(family, tied):
    cfg = _config(family, tied)
    spec = ModelSpec.from_hf_config(cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    hf = {name: tuple(p.shape) for name, p in model.named_parameters()}
    # DeepSeek-V3's routing-score correction bias is a buffer in HF; it is weight-synced like a parameter.
    hf.update({name: tuple(b.shape) for name, b in model.named_buffers()
               if name.endswith("e_score_correction_bias")})
    ours = spec.full_shapes()
    # transformers 5 may fuse experts into 3-D parameters; compare per-expert names against their slices.
    fused = {n for n in hf if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    if fused:
        for name in fused:
            prefix = name.rsplit(".", 1)[0]
            num = hf[name][0]
            assert num == spec.num_experts, (name, hf[name])
            h, i = spec.hidden_size, spec.moe_intermediate_size
            assert hf[name][1:] == ((2 * i, h) if name.endswith("gate_up_proj") else (h, i)), (name, hf[name])
            ours_names = [n for n in ours if n.startswith(prefix + ".")]
            assert len(ours_names) == 3 * num
            hf.pop(name)
        ours = {n: s for n, s in ours.items() if ".mlp.experts." not in n}
    assert ours == hf


def test_from_dict_and_flags():
    d = dict(model_type="qwen2", **TINY, tie_word_embeddings=True)
    spec = ModelSpec.from_hf_config(d)
    assert spec.qkv_bias and not spec.qk_norm and spec.tie_word_embeddings and spec.head_dim == 4
    assert ModelSpec.from_hf_config(dict(d, model_type="llama")).qkv_bias is False
    assert ModelSpec.from_hf_config(dict(d, model_type="qwen3", head_dim=8)).qk_norm


def test_qwen3_moe_config_json_with_num_local_experts():
    # transformers >= 5.20 writes Qwen3-MoE's expert count under num_local_experts in config.json.
    d = dict(model_type="qwen3_moe", **TINY, head_dim=8, num_local_experts=4, moe_intermediate_size=6,
             num_experts_per_tok=2)
    spec = ModelSpec.from_hf_config(d)
    assert spec.num_experts == 4
    # The config class reads the same file the same way.
    assert transformers.Qwen3MoeConfig(**{k: v for k, v in d.items() if k != "model_type"}).num_experts == 4


def test_qwen2_moe_without_qkv_bias_key_has_bias():
    d = dict(model_type="qwen2_moe", **TINY, num_experts=4, moe_intermediate_size=6, num_experts_per_tok=2,
             shared_expert_intermediate_size=10)
    spec = ModelSpec.from_hf_config(d)
    hf = transformers.Qwen2MoeConfig(**{k: v for k, v in d.items() if k != "model_type"})
    assert spec.qkv_bias is True and hf.qkv_bias is True
    assert "model.layers.0.self_attn.q_proj.bias" in spec.full_shapes()
    assert ModelSpec.from_hf_config(dict(d, qkv_bias=False)).qkv_bias is False


def test_bad_specs_name_values():
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        ModelSpec.from_hf_config(dict(model_type="gpt2", **TINY))
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by num_key_value_heads=4"):
        ModelSpec(hidden_size=8, num_attention_heads=6, num_key_value_heads=4, head_dim=2,
                  intermediate_size=8, num_hidden_layers=1, vocab_size=8)
    with pytest.raises(ValueError, match="num_experts=0"):
        ModelSpec(family="qwen3_moe", hidden_size=8, num_attention_heads=4, num_key_value_heads=4, head_dim=2,
                  intermediate_size=0, num_hidden_layers=1, vocab_size=8)


def test_deepseek_v3_from_config_and_refusals():
    spec = ModelSpec.from_hf_config(_config("deepseek_v3", False))
    assert spec.is_mla and spec.is_moe and spec.has_router_bias
    assert (spec.head_dim, spec.num_key_value_heads, spec.shared_expert_intermediate_size) == (6, 4, 12)
    assert [spec.is_moe_layer(i) for i in range(3)] == [False, True, True]
    d = dict(model_type="deepseek_v3", hidden_size=16, num_attention_heads=4, num_hidden_layers=2,
             vocab_size=50, intermediate_size=24, moe_intermediate_size=6, n_routed_experts=4, kv_lora_rank=6,
             qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4, q_lora_rank=None)
    assert ModelSpec.from_hf_config(d).q_lora_rank == 0
    with pytest.raises(ValueError, match="rope_interleave=False"):
        ModelSpec.from_hf_config(dict(d, rope_interleave=False))
    with pytest.raises(ValueError, match="moe_layer_freq=2"):
        ModelSpec.from_hf_config(dict(d, moe_layer_freq=2))
    with pytest.raises(ValueError, match="head_dim=5 must be qk_nope_head_dim"):
        ModelSpec(family="deepseek_v3", hidden_size=8, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=5, intermediate_size=8, num_hidden_layers=1, vocab_size=8, num_experts=2,
                  moe_intermediate_size=2, kv_lora_rank=2, qk_nope_head_dim=2, qk_rope_head_dim=2,
                  v_head_dim=2)
