"""The pure parts of ReferenceEngine: the embedded spec and TPShard sizes, HF->vLLM placement, block
tables, sampling."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmem.engines.nn.config import embedded_spec
from hybridmem.engines.reference import (
    BlockManager,
    KVBlocksExhaustedError,
    SamplingParams,
    pad_vocab,
    tp_shard,
)
from hybridmem.engines.reference.layout import param_shapes, place_hf_weight
from hybridmem.engines.reference.sampling import make_generator, sample_next
from hybridmem.reshard import ModelSpec
from hybridmem.reshard.transforms import piece_view


def _spec(**kw) -> ModelSpec:
    base = dict(family="qwen2", vocab_size=250, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, qkv_bias=True)
    base.update(kw)
    return embedded_spec(ModelSpec(**base))


def test_from_hf_reads_qwen2_and_llama_dicts():
    qwen = embedded_spec(dict(model_type="qwen2", vocab_size=10, hidden_size=8, intermediate_size=16,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                  rope_theta=1e6, tie_word_embeddings=True))
    assert (qwen.qkv_bias, qwen.tie_word_embeddings, qwen.head_dim, qwen.rope_theta) == (True, True, 4, 1e6)
    llama = embedded_spec(dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   rope_parameters={"rope_theta": 5.0, "rope_type": "default"}))
    assert (llama.qkv_bias, llama.num_key_value_heads, llama.rope_theta) == (False, 2, 5.0)
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        embedded_spec(dict(model_type="gpt2"))
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        embedded_spec(dict(model_type="llama", rope_scaling={"rope_type": "yarn"}))


@pytest.mark.parametrize("tp,kv_heads,replicas,start", [(1, 2, 1, 0), (2, 1, 1, 1), (4, 1, 2, 1)])
def test_tp_shard_kv_heads(tp, kv_heads, replicas, start):
    shard = tp_shard(_spec(), tp, tp - 1)
    got = (shard.num_kv_heads, shard.num_kv_head_replicas, shard.kv_head_start)
    assert got == (kv_heads, replicas, start)
    assert shard.vocab_rows * tp == pad_vocab(250) == 256


def test_tp_shard_refuses_uneven_splits():
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tp_size=3"):
        tp_shard(_spec(), 3, 0)
    with pytest.raises(ValueError, match="num_key_value_heads=3 and tp_size=2"):
        tp_shard(_spec(num_attention_heads=6, num_key_value_heads=3), 2, 0)


@settings(max_examples=25, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), kv=st.sampled_from([1, 2, 4]), bias=st.booleans(), tied=st.booleans())
def test_placements_fill_every_parameter_exactly_once(tp, kv, bias, tied):
    spec = _spec(num_attention_heads=4, num_key_value_heads=kv, qkv_bias=bias, tie_word_embeddings=tied)
    layer = {"input_layernorm.weight": (32,), "post_attention_layernorm.weight": (32,),
             "self_attn.q_proj.weight": (32, 32), "self_attn.k_proj.weight": (kv * 8, 32),
             "self_attn.v_proj.weight": (kv * 8, 32), "self_attn.o_proj.weight": (32, 32),
             "mlp.gate_proj.weight": (64, 32), "mlp.up_proj.weight": (64, 32),
             "mlp.down_proj.weight": (32, 64)}
    if bias:
        layer.update({"self_attn.q_proj.bias": (32,), "self_attn.k_proj.bias": (kv * 8,),
                      "self_attn.v_proj.bias": (kv * 8,)})
    hf = {"model.embed_tokens.weight": (250, 32), "model.norm.weight": (32,), "lm_head.weight": (250, 32)}
    hf.update({f"model.layers.0.{k}": v for k, v in layer.items()})
    for rank in range(tp):
        shard = tp_shard(spec, tp, rank)
        shapes = param_shapes(shard)
        covered = {name: torch.zeros(shape) for name, shape in shapes.items()}
        for name, shape in hf.items():
            targets = place_hf_weight(shard, name, torch.ones(shape))
            if targets is None:
                assert name == "lm_head.weight" and tied
                continue
            for target, piece in targets:
                piece_view(covered[target], piece).add_(1)
        for name, t in covered.items():
            # Vocab padding: rows past the real vocab of the padded, evenly split embedding (64-row multiple).
            real = t.shape[0]
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                real = max(0, min(t.shape[0], 250 - rank * t.shape[0]))
            assert torch.equal(t[:real], torch.ones_like(t[:real])), (
                f"{name} on rank {rank}/{tp} not filled exactly once")
            assert not t[real:].any(), f"{name} on rank {rank}/{tp}: padding rows written"


def test_place_refuses_unknown_names_and_shapes():
    shard = tp_shard(_spec(), 2, 0)
    with pytest.raises(KeyError, match="model.layers.5.mlp.gate_proj.weight"):
        place_hf_weight(shard, "model.layers.5.mlp.gate_proj.weight", torch.ones(64, 32))
    with pytest.raises(KeyError, match="visual"):
        place_hf_weight(shard, "visual.proj.weight", torch.ones(1))
    with pytest.raises(ValueError, match=r"shape \(33, 32\), expected \(32, 32\)"):
        place_hf_weight(shard, "model.layers.0.self_attn.q_proj.weight", torch.ones(33, 32))
    assert place_hf_weight(shard, "model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(4)) is None
    assert place_hf_weight(shard, "model.rotary_emb.original_inv_freq", torch.ones(4)) is None


def test_block_manager_tables_slots_and_exhaustion():
    bm = BlockManager(num_blocks=4, block_size=3)
    assert bm.allocate("a", 5) == [0, 1]
    assert bm.allocate("b", 3) == [2]
    bm.free("a")
    assert bm.allocate("d", 2) == [0]
    assert bm.allocate("b", 6) == [2, 1]  # grows with a recycled block: the table is not contiguous
    assert bm.slots("b", range(6)).tolist() == [6, 7, 8, 3, 4, 5]
    assert bm.slots("d", [1]).tolist() == [1]
    with pytest.raises(KVBlocksExhaustedError, match="needs 2 more KV blocks for 12 tokens.*only 1 of 4"):
        bm.allocate("b", 12)
    assert bm.table("b") == [2, 1] and bm.num_free_blocks == 1  # nothing taken on failure
    assert not bm.can_allocate(4) and bm.can_allocate(3)
    bm.free_all()
    assert bm.num_free_blocks == 4


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(stop_token_ids=[3]).stop_token_ids == (3,)


def test_top_p_restricts_draws_to_the_nucleus():
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    gen = make_generator(0, torch.device("cpu"))
    draws = [sample_next(logits, SamplingParams(top_p=0.8), gen)[0] for _ in range(300)]
    assert set(draws) == {1, 3}  # 0.5 + 0.3 reaches 0.8: tokens 2 and 0 are cut
    draws = [sample_next(logits, SamplingParams(top_p=0.81), gen)[0] for _ in range(300)]
    assert set(draws) == {1, 3, 2}
    # Renormalised over the nucleus {1, 3, 2}: P(1) = 0.5 / 0.95.
    assert abs(draws.count(1) / 300 - 0.5 / 0.95) < 0.1
    token, logprob = sample_next(logits, SamplingParams(temperature=0.0), gen)
    assert token == 1 and logprob == pytest.approx(float(torch.log_softmax(logits, -1)[1]))


def test_same_seed_same_draws():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.7, top_p=0.95)
    gen_a, gen_b = make_generator(5, torch.device("cpu")), make_generator(5, torch.device("cpu"))
    a = [sample_next(logits, params, gen_a)[0] for _ in range(20)]
    b = [sample_next(logits, params, gen_b)[0] for _ in range(20)]
    assert a == b and len(set(a)) > 1
