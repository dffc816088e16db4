"""Weight coverage: a sync that leaves an engine tensor unwritten fails the switch, rolled back; an engine
of another architecture is refused at construction.

The case: a Llama model (no q/k/v bias) and a ReferenceEngine built from a Qwen2 config of the same
shape (Qwen2 has q/k/v biases). The expected names are vLLM's, written out here, not derived from the
code under test.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hybridmem import (
    HybridConfig,
    Phase,
    ShardingManager,
    SwitchError,
    WeightCoverageError,
)
from hybridmem.engines import ENGINE_TAGS, ReferenceEngine, SamplingParams
from hybridmem.engines.nn.gpt import MegatronLayoutGPT
from hybridmem.offload import OffloadState
from hybridmem.reshard import ModelSpec, megatron_layout, shard
from hybridmem.testing.tiny import assert_bitwise_equal, snapshot
from hybridmem.weight_sync import LoadWeightsSync, ReshardSync

DIMS = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
LLAMA = dict(DIMS, model_type="llama", attention_bias=False)
QWEN2 = dict(DIMS, model_type="qwen2")  # Qwen2: q/k/v biases
BIASES = ["model.layers.0.self_attn.qkv_proj.bias", "model.layers.1.self_attn.qkv_proj.bias"]


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})).eval()


def _qwen2_engine() -> ReferenceEngine:
    engine = ReferenceEngine(QWEN2, num_kv_blocks=8, block_size=4)
    engine.release(list(ENGINE_TAGS))
    return engine


def _train_a_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model.train()
    batch = torch.tensor([[3, 17, 42, 99, 5]])
    model(batch, labels=batch).loss.backward()
    opt.step()


def _check_failed_switch(manager: ShardingManager, engine: ReferenceEngine, before: dict, model, opt) -> None:
    with pytest.raises(SwitchError) as info:
        manager.to_infer()
    err = info.value
    assert err.step == "weight sync" and err.phase_after is Phase.TRAIN
    assert isinstance(err.__cause__, WeightCoverageError)
    assert sorted(err.__cause__.unwritten) == BIASES
    for name in BIASES:
        assert name in str(err)
    assert manager.phase is Phase.TRAIN
    assert set(manager.offload_states().values()) == {OffloadState.ON_DEVICE}
    assert engine.resident_nbytes("weights") == engine.resident_nbytes("kv_cache") == 0
    assert_bitwise_equal(before, snapshot(model, opt))


def test_llama_into_a_qwen2_engine_is_refused_at_construction_naming_both():
    model = _llama()
    with pytest.raises(ValueError,
                       match="ReferenceEngine.*LlamaForCausalLM \\(llama\\).*qkv_bias=True.*qkv_bias=False"):
        ShardingManager(model, _qwen2_engine(), optimizer=torch.optim.AdamW(model.parameters()))


def test_llama_into_a_qwen2_engine_through_load_weights_fails_the_switch_naming_the_biases():
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_a_step(model, opt)
    before = snapshot(model, opt)
    engine = _qwen2_engine()
    # A sync of the caller's own skips the construction check; the coverage proof still catches it.
    sync = LoadWeightsSync(lambda: model.state_dict().items(), engine)
    manager = ShardingManager(model, engine, optimizer=opt, weight_sync=sync)
    _check_failed_switch(manager, engine, before, model, opt)


def test_llama_into_a_qwen2_engine_through_the_resharding_engine_fails_the_switch_naming_the_biases():
    config = HybridConfig(device="cpu")
    spec = ModelSpec.from_hf_config(LLAMA)
    hf = _llama()
    local = shard({k: v.detach() for k, v in hf.state_dict().items()},
                  megatron_layout(spec, config.train_layout, 1), 0)
    model = MegatronLayoutGPT(spec, group=None,
                              padded_vocab_size=local["embedding.word_embeddings.weight"].shape[0],
                              dtype=torch.float32, device="cpu")
    model.load_state_dict(local)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    (-model.token_logprobs(torch.tensor([[3, 17, 42, 99, 5]])).sum()).backward()
    opt.step()
    before = snapshot(model, opt)
    engine = _qwen2_engine()
    sync = ReshardSync(spec, config.train_layout, config.infer_layout, None, model.named_parameters, engine,
                       dtype=torch.float32)
    manager = ShardingManager(model, engine, optimizer=opt, config=config, weight_sync=sync)
    _check_failed_switch(manager, engine, before, model, opt)


def test_a_matching_engine_is_proven_fully_written():
    """The same Llama into a Llama-config engine: the switch succeeds, reports a checked coverage, and the
    engine's greedy tokens are transformers'."""
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = ReferenceEngine(LLAMA, num_kv_blocks=8, block_size=4)
    engine.release(list(ENGINE_TAGS))
    manager = ShardingManager(model, engine, optimizer=opt)
    prompt = [3, 17, 42, 99, 5]
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=6,
                                  do_sample=False)[0, len(prompt):].tolist()
    report = manager.to_infer()
    sync_step = next(s for s in report.steps if s.name == "weight sync")
    assert sync_step.extra["coverage_checked"] is True
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))
    assert out.token_ids == expected
    manager.to_train()


def test_a_fused_tensor_missing_one_part_is_unwritten():
    """q and k loaded but not v (or gate but not up): the fused vLLM tensor is only partly written."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**DIMS))
    engine = ReferenceEngine(QWEN2, num_kv_blocks=8, block_size=4)
    engine.release(list(ENGINE_TAGS))
    engine.resume(["weights"])
    missing = {"model.layers.0.self_attn.v_proj.bias", "model.layers.1.mlp.up_proj.weight"}
    engine.load_weights((k, v) for k, v in hf.state_dict().items() if k not in missing)
    assert sorted(engine.unwritten_weights()) == ["model.layers.0.self_attn.qkv_proj.bias",
                                                  "model.layers.1.mlp.gate_up_proj.weight"]
    engine.load_weights((k, v) for k, v in hf.state_dict().items() if k in missing)
    assert engine.unwritten_weights() == []
    engine.release(["weights"])
    engine.resume(["weights"])  # a resume starts a new proof
    assert len(engine.unwritten_weights()) == len(dict(engine.named_parameters()))


def test_a_family_the_embedded_engine_does_not_run_is_still_checked_against_it():
    # Mixtral's config as transformers writes it (MoE: no embedded blocks for it) against the engine's Qwen2
    # of the same shape: the architecture check reads the training side through hybridmem.models (every
    # family), so the missing q/k/v biases are named at construction.
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(**{k: v for k, v in DIMS.items()}, num_local_experts=2, num_experts_per_tok=1)
    model = MixtralForCausalLM(config).eval()
    named = "ReferenceEngine.*MixtralForCausalLM \\(mixtral\\).*qkv_bias=True.*qkv_bias=False"
    with pytest.raises(ValueError, match=named):
        ShardingManager(model, _qwen2_engine(), optimizer=torch.optim.AdamW(model.parameters()))
