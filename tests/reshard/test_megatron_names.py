"""Our Megatron layout names and shapes equal those of real megatron-core GPTModels (local spec)."""

from __future__ import annotations

import pytest

from hybridmem.config import ParallelLayout
from hybridmem.reshard import ModelSpec, megatron_layout
from hybridmem.testing.workers import WorkerPool
from tests.reshard import _mcore_tasks

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(2, timeout_s=300) as p:
        yield p


DENSE = ModelSpec(family="qwen2", hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  intermediate_size=24, num_hidden_layers=2, vocab_size=200, qkv_bias=True)
QWEN3_TIED = ModelSpec(family="qwen3", hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, intermediate_size=24, num_hidden_layers=2, vocab_size=200, qk_norm=True,
                       tie_word_embeddings=True)
MOE = ModelSpec(family="qwen2_moe", hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=0, num_hidden_layers=2, vocab_size=200, qkv_bias=True, num_experts=4,
                moe_intermediate_size=6, shared_expert_intermediate_size=10)


_MLA = dict(family="deepseek_v3", hidden_size=16, num_attention_heads=4, num_key_value_heads=4, head_dim=6,
            intermediate_size=24, vocab_size=200, num_experts=4, moe_intermediate_size=6,
            kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)
DEEPSEEK = ModelSpec(**_MLA, num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=8,
                     shared_expert_intermediate_size=12)
"""DeepSeek-V3-style: MLA with a query down-projection, one dense layer, then MoE with a shared expert."""
DEEPSEEK_DENSE_NO_Q_LORA = ModelSpec(**_MLA, num_hidden_layers=2, first_k_dense_replace=2)
"""MLA without q_lora (queries projected directly) and every layer dense, so TP > 1 can be built."""


MIXTRAL = ModelSpec(family="mixtral", hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, intermediate_size=0, num_hidden_layers=2, vocab_size=200, num_experts=4,
                    moe_intermediate_size=6)
GLM4_MOE = ModelSpec(family="glm4_moe", hidden_size=16, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=8, intermediate_size=24, num_hidden_layers=2, vocab_size=200, qkv_bias=True,
                     num_experts=4, moe_intermediate_size=6, shared_expert_intermediate_size=6,
                     first_k_dense_replace=1)
"""GLM-4.5-style: q/k/v biases, one dense layer, then MoE with a shared expert and a router bias."""
PHI3 = ModelSpec(family="phi3", hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                 intermediate_size=24, num_hidden_layers=2, vocab_size=200)


@pytest.mark.parametrize("spec",
                         [DENSE, QWEN3_TIED, MOE, DEEPSEEK, DEEPSEEK_DENSE_NO_Q_LORA, MIXTRAL,
                          GLM4_MOE, PHI3],
                         ids=["qwen2", "qwen3-tied", "qwen2-moe", "deepseek", "deepseek-dense-no-q-lora",
                              "mixtral", "glm4-moe", "phi3"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["dp2", "tp2", "pp2"])
def test_megatron_names_and_shapes(pool, spec, tp, pp):
    if any(spec.is_moe_layer(i) for i in range(spec.num_hidden_layers)) and tp > 1:
        pytest.skip("megatron-core needs sequence parallel for MoE with TP > 1")
    world = 2  # megatron's parallel_state spans the whole default group (the pool), so always 2 ranks
    layout = megatron_layout(spec, ParallelLayout(tp=tp, pp=pp), world)
    padded = -(-spec.vocab_size // (128 * tp)) * 128 * tp
    got = pool.run(_mcore_tasks.gpt_parameters, spec, tp, pp, padded, world_size=world)
    for rank in range(world):
        ours = {name: local.shape for name, local in layout.tensors(rank).items()}
        assert ours == got[rank], (rank, set(ours) ^ set(got[rank]))
