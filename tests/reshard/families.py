"""Tiny transformers configs of every family hybridmem describes, shared by the tests that go over all of
them (``transformers.AutoConfig.for_model(family, **{**COMMON, **kw})`` for each ``MODELS`` entry)."""

from __future__ import annotations

COMMON = dict(hidden_size=128, num_hidden_layers=2, vocab_size=200, rms_norm_eps=1e-6,
              max_position_embeddings=128, torch_dtype="float32")
# head_dim = hidden_size / num_attention_heads = 32: the CPU attention backend's smallest head size, and
# vLLM's Qwen2 derives head_dim from hidden_size whatever the config says.
MODELS = {
    "llama-tied": ("llama",
                   dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32, intermediate_size=96,
                        tie_word_embeddings=True)),
    "qwen2-bias-kv2": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                     tie_word_embeddings=False)),
    "qwen3-kv2": ("qwen3",
                  dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96,
                       tie_word_embeddings=False)),
    "qwen2-moe": ("qwen2_moe", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                                    num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=64, intermediate_size=96,
                                    tie_word_embeddings=False)),
    "qwen3-moe-tied": ("qwen3_moe",
                       dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96,
                            tie_word_embeddings=True)),
    "deepseek-v3": ("deepseek_v3", dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
                                        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                        moe_intermediate_size=32, q_lora_rank=48, kv_lora_rank=32,
                                        qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                                        first_k_dense_replace=1, n_group=1, topk_group=1,
                                        topk_method="noaux_tc", tie_word_embeddings=False)),
    "deepseek-v3-no-q-lora": ("deepseek_v3",
                              dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
                                   n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                   moe_intermediate_size=32, q_lora_rank=None, kv_lora_rank=32,
                                   qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                                   first_k_dense_replace=1, n_group=1, topk_group=1,
                                   topk_method="greedy", tie_word_embeddings=False)),
    # The families described since: Mistral (Llama's rules), Mixtral (block_sparse_moe, w1/w3/w2), Phi-3
    # (fused qkv_proj and gate_up_proj in the checkpoint), Gemma 3 (sandwich norms, q/k norms, tied), GLM-4.5
    # (q/k/v bias, first layer dense, shared experts, a router bias vLLM always builds).
    "mistral-kv2": ("mistral",
                    dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96,
                         tie_word_embeddings=False)),
    "mixtral": ("mixtral",
                dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=32,
                     num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    "phi3-kv2": ("phi3",
                 dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)),
    "granite-tied": ("granite", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                     embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0,
                                     tie_word_embeddings=True)),
    # Llama and Granite with every bias transformers builds: q/k/v and o (attention_bias), gate/up/down
    # (mlp_bias).
    "llama-bias": ("llama",
                   dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96,
                        attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    "granite-bias": ("granite", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                                     embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0,
                                     attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    # Ernie 4.5: Llama's tensors (vLLM's Ernie class is its Llama with interleaved rotary pairs), fewer kv
    # heads than TP 4 (replicated there), untied.
    "ernie4.5-kv2": ("ernie4_5",
                     dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96,
                          tie_word_embeddings=False)),
    "gemma3-tied": ("gemma3_text",
                    dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96)),
    "glm4-moe-bias": ("glm4_moe",
                      dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96,
                           n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=32,
                           first_k_dense_replace=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                           attention_bias=True, tie_word_embeddings=False,
                           # vLLM's GLM-4.5 refuses a pipeline stage without a MoE layer.
                           num_hidden_layers=3)),
    # gpt-oss: q/k/v/o biases, attention sinks, router bias, experts stacked and transposed in the checkpoint
    # with interleaved gate/up columns and biases (vLLM zeroes the down bias on TP ranks > 0). vLLM splits its
    # kv heads without replicating them, so TP is at most num_key_value_heads.
    "gpt-oss": ("gpt_oss",
                dict(num_attention_heads=4, num_key_value_heads=4, head_dim=32, intermediate_size=128,
                     num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                     tie_word_embeddings=False)),
    # Gemma 4 (dense, tied): a sliding layer and a full-attention layer of twice the head width and one kv
    # head (replicated at TP 2 and 4) whose values are its keys (no v_proj; vLLM loads k_proj into K and V),
    # and a layer_scalar per layer (a persistent buffer in vLLM, filled by its loader).
    "gemma4": ("gemma4_text",
               dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
                    num_global_key_value_heads=1, attention_k_eq_v=True, intermediate_size=96,
                    hidden_size_per_layer_input=0, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"])),
    # Gemma 4 MoE (untied): routed experts beside every layer's dense MLP, the router's scales and three more
    # norms; the checkpoint stacks each expert's [gate; up] rows over experts.
    "gemma4-moe": ("gemma4_text",
                   dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
                        num_global_key_value_heads=1, attention_k_eq_v=True, intermediate_size=96,
                        hidden_size_per_layer_input=0, sliding_window=16,
                        layer_types=["sliding_attention", "full_attention"], enable_moe_block=True,
                        num_experts=4, top_k_experts=2, moe_intermediate_size=32,
                        tie_word_embeddings=False)),
    # Gemma 4 with per-layer input embeddings (transformers' default; tied, full-attention layers with their
    # own v_proj): embed_tokens_per_layer over a vocabulary of its own (padded and split by vLLM as the token
    # embedding; TP 4's last rank holds padding only), its model projection (rows split), their norm, and
    # every layer's gate, projection and norm (whole on every rank).
    "gemma4-ple": ("gemma4_text",
                   dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64,
                        intermediate_size=96, hidden_size_per_layer_input=16, vocab_size_per_layer_input=136,
                        sliding_window=16, layer_types=["sliding_attention", "full_attention"])),
    # Llama 4 text: a dense layer then a MoE layer (interleave_moe_layer_step 2) with a shared expert, experts
    # stacked and transposed in the checkpoint (gate_up_proj [E, H, 2I]), q/k rows reordered per head by
    # vLLM's loader, the second layer without RoPE.
    "llama4": ("llama4_text",
               dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=32,
                    intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1,
                    interleave_moe_layer_step=2, no_rope_layers=[1, 0], attention_chunk_size=None,
                    tie_word_embeddings=False)),
    # MiniMax-M2: block_sparse_moe with experts w1/w3/w2, a router correction bias (use_routing_bias), q/k
    # norms over all heads that vLLM splits by heads (k's replicated with its kv heads at TP 4), partial RoPE.
    "minimax-m2": ("minimax_m2",
                   dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=32,
                        num_local_experts=4, num_experts_per_tok=2, rotary_dim=16,
                        scoring_func="sigmoid", use_routing_bias=True, tie_word_embeddings=False)),
    # Qwen3.5 (dense): a gated delta-net layer (in_proj_qkv/z/b/a, conv1d, A_log, dt_bias, a gated norm; more
    # value heads than key heads, value and key heads of different widths) and a full-attention layer (output
    # gate in q_proj, q/k norms, fewer kv heads than TP 4).
    "qwen3.5": ("qwen3_5_text",
                dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=96,
                     linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
                     linear_value_head_dim=12, linear_conv_kernel_dim=4,
                     layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False)),
    # Qwen3.5-MoE: the same two layers, each with routed experts and a gated shared expert; tied.
    "qwen3.5-moe": ("qwen3_5_moe_text", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                             linear_num_key_heads=4, linear_num_value_heads=8,
                                             linear_key_head_dim=16, linear_value_head_dim=12,
                                             linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                             layer_types=["linear_attention", "full_attention"],
                                             tie_word_embeddings=True)),
    # Kimi-K2.5: DeepSeek-V3's text model (here its "deepseek-v3" model) in a multimodal config with a vision
    # tower and projector; see MULTIMODAL for how its checkpoint is written.
    "kimi-k25": ("kimi_k25", dict(
        text_config=dict(COMMON, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
                         n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                         moe_intermediate_size=32, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=32,
                         qk_rope_head_dim=32, v_head_dim=32, first_k_dense_replace=1, n_group=1, topk_group=1,
                         topk_method="noaux_tc", tie_word_embeddings=False),
        vision_config=dict(patch_size=14, num_attention_heads=2, num_hidden_layers=1, hidden_size=32,
                           intermediate_size=32, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2),
        projection_hidden_size=32, tie_word_embeddings=False)),
    # DeepSeek sparse attention: DeepSeek-V3's MLA and MoE (noaux_tc routing) with an indexer in every layer
    # (wq_b, wk and weights_proj, which vLLM fuses, a LayerNorm k_norm with a bias), whole on every rank.
    # vLLM's CPU platform refuses sparse attention; the vLLM test's worker builds these models with its MLA
    # backend, for their parameters and loaders only (tests/reshard/_vllm_tasks.py).
    "deepseek-v32": ("deepseek_v32", dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
                                          n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                          moe_intermediate_size=32, q_lora_rank=48, kv_lora_rank=32,
                                          qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                                          first_k_dense_replace=1, n_group=1, topk_group=1,
                                          topk_method="noaux_tc", index_n_heads=4, index_head_dim=32,
                                          index_topk=8, tie_word_embeddings=False)),
    # GLM-5: the same architecture under GLM's names; wider nope and value heads than DeepSeek's.
    "glm5": ("glm_moe_dsa",
             dict(num_attention_heads=4, num_key_value_heads=4, intermediate_size=96, n_routed_experts=4,
                  n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=48,
                  kv_lora_rank=32, qk_nope_head_dim=48, qk_rope_head_dim=32, v_head_dim=48,
                  first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="noaux_tc",
                  index_n_heads=2, index_head_dim=32, index_topk=8, tie_word_embeddings=False)),
}

MULTIMODAL = {
    # The Hub's Kimi-K2.5 checkpoint keeps its text model as DeepSeek-V3's causal LM saves it, under
    # "language_model." (language_model.model.layers.*, language_model.lm_head.weight), and its config.json
    # names vLLM's class and calls the text config's model_type "kimi_k2". transformers 5.19's save_pretrained
    # of its Kimi_K25ForConditionalGeneration does not write those names (its reverse rename turns "layers"
    # into "blocks"), so the checkpoint is the text model's, prefixed. The vision tower and projector are not
    # synced: vLLM's parameters and transformers' modules under these prefixes are left out of the
    # comparisons.
    "kimi_k25": dict(text_model_type="deepseek_v3", hub_text_model_type="kimi_k2",
                     checkpoint_prefix="language_model.", architecture="KimiK25ForConditionalGeneration",
                     vllm_not_synced=("vision_tower.", "mm_projector."),
                     modules_not_synced=("model.vision_tower.", "model.mm_projector.")),
}
"""Multimodal model types of MODELS: how their checkpoint is written and what of them is not synced."""


def take_checkpoint(path) -> dict:
    """Every tensor of the ``*.safetensors`` files ``save_pretrained`` wrote in ``path``, by name; the files
    are removed (the caller writes the checkpoint it tests in their place)."""
    from pathlib import Path

    from safetensors import torch as safetensors_torch

    names = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        names.update(safetensors_torch.load_file(f))
        f.unlink()
    return names


def distinct_values(names: dict) -> dict:
    """Tensors of ``names``' shapes holding a random permutation of 1..N (exact in fp32), in name order, so a
    swapped row, expert or tensor cannot compare equal, and each value names one element of the checkpoint
    (0 is padding)."""
    import torch

    total = sum(t.numel() for t in names.values())
    ids = (torch.randperm(total, generator=torch.Generator().manual_seed(1)) + 1).float()
    weights, start = {}, 0
    for n, t in sorted(names.items()):
        weights[n] = ids[start:start + t.numel()].reshape(t.shape).clone()
        start += t.numel()
    return weights
