"""What ShardingManager does with users' own code and no knobs: models from ``from_pretrained``, engines
built the plain way, ``HybridConfig()`` or no config at all.

References are independent of the code under test: transformers' own greedy generation, the vLLM-layout
shards computed with torch ops in tests/reshard/reference.py, the model's own ``state_dict()``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hybridmem import ConfigError, HybridConfig, ShardingManager
from hybridmem.engines import ReferenceEngine, SamplingParams
from hybridmem.reshard import ModelSpec
from hybridmem.testing.tiny import assert_bitwise_equal, snapshot
from hybridmem.weight_sync import LoadWeightsSync, ReshardSync
from tests.reshard.reference import vllm_shard

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False)
PROMPTS = [[3, 17, 42, 99, 5], [8, 8, 1]]


@pytest.fixture
def model_dir(tmp_path):
    """A Qwen2 checkpoint on disk, as ``save_pretrained`` writes it."""
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**CONFIG)).save_pretrained(tmp_path)
    return tmp_path


def _train_step(model, opt, step: int) -> None:
    batch = torch.randint(0, CONFIG["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(step))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad()


def _hf_greedy(model, max_tokens: int = 6) -> list[list[int]]:
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=max_tokens,
                               do_sample=False)[0, len(p):].tolist()
                for p in PROMPTS]


def test_from_pretrained_model_into_the_embedded_engine_with_no_knobs(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = ShardingManager(model, ReferenceEngine(model.config), optimizer=opt)
    assert isinstance(manager.weight_sync, ReshardSync)  # the spec came from model.config
    for step in range(3):
        _train_step(model, opt, step)
        model.eval()
        expected, before = _hf_greedy(model), snapshot(model, opt)
        with manager.inference() as engine:
            outs = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.0))
        assert [o.token_ids for o in outs] == expected, step
        assert_bitwise_equal(before, snapshot(model, opt))
        model.train()


def test_an_awake_engine_is_released_when_the_manager_is_built(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    engine = ReferenceEngine(model.config)  # built awake: weights and KV cache resident
    assert engine.resident_nbytes("kv_cache") > 0
    manager = ShardingManager(model, engine)
    assert engine.resident_nbytes("weights") == engine.resident_nbytes("kv_cache") == 0
    assert not manager.residency().leftovers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_dtypes_give_the_engine_the_trainers_weights_bit_for_bit(model_dir, dtype):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt, 0)
    engine = ReferenceEngine(model.config, dtype=dtype)
    manager = ShardingManager(model, engine, optimizer=opt)
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    expected = vllm_shard(full, ModelSpec.from_hf_config(model.config), tp=1, pp=1, ep=1, world=1, rank=0)
    with manager.inference():
        got = dict(engine.named_parameters())
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            assert got[name].dtype == dtype and torch.equal(got[name], tensor.to(dtype)), name
    sync = next(s for s in manager.last_reports[manager.last_report.direction.TO_INFER].steps
                if s.name == "weight sync")
    assert "note" not in sync.extra  # nothing was cast


def test_reshard_sync_built_by_hand_keeps_the_trainers_dtype(model_dir):
    """``ReshardSync`` as docs/reshard.md builds it, with no ``dtype=``: an fp32 trainer is not sent as
    bf16."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    engine = ReferenceEngine(model.config)
    cfg = HybridConfig()
    sync = ReshardSync(ModelSpec.from_hf_config(model.config), cfg.train_layout, cfg.infer_layout, None,
                       lambda: dict(model.named_parameters()), engine)
    assert sync.dtype == torch.float32
    manager = ShardingManager(model, engine, weight_sync=sync)
    expected = vllm_shard({k: v.detach().clone() for k, v in model.state_dict().items()},
                          ModelSpec.from_hf_config(model.config), tp=1, pp=1, ep=1, world=1, rank=0)
    with manager.inference():
        got = dict(engine.named_parameters())
        assert all(torch.equal(got[n], t) for n, t in expected.items())


def test_another_engine_dtype_is_a_cast_the_report_and_a_warning_name(model_dir, caplog):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    manager = ShardingManager(model, ReferenceEngine(model.config, dtype=torch.bfloat16))
    with caplog.at_level(logging.WARNING, logger="hybridmem"):
        report = manager.to_infer()
        manager.to_train()
        manager.to_infer()
        manager.to_train()
    note = "weights cast: trainer float32 -> engine bfloat16"
    assert note in str(report)
    assert sum(note in r.getMessage() for r in caplog.records) == 1  # warned once, reported every switch


def test_a_model_of_no_known_family_streams_what_a_checkpoint_holds():
    """A custom module (no transformers config) into a user's own engine: parameters and persistent buffers
    by the module's names, never a non-persistent buffer (as RoPE's ``inv_freq`` is in transformers)."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.register_buffer("running", torch.ones(4))
            self.register_buffer("scratch", torch.zeros(4), persistent=False)

    class RecordingEngine:
        def __init__(self):
            self.received: list[str] = []

        def load_weights(self, weights):
            self.received += [name for name, _ in weights]

        def release(self, tags):
            pass

        def resume(self, tags):
            pass

    model, engine = Net(), RecordingEngine()
    manager = ShardingManager(model, engine)
    assert isinstance(manager.weight_sync, LoadWeightsSync)
    with manager.inference():
        pass
    assert sorted(engine.received) == sorted(model.state_dict())  # what a checkpoint holds, no "scratch"


def test_a_layout_key_that_contradicts_the_parts_is_refused_naming_both(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=2 .*expected 1, what the training "
                                          r"state TorchTrainingState runs at"):
        ShardingManager(model, ReferenceEngine(model.config),
                        config=HybridConfig(tensor_model_parallel_size=2))
    with pytest.raises(ConfigError,
                       match=r"infer_tensor_parallel_size=2 .*expected 1, what the engine ReferenceEngine"):
        ShardingManager(model, ReferenceEngine(model.config),
                        config=HybridConfig(infer_tensor_parallel_size=2))
    manager = ShardingManager(model, ReferenceEngine(model.config), config=HybridConfig())
    assert (manager.config.tensor_model_parallel_size, manager.config.infer_tensor_parallel_size) == (1, 1)
