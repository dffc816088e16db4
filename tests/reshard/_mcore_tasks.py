"""Worker task for test_megatron_names.py: build a real megatron-core GPTModel on CPU (gloo) and list
its parameters. Only building is needed (no forward), which megatron-core 0.16.1 supports on CPU."""

from __future__ import annotations


def gpt_parameters(ctx, spec, tp: int, pp: int, padded_vocab: int):
    from megatron.core import parallel_state

    from hybridmem.testing.megatron_cpu import megatron_on_cpu

    # The CPU harness: with tied embeddings and pp > 1 LanguageModule moves the output weight with .cuda(),
    # and MLA's rotary embedding asks for torch.cuda.current_device().
    with megatron_on_cpu():
        parallel_state.initialize_model_parallel(tp, pp)
        try:
            return _parameters(spec, padded_vocab, tp, pp)
        finally:
            parallel_state.destroy_model_parallel()


def _parameters(spec, padded_vocab: int, tp: int, pp: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    import torch

    num_moe_layers = sum(spec.is_moe_layer(i) for i in range(spec.num_hidden_layers))
    moe: dict = {}
    if num_moe_layers:
        moe = dict(num_moe_experts=spec.num_experts, moe_ffn_hidden_size=spec.moe_intermediate_size,
                   moe_router_topk=2)
        if spec.shared_expert_intermediate_size:
            moe.update(moe_shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
                       moe_shared_expert_gate=spec.has_shared_expert_gate)
        if spec.has_router_bias:
            moe.update(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")
        if num_moe_layers < spec.num_hidden_layers:
            moe["moe_layer_freq"] = [int(spec.is_moe_layer(i)) for i in range(spec.num_hidden_layers)]
    config_cls, mla = TransformerConfig, {}
    if spec.is_mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        config_cls = MLATransformerConfig
        mla = dict(multi_latent_attention=True, q_lora_rank=spec.q_lora_rank or None,
                   kv_lora_rank=spec.kv_lora_rank, qk_head_dim=spec.qk_nope_head_dim,
                   qk_pos_emb_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, rope_type="rope")
    cfg = config_cls(
        num_layers=spec.num_hidden_layers, hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.head_dim, ffn_hidden_size=spec.intermediate_size or spec.moe_intermediate_size,
        gated_linear_unit=True, add_bias_linear=False, add_qkv_bias=spec.qkv_bias, normalization="RMSNorm",
        qk_layernorm=spec.qk_norm or spec.is_mla, use_cpu_initialization=True, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=None if pp == 1 else torch.float32,
        **moe, **mla,
    )
    if 0 < num_moe_layers < spec.num_hidden_layers:
        # Dense and MoE layers mixed: Megatron's block spec picks each layer's MLP from moe_layer_freq.
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        layer_spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    else:
        layer_spec = get_gpt_layer_local_spec(num_experts=spec.num_experts if num_moe_layers else None,
                                              moe_grouped_gemm=False, qk_layernorm=spec.qk_norm or spec.is_mla,
                                              normalization="RMSNorm", multi_latent_attention=spec.is_mla)
    if spec.is_mla:
        _replace_mla_core_attention(layer_spec)
    model = GPTModel(cfg, layer_spec, vocab_size=padded_vocab, max_sequence_length=32,
                     share_embeddings_and_output_weights=spec.tie_word_embeddings,
                     position_embedding_type="rope",
                     pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())
    out = {name: tuple(p.shape) for name, p in model.named_parameters()}
    # DeepSeek's router bias is a persistent buffer, not a parameter, and the weight sync carries it.
    out.update({name: tuple(b.shape) for name, b in model.named_buffers() if name.endswith("router.expert_bias")})
    return out


def _replace_mla_core_attention(layer_spec) -> None:
    """megatron-core 0.16.1's local MLA spec passes ``k_channels`` to ``DotProductAttention``, which does
    not take it (MLA works there only with Transformer Engine's attention). Core attention holds no
    parameters, so a stand-in that takes any arguments leaves the parameter names and shapes unchanged."""
    import torch

    class _NoParameterAttention(torch.nn.Module):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__()

    specs = getattr(layer_spec, "layer_specs", None) or [layer_spec]
    for one in specs:
        one.submodules.self_attention.submodules.core_attention = _NoParameterAttention
