"""The KV cache VLLMEngine.create asks vLLM's CPU backend for when the caller chose none ([Note: vllm cpu kv
default] in :mod:`hybridmem.adapters.vllm.cpu_kv`), against the count written out here; vLLM's own count of
it is in test_vllm_real_defaults.py."""

from __future__ import annotations

import pytest

from hybridmem.adapters.vllm.cpu_kv import cpu_kv_cache_nbytes

transformers = pytest.importorskip("transformers")

GIB = 1 << 30


def docs_config(**kw):
    return transformers.Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=512, **kw)


def per_token(layers, kv_heads, head_dim, itemsize):
    return 2 * layers * kv_heads * head_dim * itemsize  # K and V of every layer


@pytest.mark.parametrize("llm_kwargs,tokens", [
    ({}, 65_536),  # vLLM's defaults: 256 sequences x 32768 would be 8 GiB
    ({"max_model_len": 256}, 256 * 256),  # docs/vllm.md: exactly max_num_seqs full sequences
    ({"max_model_len": 128, "max_num_seqs": 8}, 128 * 8),  # asked for less than the cap
    ({"max_model_len": 100, "max_num_seqs": 3}, 384),  # rounded up to whole 128-token blocks
    ({"max_model_len": 100, "max_num_seqs": 3, "block_size": 32}, 320),
])
def test_the_cache_holds_what_was_asked_up_to_the_cap(llm_kwargs, tokens):
    nbytes = cpu_kv_cache_nbytes(docs_config(), {"dtype": "float32", **llm_kwargs}, utilization=0.5,
                                 free_nbytes=64 * GIB)
    assert nbytes == tokens * per_token(2, 2, 32, 4)


def test_one_full_length_sequence_always_fits():
    cfg = docs_config(max_position_embeddings=131_072)
    nbytes = cpu_kv_cache_nbytes(cfg, {"dtype": "bfloat16"}, utilization=0.5, free_nbytes=64 * GIB)
    assert nbytes == 131_072 * per_token(2, 2, 32, 2)


def test_never_more_than_the_share_of_free_memory():
    nbytes = cpu_kv_cache_nbytes(docs_config(), {"dtype": "float32"}, utilization=0.5, free_nbytes=32 << 20)
    assert nbytes == 16 << 20


def test_a_7b_model_in_bfloat16():
    cfg = transformers.Qwen2Config(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                   num_key_value_heads=4, intermediate_size=18944, vocab_size=152064)
    nbytes = cpu_kv_cache_nbytes(cfg, {"dtype": "bfloat16"}, utilization=0.9, free_nbytes=512 * GIB)
    assert nbytes == 65_536 * per_token(28, 4, 128, 2) == int(3.5 * GIB)
