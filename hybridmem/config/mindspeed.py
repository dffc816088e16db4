"""The keys MindSpeed-RL accepts in the sections of its YAML file, in any of its releases (data only).

MindSpeed-RL rejects a key its config class does not define ("The key: ... is missing"), so a file it
runs holds only these. :meth:`hybridmem.HybridConfig.from_yaml` uses them to tell a key of the user's
framework (accepted, not read by hybridmem) from a typo (an error with a suggestion). A user's file may
come from any release, and releases add, rename and drop keys (v2.2.0 has ``use_deter_comp``, later ones
do not; the latest sources have ``variable_seq_lengths`` where v2.3.0 has ``variable_seq_length``), so
each ``*_KEYS`` set is the union over :data:`RELEASES`: the keys of the latest sources plus, listed per
release, the keys an earlier release defines and the latest sources do not. A ``-`` in a key is read as
``_``, as MindSpeed-RL does.

The lists were read from MindSpeed-RL's ``mindspeed_rl/config_cls`` at the commits in :data:`RELEASES`:
the attributes ``MegatronConfig``, ``RLConfig`` and ``GenerateConfig`` assign in ``__init__``
(``self.<key> = ...``). To add a release, read its lists the same way: keys the latest sources drop move
to the release that last had them.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["RELEASES", "MEGATRON_KEYS", "RL_KEYS", "GENERATE_KEYS", "SECTIONS"]

RELEASES: Mapping[str, str] = MappingProxyType(
    {
        # Head of the 2.0.0 release branch (the preview release; the repository has no tag for it).
        "2.0.0": "62e9928ae89d9570f659b46e816bc55e1191b5e7",
        "v2.1.0": "bfe1bd5a00ba5e25e596e9be9ef9373f232a258b",
        "v2.2.0": "194b52b7b34b69963f21bee0d13d01c155cd2db2",
        "v2.3.0": "4b30d034e4fb6abc5ce844a667491e8a3cc4909c",
        # Latest sources: master on 2026-04-22.
        "master": "05a90d77cb6cfad8999e2aee21068284db959579",
    }
)
"""Where the key lists come from: MindSpeed-RL release (tag, or branch where untagged) -> commit.

The heads of the release branches 2.1.0, 2.2.0 and 2.3.0 (d9e8db94, a6ce810b, 09b8c125) define the same
keys as the tags."""

SECTIONS = frozenset(
    {
        "defaults", "model", "megatron_training", "actor_config", "ref_config", "reward_config",
        "critic_config", "rl_config", "generate_config", "profiler_config", "msprobe_config",
    }
)
"""Top-level sections of a MindSpeed-RL training YAML (the files of every release in RELEASES use no
others)."""

# ``BaseConfig.update`` reads ``model`` itself (the name of the model section whose keys it merges in),
# in every release; it is no attribute of MegatronConfig.
_BASE_CONFIG_KEYS = frozenset({"model"})

# MegatronConfig keys of the latest sources.
_MEGATRON_LATEST = frozenset(
    {
        "accumulate_allreduce_grads_in_fp32", "adam_beta1", "adam_beta2", "add_qkv_bias", "ai_framework",
        "algorithm", "attention_bias", "attention_dropout", "attention_mask_type",
        "attention_softmax_in_fp32", "beta_fast", "beta_slow", "bf16", "clip_grad", "coc_fused_kernel",
        "coc_mode", "coc_parallel_num", "context_parallel_algo", "context_parallel_size", "data_path",
        "dataloader_type", "dataset_additional_keys", "ddp_bucket_size", "disable_bias_linear",
        "distributed_backend", "do_sample", "dpo_loss_type", "enable_high_availability", "eval_interval",
        "eval_iters", "expert_model_parallel_size", "ffn_hidden_size", "finetune", "first_k_dense_replace",
        "full_shuffle_instruction_dataset", "gemm_gradient_accumulation_fusion", "global_batch_size",
        "group_query_attention", "hidden_dropout", "hidden_size", "high_freq_factor", "init_method_std",
        "initial_loss_scale", "is_instruction_dataset", "is_pairwise_dataset", "kv_channels", "kv_lora_rank",
        "load", "load_checkpoint_loosely", "log_interval", "log_throughput", "lora_alpha", "lora_ckpt_filter",
        "lora_fusion", "lora_r", "lora_target_modules", "low_freq_factor", "lr", "lr_decay_style",
        "lr_warmup_fraction", "make_vocab_size_divisible_by", "max_position_embeddings", "micro_batch_size",
        "min_lr", "mm_model", "moe_alltoall_overlap_comm", "moe_aux_loss_coeff", "moe_ffn_hidden_size",
        "moe_grouped_gemm", "moe_layer_freq", "moe_permutation_async_comm", "moe_router_enable_expert_bias",
        "moe_router_group_topk", "moe_router_load_balancing_type", "moe_router_num_groups",
        "moe_router_score_function", "moe_router_topk", "moe_router_topk_scaling_factor",
        "moe_token_dispatcher_type", "moe_tp_extend_ep", "multi_latent_attention", "n_shared_experts",
        "no_bias_dropout_fusion", "no_check_for_nan_in_loss_and_grad", "no_gradient_accumulation_fusion",
        "no_load_optim", "no_load_rng", "no_masked_softmax_fusion", "no_pad_to_seq_lengths", "no_save_optim",
        "no_save_rng", "no_shared_storage", "no_shuffle", "noop_layers", "norm_epsilon", "norm_topk_prob",
        "normalization", "npu_deterministic", "num_attention_heads", "num_experts", "num_layer_list",
        "num_layers", "num_layers_per_virtual_pipeline_stage", "num_query_groups", "num_workers", "optimizer",
        "original_max_position_embeddings", "overlap_grad_reduce", "overlap_param_gather",
        "pad_to_multiple_of", "padded_vocab_size", "pipeline_model_parallel_size", "position_embedding_type",
        "pretrained_checkpoint", "prompt_type", "prompt_type_path", "q_lora_rank", "qk_head_dim",
        "qk_layernorm", "qk_pos_emb_head_dim", "recompute_activation_function", "recompute_granularity",
        "recompute_method", "recompute_num_layers", "ref_model", "refer_model_iter", "reset_attention_mask",
        "reset_position_ids", "reuse_fp32_param", "rope_scaling_factor", "rope_scaling_mscale",
        "rope_scaling_mscale_all_dim", "rope_scaling_original_max_position_embeddings", "rope_scaling_type",
        "rotary_base", "save", "save_interval", "seed", "seq_aux", "seq_length", "sequence_parallel",
        "shape_order", "skip_train", "spec", "split", "stage", "swap_attention", "swap_optimizer", "swiglu",
        "tensor_model_parallel_size", "tokenizer_name_or_path", "tokenizer_not_use_fast",
        "tokenizer_padding_side", "tokenizer_type", "train_iters", "transformer_impl",
        "untie_embeddings_and_output_weights", "use_ascend_coc", "use_cp_send_recv_overlap",
        "use_distributed_optimizer", "use_flash_attn", "use_fused_moe_token_permute_and_unpermute",
        "use_fused_ring_attention_update", "use_fused_rmsnorm", "use_fused_rotary_pos_emb",
        "use_fused_swiglu", "use_kv_cache", "use_mcore_models", "use_rotary_position_embeddings",
        "use_tp_pp_dp_mapping", "v_head_dim", "variable_seq_lengths", "vocab_extra_ids", "weight_decay"
    }
)
# MegatronConfig keys each earlier release defines and the latest sources do not.
_MEGATRON_EARLIER: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "2.0.0": frozenset(
            {
                "moe_intermediate_size", "multi_head_latent_attention", "n_group", "qk_nope_head_dim",
                "qk_rope_head_dim", "rope_scaling_beta_fast", "rope_scaling_beta_slow",
                "routed_scaling_factor", "topk_group", "use_deter_comp"
            }
        ),
        "v2.1.0": frozenset(
            {
                "moe_intermediate_size", "multi_head_latent_attention", "n_group", "qk_nope_head_dim",
                "qk_rope_head_dim", "rope_scaling_beta_fast", "rope_scaling_beta_slow",
                "routed_scaling_factor", "topk_group", "use_deter_comp"
            }
        ),
        "v2.2.0": frozenset(
            {
                "cp_attention_mask_type", "moe_intermediate_size", "multi_head_latent_attention", "n_group",
                "qk_nope_head_dim", "qk_rope_head_dim", "rope_scaling_beta_fast", "rope_scaling_beta_slow",
                "routed_scaling_factor", "topk_group", "use_deter_comp"
            }
        ),
        "v2.3.0": frozenset({"variable_seq_length"}),
    }
)

# RLConfig keys of the latest sources.
_RL_LATEST = frozenset(
    {
        "actor_dynamic_max_batch_size", "actor_forward_micro_batch_size", "actor_image_embeds_dispatch_size",
        "actor_logprob_dispatch_size", "actor_max_packing_token_size", "actor_resource",
        "actor_rollout_dispatch_size", "actor_update_dispatch_size", "adv_dispatch_size", "adv_estimator",
        "advantage_whiten", "async_engine", "beta", "blocking", "clip_higher_enable", "clip_ratio",
        "clip_ratio_high", "clip_ratio_low", "cliprange_value", "colocate_actor_and_vit", "critic_resource",
        "critic_update_dispatch_size", "critic_value_dispatch_size", "data_strategy",
        "dynamic_max_batch_size", "dynamic_sampling_dispatch_size", "entropy_coeff", "epochs",
        "filter_groups_enable", "filter_groups_max_batches", "filter_groups_metric",
        "filter_groups_train_batch_size", "gamma", "guarantee_order", "hccl_buffersize", "init_kl_coef",
        "integrated_mode_config", "is_multimodal", "kl_ctrl_type", "kl_dispatch_size", "kl_horizon",
        "kl_penalty", "kl_target", "lam", "log_max_throughput", "max_packing_token_size",
        "max_parallel_calls", "max_prompt_length", "max_tool_calls", "max_tool_response_length",
        "max_total_response_length", "mini_batch_size", "multi_turn_enable", "n_samples_per_prompt",
        "num_cpus_for_local_task", "num_cpus_for_placement_group", "num_samples_per_step", "overlong_buffer",
        "overlong_buffer_enable", "overlong_buffer_penalty_factor", "partial_rollout_max_split",
        "ref_dispatch_size", "ref_dynamic_max_batch_size", "ref_forward_micro_batch_size",
        "ref_max_packing_token_size", "reference_resource", "require_max_age_all_finished",
        "reuse_image_embeds", "reward_dispatch_size", "reward_resource", "rollout_max_tokens", "rule_reward",
        "runtime_env_path", "share_backbone", "shuffle_mini_batch", "swanlab_exp_name", "swanlab_mode",
        "swanlab_project", "swanlab_save_dir", "token_level_loss", "tool_config_path", "tool_parser_format",
        "tool_response_truncate_side", "tp_split_expert", "transfer_queue_data_shard_num",
        "transfer_queue_data_shard_port_base", "update_dynamic_max_batch_size",
        "update_max_packing_token_size", "use_dp_batch_balance", "use_dynamic_bsz", "use_integrated_worker",
        "use_kl_in_reward", "use_remove_padding", "use_swanlab", "use_tensorboard", "use_wandb",
        "verifier_function", "verifier_parallel", "verifier_timeout", "verifier_weight",
        "vit_forward_micro_batch_size", "vit_resource", "wandb_exp_name", "wandb_project", "wandb_save_dir",
        "zmq_communication"
    }
)
# RLConfig keys each earlier release defines and the latest sources do not.
_RL_EARLIER: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "2.0.0": frozenset({"enable_sharding_validate"}),
        "v2.1.0": frozenset({"enable_sharding_validate", "td_status_log"}),
        "v2.2.0": frozenset(),
        "v2.3.0": frozenset(),
    }
)

# GenerateConfig keys of the latest sources.
_GENERATE_LATEST = frozenset(
    {
        "ascend_scheduler_config_enabled", "data_parallel_size", "dtype", "enable_expert_parallel",
        "enable_prefix_caching", "enforce_eager", "eplb_token_collects", "eplb_token_save_path",
        "expert_map_path", "gpu_memory_utilization", "infer_expert_parallel_size",
        "infer_pipeline_parallel_size", "infer_tensor_parallel_size", "limit_mm_image_per_prompt",
        "limit_mm_video_per_prompt", "max_model_len", "max_num_batched_tokens", "max_num_seqs",
        "num_scheduler_steps", "offload_train_grad", "offload_train_optimizer", "offload_train_param",
        "sampling_config", "tokenizer_name_or_path", "torchair_graph", "trust_remote_code"
    }
)
# GenerateConfig keys each earlier release defines and the latest sources do not.
_GENERATE_EARLIER: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "2.0.0": frozenset(),
        "v2.1.0": frozenset(),
        "v2.2.0": frozenset(),
        "v2.3.0": frozenset(),
    }
)

# Keys the YAML files shipped with 2.0.0 set although no config class of 2.0.0 defines them: 2.0.0 only
# logged "The key: ... is missing" for such a key and went on, so files written for it hold them:
# shuffle_minibatch (configs/grpo_*.yaml), experience_count and the *_micro_batch_size keys
# (tests/st/configs/test_grpo_trainer_qwen25_7b_integrated.yaml). An unknown key became an error in
# MindSpeed-RL 0fbfaf4e (2025-06-19), before v2.1.0.
_RL_SET_BY_2_0_0_FILES = frozenset(
    {
        "actor_micro_batch_size", "adv_micro_batch_size", "experience_count", "ref_micro_batch_size",
        "rew_micro_batch_size", "shuffle_minibatch", "update_micro_batch_size",
    }
)
_GENERATE_SET_BY_2_0_0_FILES = frozenset({"gen_micro_batch_size"})

MEGATRON_KEYS = _MEGATRON_LATEST.union(_BASE_CONFIG_KEYS, *_MEGATRON_EARLIER.values())
"""Keys of ``actor_config``, ``ref_config``, ``reward_config`` and ``critic_config`` (``MegatronConfig``)
in any release."""

RL_KEYS = _RL_LATEST.union(_RL_SET_BY_2_0_0_FILES, *_RL_EARLIER.values())
"""Keys of ``rl_config`` (``RLConfig``) in any release."""

GENERATE_KEYS = _GENERATE_LATEST.union(_GENERATE_SET_BY_2_0_0_FILES, *_GENERATE_EARLIER.values())
"""Keys of ``generate_config`` (``GenerateConfig``) in any release."""
