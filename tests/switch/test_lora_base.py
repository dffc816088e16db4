"""Where a LoRA model's base stays when only its adapters are synced (HybridConfig.lora_base, [Note: lora
base] in :mod:`hybridmem.switch.lora_base`).

The engine is the embedded ReferenceEngine (its weights are released and taken back like vLLM's, and it keeps
vLLM's layout unrepacked, as vLLM on GPUs does); the training model a PEFT LoRA model. The sync here writes
the base into the engine when the engine lacks it and counts its calls: what is checked is the manager's
part, which tensors stay on the device, which move, and whether the engine's weights stay; the adapter
route into vLLM's LoRA itself is tests/integrations/test_trl.py's and tests/adapters' work. The references
are the PEFT model's own tensors (their storages' sizes, their bytes) and the engine's.
"""

from __future__ import annotations

import pytest
import torch

from hybridmem import Direction, HybridConfig, ShardingManager
from hybridmem.contract.kinds import WEIGHTS
from hybridmem.engines.reference import ReferenceEngine
from hybridmem.offload.engine_owned import is_engine_owned
from hybridmem.weight_sync.base import SyncStats, WeightSync
from hybridmem.weight_sync.lora import peft_base_weights

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOKENS = torch.tensor([[1, 5, 9, 2, 7]])


class AdaptersOnly(WeightSync):
    """A sync that says it moves adapters only; it writes the base when the engine lacks it."""

    def __init__(self, model, engine):
        self.model, self.engine, self.syncs, self.told = model, engine, 0, False

    @property
    def adapters_only(self) -> bool:
        return True

    def engine_holds_base(self) -> None:
        self.told = True

    def sync(self) -> SyncStats:
        self.syncs += 1
        if self.engine.unwritten_weights():
            self.engine.load_weights(peft_base_weights(self.model))
        return SyncStats(coverage_checked=True, unwritten=tuple(self.engine.unwritten_weights()))


def _parts(lora_base: str):
    config = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=96, num_hidden_layers=2, vocab_size=100,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.Qwen2ForCausalLM(config),
                                peft.LoraConfig(r=4, lora_alpha=8,
                                                target_modules=["q_proj", "v_proj", "down_proj"]))
    engine = ReferenceEngine(config.to_dict(), num_kv_blocks=8, block_size=8)
    engine.load_weights(peft_base_weights(model))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(TOKENS, labels=TOKENS).loss.backward()
    opt.step()
    sync = AdaptersOnly(model, engine)
    manager = ShardingManager(model, engine, optimizer=opt, weight_sync=sync,
                              config=HybridConfig(device="cpu", lora_base=lora_base))
    return model, engine, sync, manager


def _split(model):
    frozen = [p for n, p in model.named_parameters() if not p.requires_grad]
    trainable = [p for n, p in model.named_parameters() if p.requires_grad]
    return frozen, trainable


def _on_device(tensors) -> bool:
    return all(t.untyped_storage().nbytes() > 0 for t in tensors)


def _offloaded(tensors) -> bool:
    return all(t.untyped_storage().nbytes() == 0 for t in tensors)


@pytest.mark.parametrize("lora_base", ["engine_sleeps", "engine_resident", "shared"])
def test_only_the_adapters_leave_the_device_and_the_base_is_bitwise_kept(lora_base):
    model, engine, sync, manager = _parts(lora_base)
    frozen, trainable = _split(model)
    base_before = [p.detach().clone() for p in frozen]
    adapter_nbytes = sum(p.numel() * p.element_size() for p in trainable)
    with manager.inference():
        assert _on_device(frozen), "the trainer's frozen base left the device"
        assert _offloaded(trainable)
        assert manager.residency().by_owner["train param"] == 0
    assert _on_device(trainable)
    assert all(torch.equal(p, b) for p, b in zip(_split(model)[0], base_before, strict=False))
    assert manager.residency().by_owner["train param"] >= adapter_nbytes
    assert not manager.residency().leftovers


def test_engine_sleeps_releases_the_engines_weights_in_train():
    _, engine, _, manager = _parts("engine_sleeps")
    assert engine.resident_nbytes(WEIGHTS) == 0
    with manager.inference():
        assert engine.resident_nbytes(WEIGHTS) > 0
    assert engine.resident_nbytes(WEIGHTS) == 0


@pytest.mark.parametrize("lora_base", ["engine_resident", "shared"])
def test_resident_engine_weights_stay_through_train_and_are_not_a_leftover(lora_base):
    model, engine, sync, manager = _parts(lora_base)
    resident = engine.resident_nbytes(WEIGHTS)
    assert resident > 0
    for direction in Direction:
        assert not any("engine weights" in step.name for step in manager.steps(direction))
    for _ in range(2):
        with manager.inference() as e:
            assert e.resident_nbytes(WEIGHTS) == resident
            assert e.generate([[1, 5, 9]])[0].token_ids
        assert engine.resident_nbytes(WEIGHTS) == resident
        assert not manager.residency().leftovers
    assert sync.syncs == 2


def test_shared_holds_one_copy_of_the_base():
    model, engine, sync, manager = _parts("shared")
    frozen, trainable = _split(model)
    assert sync.told and all(is_engine_owned(p) for p in frozen)
    assert not any(is_engine_owned(p) for p in trainable)
    engine_storages = {t.untyped_storage().data_ptr() for _, t in engine.named_parameters()}
    assert {p.untyped_storage().data_ptr() for p in frozen} <= engine_storages
    # RoPE's inv_freq: the trainer's own
    buffer_nbytes = sum(b.numel() * b.element_size() for b in model.buffers())
    adapter_nbytes = sum(p.numel() * p.element_size() for p in trainable)
    # The base is counted once, as the engine's: the trainer's parameters are its adapters (and its buffers).
    assert manager.residency().by_owner["train param"] == adapter_nbytes + buffer_nbytes
    with torch.no_grad():
        before = model(TOKENS).logits.clone()
    with manager.inference():
        pass
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, before)


def test_a_sync_of_the_whole_model_ignores_lora_base():
    config = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=96, num_hidden_layers=2, vocab_size=100,
                                      max_position_embeddings=64)
    model = peft.get_peft_model(transformers.Qwen2ForCausalLM(config),
                                peft.LoraConfig(r=4, target_modules=["q_proj"]))
    engine = ReferenceEngine(config.to_dict(), num_kv_blocks=8, block_size=8)
    from hybridmem.weight_sync import LoadWeightsSync
    from hybridmem.weight_sync.lora import merged_lora_weights

    manager = ShardingManager(model, engine,
                              weight_sync=LoadWeightsSync(lambda: merged_lora_weights(model), engine),
                              config=HybridConfig(device="cpu", lora_base="shared"))
    assert manager.lora_base is None and not any(is_engine_owned(p) for p in model.parameters())
    with manager.inference():
        assert _offloaded(_split(model)[0])


def test_an_engine_that_cannot_free_its_kv_cache_alone_keeps_it_with_a_resident_base():
    """vLLM's sleep mode unmaps the weights with the KV cache: with the base kept in the engine, neither is
    released (the embedded engine stands in, declaring what vLLM's sleep mode declares)."""
    import dataclasses

    from hybridmem.contract.kinds import KV_CACHE

    model, engine, sync, _ = _parts("engine_sleeps")
    del _
    engine.capabilities = dataclasses.replace(ReferenceEngine.capabilities, releases_kv_alone=False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    import gc

    gc.collect()
    manager = ShardingManager(model, engine, optimizer=opt, weight_sync=AdaptersOnly(model, engine),
                              config=HybridConfig(device="cpu", lora_base="engine_resident"))
    assert engine.resident_nbytes(KV_CACHE) > 0 and engine.resident_nbytes(WEIGHTS) > 0
    assert not [s.name for d in Direction for s in manager.steps(d) if "kv" in s.name
                or "engine weights" in s.name]
    with manager.inference() as e:
        assert e.generate([[1, 5, 9]])[0].token_ids
    assert engine.resident_nbytes(KV_CACHE) > 0 and not manager.residency().leftovers
