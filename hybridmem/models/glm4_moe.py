"""GLM-4.5 / GLM-4.6 (``glm4_moe``): grouped-query attention with q/k/v biases (optionally q/k norms), the
first ``first_k_dense_replace`` layers dense, the rest MoE with shared experts and a routing-score
correction bias that vLLM always builds. The multi-token-prediction layers past ``num_hidden_layers``
(``num_nextn_predict_layers``) are not part of the model transformers or vLLM's main model builds."""

from __future__ import annotations

from typing import Any

from hybridmem.models.common import gqa_fields, moe_fields
from hybridmem.models.family import ConfigGetter, Family, RouterBias


def read_config(get: ConfigGetter) -> dict[str, Any]:
    width = int(get("moe_intermediate_size") or 0)
    return {**gqa_fields(get, qkv_bias=bool(get("attention_bias", False)),
                         qk_norm=bool(get("use_qk_norm", False))),
            **moe_fields(get, experts_keys=("n_routed_experts",),
                         shared_width=width * int(get("n_shared_experts", 0) or 0),
                         first_dense_key="first_k_dense_replace")}


GLM4_MOE = Family(name="glm4_moe", architectures=("Glm4MoeForCausalLM",), read_config=read_config, moe=True,
                  router_bias=RouterBias.ALWAYS, shared_expert="shared_experts")
