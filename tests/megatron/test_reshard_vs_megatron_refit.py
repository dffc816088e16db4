"""hybridmem's plan against megatron-core's own refit (``swap_model_weights``), Megatron -> Megatron.

Both copy the weights of a GPTModel in one layout into a GPTModel in another, in the same four gloo
processes. Each target must equal the slices of the same full weights that hybridmem's Megatron layout
gives (so Megatron's refit independently confirms the layout tables), and hybridmem must receive exactly
its plan's minimum, never more than Megatron's refit receives.
"""

from __future__ import annotations

import pytest

from hybridmem.config import ParallelLayout
from hybridmem.reshard import ModelSpec
from hybridmem.testing.megatron_refit import compare_refits

pytestmark = pytest.mark.megatron

WORLD = 4
QWEN2 = ModelSpec(family="qwen2", hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                  intermediate_size=96, num_hidden_layers=4, vocab_size=300, qkv_bias=True)
LLAMA_TIED = ModelSpec(family="llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, intermediate_size=64, num_hidden_layers=2, vocab_size=100,
                       tie_word_embeddings=True)

CASES = {
    "tp4-to-tp2": (QWEN2, ParallelLayout(tp=4), ParallelLayout(tp=2)),
    "tp2-to-tp1": (QWEN2, ParallelLayout(tp=2), ParallelLayout(tp=1)),
    "tp1-to-tp4": (QWEN2, ParallelLayout(tp=1), ParallelLayout(tp=4)),
    "tp1xpp2-to-tp2": (QWEN2, ParallelLayout(tp=1, pp=2), ParallelLayout(tp=2)),
    "tied-tp2xpp2-to-tp1": (LLAMA_TIED, ParallelLayout(tp=2, pp=2), ParallelLayout(tp=1)),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, megatron_pools):
    spec, src, dst = CASES[request.param]
    return request.param, megatron_pools.get(WORLD).run(compare_refits, spec, src, dst, repeats=1)


def test_both_targets_equal_the_layout_slices(case):
    name, ranks = case
    for rank, r in enumerate(ranks):
        assert r["megatron_equal"], (f"{name}: megatron-core's refit differs from hybridmem's layout "
                                     f"on rank {rank}")
        assert r["hybridmem_equal"], (f"{name}: hybridmem's reshard differs from the layout slices "
                                      f"on rank {rank}")


def test_hybridmem_receives_the_minimum_and_never_more_than_megatron(case):
    name, ranks = case
    for rank, r in enumerate(ranks):
        assert r["hybridmem_recv"] == r["min_recv"], (name, rank, r)
        assert r["hybridmem_recv"] <= r["megatron_recv"], (name, rank, r)
    # The data-parallel replicas are where Megatron's refit pays more: it ignores local copies there.
    if name in ("tp2-to-tp1", "tp1-to-tp4"):
        assert sum(r["megatron_recv"] for r in ranks) > sum(r["hybridmem_recv"] for r in ranks), ranks
