"""Real Megatron-core training weights resharded into the inference engine on every TRAIN->INFER switch.

ShardingManager's default weight sync derives the model spec and the vocab padding from the Megatron
model (``MegatronTrainingState(..., vocab_size=)``, ``megatron_convention()``) and reshards the training
layout into the engine's vLLM layout: ReferenceEngine for dense models, a vLLM-layout holder for MoE
(EP -> TP). After every step, each engine tensor must equal the slice that tests/reshard/reference.py
(written without hybridmem.reshard's tables) computes from the full weights, and the full weights are
themselves checked against every rank's actual Megatron tensors through the same reference.
"""

from __future__ import annotations

import _megatron_tasks as tasks
import pytest

from hybridmem.testing.megatron_models import TinyGPTSpec

pytestmark = pytest.mark.megatron

WORLD = 4
NUM_STEPS = 2
VOCAB = 60
"""The tokenizer's vocab: Megatron holds 64 rows (TinyGPTSpec.vocab_size), vLLM pads 60 to 64 its own way."""

CASES = {
    # name: (training spec, inference tp)
    "tp2xdp2-to-tp1": (TinyGPTSpec(tp=2), 1),
    "tp2xdp2-to-tp4": (TinyGPTSpec(tp=2), 4),
    "tp2xpp2-bf16-to-tp2": (TinyGPTSpec(tp=2, pp=2, num_layers=4, precision="bf16",
                                        use_distributed_optimizer=True), 2),
    "ep2-moe-to-tp2": (TinyGPTSpec(ep=2, num_moe_experts=4, moe_ffn_hidden_size=32), 2),
    # The engine serves Mixtral (its model_type): the same GPTModel is read as that family, so the engine's
    # block_sparse_moe names are written.
    "ep2-mixtral-to-tp2": (TinyGPTSpec(ep=2, num_moe_experts=4, moe_ffn_hidden_size=32), 2, "mixtral"),
}


@pytest.fixture(scope="module", params=list(CASES))
def run(request, megatron_pools):
    spec, infer_tp, *family = CASES[request.param]
    return request.param, megatron_pools.get(WORLD).run(tasks.reshard_into_engine, spec, infer_tp,
                                                        NUM_STEPS, VOCAB, *family)


def test_full_weights_reproduce_every_megatron_shard(run):
    name, outs = run
    for rank, out in enumerate(outs):
        assert out["megatron_diffs"] == [], f"{name} rank {rank}: {out['megatron_diffs']}"


def test_engine_holds_the_reference_slices_after_every_switch(run):
    name, outs = run
    for rank, out in enumerate(outs):
        assert len(out["diffs"]) == NUM_STEPS
        for step, diffs in enumerate(out["diffs"]):
            assert out["num_tensors"][step] > 0
            assert diffs == [], f"{name} rank {rank} switch {step}: {diffs}"


def test_each_rank_receives_only_what_it_lacks(run):
    name, outs = run
    for rank, out in enumerate(outs):
        assert out["received"] == out["min_received"], (name, rank, out["received"], out["min_received"])
        assert all(r is not None for r in out["received"]), (name, rank)


def test_training_went_on(run):
    name, outs = run
    losses = outs[0]["losses"]
    assert all(o["losses"] == losses for o in outs), name
    assert losses[1] != losses[0], name
