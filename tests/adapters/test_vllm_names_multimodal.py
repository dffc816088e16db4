"""A multimodal model's vLLM parameters outside its text model (Kimi-K2.5's vision tower and projector)
are never synced: the vLLM adapter's name check leaves them out, and only them."""

from __future__ import annotations

import pytest

from hybridmem.adapters.vllm.names import check_weight_names, not_synced_prefixes
from hybridmem.adapters.vllm.worker import WorkerInfo

_TEXT = dict(model_type="kimi_k2", hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=48, num_hidden_layers=2, vocab_size=100, n_routed_experts=4,
             n_shared_experts=1, moe_intermediate_size=8, first_k_dense_replace=1, q_lora_rank=8,
             kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, topk_method="noaux_tc")


def test_kimi_k25_vision_tower_and_projector_are_left_out_of_the_name_check():
    not_synced = not_synced_prefixes({"model_type": "kimi_k25", "text_config": _TEXT})
    assert not_synced == ("vision_tower.", "mm_projector.")
    assert not_synced_prefixes(dict(_TEXT, model_type="deepseek_v3")) == ()
    assert not_synced_prefixes(None) == ()
    info = WorkerInfo(rank=0, has_reload_weights=True, params=(
        ("vision_tower.patch_embed.proj.weight", (32, 3, 14, 14)), ("mm_projector.linear_1.weight", (64, 64)),
        ("language_model.model.norm.weight", (64,))))
    check_weight_names(info, {"language_model.model.norm.weight": (64,)}, what="the layout",
                       not_synced=not_synced)
    with pytest.raises(ValueError,
                       match=r"2 vLLM parameters the sync never writes: \['vision_tower\..*mm_projector"):
        check_weight_names(info, {"language_model.model.norm.weight": (64,)}, what="the layout")
    with pytest.raises(ValueError, match=r"the sync writes are not vLLM parameters: \['model.norm.weight'\]"):
        check_weight_names(info, {"language_model.model.norm.weight": (64,), "model.norm.weight": (64,)},
                           what="the layout", not_synced=not_synced)
