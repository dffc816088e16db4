"""ShardingManager picks its weight sync from the config: resharding when given a model spec, a plain
load_weights stream when the layouts are equal, and an error naming the layouts otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybridmem import ConfigError, HybridConfig, ParallelLayout, ShardingManager
from hybridmem.contract.training import TrainingCapabilities
from hybridmem.engines import ENGINE_TAGS, ReferenceEngine, TorchCopyEngine
from hybridmem.engines.nn.config import hf_config_dict
from hybridmem.engines.nn.gpt import MegatronLayoutGPT, init_hf_weights
from hybridmem.reshard import megatron_layout, shard
from hybridmem.reshard.spec import ModelSpec
from hybridmem.weight_sync import LoadWeightsSync, ReshardSync, default_weight_sync

CFG = ModelSpec(family="qwen2", hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                intermediate_size=48, num_hidden_layers=2, vocab_size=50, qkv_bias=True, rms_norm_eps=1e-6,
                rope_theta=10000.0)


def _megatron_layout_model() -> MegatronLayoutGPT:
    spec = CFG
    local = shard(init_hf_weights(CFG, seed=3, dtype=torch.float32),
                  megatron_layout(spec, HybridConfig().train_layout, 1), 0)
    model = MegatronLayoutGPT(CFG, padded_vocab_size=local["embedding.word_embeddings.weight"].shape[0],
                              group=None, dtype=torch.float32, device="cpu")
    model.load_state_dict(local)
    return model


def test_model_spec_reshards_megatron_names_into_the_engine():
    model = _megatron_layout_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = ReferenceEngine(hf_config_dict(CFG), num_kv_blocks=8, block_size=8)
    engine.release(list(ENGINE_TAGS))
    manager = ShardingManager(model, engine, optimizer=opt, config=HybridConfig(device="cpu"),
                              model_spec=hf_config_dict(CFG))
    assert isinstance(manager.weight_sync, ReshardSync)
    seqs = torch.tensor([[1, 5, 7, 9, 11, 2], [4, 4, 8, 15, 16, 23]])
    for _ in range(2):  # the second sync must carry the updated weights
        with torch.no_grad():
            expected = model.token_logprobs(seqs).double()
        with manager.inference() as eng:
            got = torch.tensor(eng.compute_logprobs(seqs.tolist()), dtype=torch.float64)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        model.token_logprobs(seqs).sum().backward()
        opt.step()
        opt.zero_grad()
    manager.close()


def test_equal_layouts_without_spec_stream_load_weights():
    model = torch.nn.Linear(4, 4)
    sync = default_weight_sync(SimpleNamespace(named_weights=model.named_parameters), TorchCopyEngine(model),
                               HybridConfig(device="cpu"))
    assert isinstance(sync, LoadWeightsSync)


def test_different_layouts_without_spec_raise_naming_both():
    model = torch.nn.Linear(4, 4)
    engine = SimpleNamespace(load_weights=lambda weights: None, release=lambda tags: None,
                             resume=lambda tags: None)
    with pytest.raises(ValueError, match=r"TP1xPP1xEP1 differs from infer layout TP2xPP1xEP1.*model_spec="):
        ShardingManager(model, engine, config=HybridConfig(device="cpu", infer_tensor_parallel_size=2))


def test_a_copy_engine_is_laid_out_as_training_and_refuses_another_infer_layout():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError,
                       match=r"infer_tensor_parallel_size=2 .*expected 1, what the engine TorchCopyEngine"):
        ShardingManager(model, TorchCopyEngine(model),
                        config=HybridConfig(device="cpu", infer_tensor_parallel_size=2))


def test_training_state_layout_must_match_the_config():
    state = SimpleNamespace(named_weights=lambda: iter(()),
                            source_layout=lambda: SimpleNamespace(tp=2, pp=1, ep=1))
    with pytest.raises(ValueError, match=r"\(2, 1, 1\).*TP1xPP1xEP1"):
        default_weight_sync(state, TorchCopyEngine(torch.nn.Linear(2, 2)), HybridConfig(device="cpu"),
                            model_spec=hf_config_dict(CFG))


def test_training_state_convention_sets_the_megatron_vocab_padding():
    """A Megatron model built with a padded vocab of 56 rows (not 128's multiple): the state's
    ``megatron_convention()`` tells the sync, so the plan expects 56 rows and the engine gets the 50 real
    ones."""
    from hybridmem.reshard import MegatronConvention

    spec = CFG
    conv = MegatronConvention(padded_vocab_size=56)
    full = init_hf_weights(CFG, seed=3, dtype=torch.float32)
    local = shard(full, megatron_layout(spec, HybridConfig().train_layout, 1, convention=conv), 0)
    assert local["embedding.word_embeddings.weight"].shape[0] == 56
    state = SimpleNamespace(named_weights=lambda: iter(local.items()), megatron_convention=lambda: conv)
    engine = ReferenceEngine(hf_config_dict(CFG), num_kv_blocks=8, block_size=8)
    sync = default_weight_sync(state, engine, HybridConfig(device="cpu"), model_spec=hf_config_dict(CFG))
    assert isinstance(sync, ReshardSync)
    sync.sync()
    params = dict(engine.named_parameters())
    assert torch.equal(params["model.embed_tokens.weight"][:50], full["model.embed_tokens.weight"])


def _hf_state():
    """A transformers-named training state: the full HF weights as one process holds them."""
    full = init_hf_weights(CFG, seed=3, dtype=torch.float32)
    return SimpleNamespace(named_weights=lambda: iter(full.items()))


def test_transformers_names_get_the_replicated_hf_source():
    """Before HF sources were known, this sync expected Megatron names and failed at the first switch."""
    from hybridmem.reshard import HFSourceLayout

    engine = ReferenceEngine(hf_config_dict(CFG), num_kv_blocks=8, block_size=8)
    sync = default_weight_sync(_hf_state(), engine, HybridConfig(device="cpu"),
                               model_spec=hf_config_dict(CFG))
    assert isinstance(sync, ReshardSync) and isinstance(sync.plan.src, HFSourceLayout)
    assert sync.plan.src.shard_size == 1
    sync.sync()
    stats = sync.sync()
    assert stats.received_nbytes == 0 and stats.num_tensors == len(list(engine.named_parameters()))
    # One rank: nothing is received, yet every byte of the weights was written into the engine (its
    # padding rows aside).
    full = init_hf_weights(CFG, seed=3, dtype=torch.float32)
    assert stats.engine_nbytes == sum(t.numel() * t.element_size() for t in full.values())


class _StreamLoader:
    """An engine that takes full HF tensors through ``load_weights`` only, counting their bytes."""

    def __init__(self) -> None:
        self.nbytes = 0

    def load_weights(self, weights) -> None:
        for _, tensor in weights:
            self.nbytes += tensor.numel() * tensor.element_size()


def test_a_streamed_sync_on_one_rank_says_how_many_bytes_reached_the_engine():
    full = init_hf_weights(CFG, seed=3, dtype=torch.float32)
    engine = _StreamLoader()
    sync = ReshardSync(CFG, ParallelLayout(), ParallelLayout(), None, lambda: full, engine)
    stats = sync.sync()
    assert stats.received_nbytes == 0
    assert stats.engine_nbytes == engine.nbytes == sum(t.numel() * t.element_size() for t in full.values())


def test_transformers_names_with_a_tensor_parallel_train_layout_are_refused():
    with pytest.raises(ValueError, match=r"transformers' names.*TP2xPP1xEP1; its tp, pp and ep must be 1"):
        default_weight_sync(_hf_state(), TorchCopyEngine(torch.nn.Linear(2, 2)),
                            HybridConfig(device="cpu", tensor_model_parallel_size=2),
                            model_spec=hf_config_dict(CFG))


def test_sharded_state_without_spec_is_refused_even_with_equal_layouts():
    state = SimpleNamespace(named_weights=lambda: iter(()), hf_source_layout=lambda *a, **k: None,
                            capabilities=TrainingCapabilities(shards_weights=True))
    with pytest.raises(ValueError, match=r"holds sharded weights.*model_spec="):
        default_weight_sync(state, TorchCopyEngine(torch.nn.Linear(2, 2)), HybridConfig(device="cpu"))


class _WritingLoader:
    """An engine whose loader writes into what it is handed, as vLLM's gpt-oss loader zeroes the expert
    down-projection bias it is given on tensor-parallel ranks past the first (``weight.zero_()``)."""

    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            if name.endswith("bias"):
                tensor.zero_()
            self.loaded[name] = tensor.clone()

    def release(self, tags):
        pass

    def resume(self, tags):
        pass


def test_a_loader_that_writes_into_its_input_leaves_the_training_weights_alone():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = _WritingLoader()
    manager = ShardingManager(model, engine, optimizer=opt, config=HybridConfig(device="cpu"))
    assert isinstance(manager.weight_sync, LoadWeightsSync) and manager.weight_sync.copies
    with manager.inference():
        pass
    assert set(engine.loaded) == set(before)
    assert not engine.loaded["0.bias"].any()  # the loader did write into what it was handed
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), f"the engine's loader changed the training weight {name}"
    manager.close()
