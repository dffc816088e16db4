"""Worker task for test_megatron_names.py: build a real megatron-core GPTModel on CPU (gloo) and list
its parameters. Only building is needed (no forward), which megatron-core 0.16.1 supports on CPU."""

from __future__ import annotations


def gpt_parameters(ctx, spec, tp: int, pp: int, padded_vocab: int):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    import torch

    parallel_state.initialize_model_parallel(tp, pp)
    # Test-only CPU shim: with tied embeddings and pp > 1, LanguageModule.setup_embeddings_and_output_layer
    # moves the last stage's output weight with .cuda() before all-reducing it over the embedding group.
    real_cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        moe = {}
        if spec.is_moe:
            moe = dict(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_intermediate_size,
                       moe_router_topk=2)
            if spec.shared_expert_intermediate_size:
                moe.update(moe_shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
                           moe_shared_expert_gate=spec.has_shared_expert_gate)
        cfg = TransformerConfig(
            num_layers=spec.num_hidden_layers, hidden_size=spec.hidden_size,
            num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_key_value_heads,
            kv_channels=spec.head_dim, ffn_hidden_size=spec.intermediate_size or spec.moe_intermediate_size,
            gated_linear_unit=True, add_bias_linear=False, add_qkv_bias=spec.qkv_bias, normalization="RMSNorm",
            qk_layernorm=spec.qk_norm, use_cpu_initialization=True, tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp, pipeline_dtype=None if pp == 1 else torch.float32,
            **moe,
        )
        layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_experts or None, moe_grouped_gemm=False,
                                              qk_layernorm=spec.qk_norm, normalization="RMSNorm")
        model = GPTModel(cfg, layer_spec, vocab_size=padded_vocab, max_sequence_length=32,
                         share_embeddings_and_output_weights=spec.tie_word_embeddings,
                         position_embedding_type="rope",
                         pre_process=parallel_state.is_pipeline_first_stage(),
                         post_process=parallel_state.is_pipeline_last_stage())
        return {name: tuple(p.shape) for name, p in model.named_parameters()}
    finally:
        torch.Tensor.cuda = real_cuda
        parallel_state.destroy_model_parallel()
