"""share_base: a PEFT LoRA model's frozen base as views of the engine's weights ([Note: shared base] in
:mod:`hybridmem.weight_sync.shared_base`).

The engine is the embedded ReferenceEngine, which keeps vLLM's layout at TP 1 unrepacked on the CPU (the same
layout vLLM's GPU kernels keep); the reference is the model itself before sharing: its logits, its values, and
whether its old base tensors are still alive.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from hybridmem.accel import get_accelerator
from hybridmem.contract.engine import EngineCapabilities
from hybridmem.engines.reference import ReferenceEngine
from hybridmem.offload import ParamOffloader
from hybridmem.offload.engine_owned import is_engine_owned
from hybridmem.offload.host_pool import HostBufferPool
from hybridmem.weight_sync.lora import peft_base_weights
from hybridmem.weight_sync.shared_base import share_base

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(tied: bool = False):
    config = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=96, num_hidden_layers=2, vocab_size=100,
                                      max_position_embeddings=64, tie_word_embeddings=tied)
    torch.manual_seed(0)
    base = transformers.Qwen2ForCausalLM(config)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8,
                                                      target_modules=TARGETS, init_lora_weights=False))
    return model, config


def _engine(config, model) -> ReferenceEngine:
    engine = ReferenceEngine(config.to_dict(), num_kv_blocks=8, block_size=8)
    engine.load_weights(peft_base_weights(model))
    return engine


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_base_becomes_the_engines_memory_and_the_model_computes_the_same(tied):
    model, config = _model(tied)
    engine = _engine(config, model)
    tokens = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        before = model(tokens).logits.clone()
    base = {n: p for n, p in model.named_parameters() if "lora_" not in n}
    old = [weakref.ref(p) for p in base.values()]
    storages = {t.untyped_storage().data_ptr() for _, t in engine.named_parameters()}

    shared = share_base(model, engine)
    del base
    gc.collect()

    assert len(shared.names) == len(old)
    assert all(ref() is None for ref in old), "the trainer's own copy of the base is still alive"
    for name, param in model.named_parameters():
        if "lora_" in name:
            assert not is_engine_owned(param) and param.untyped_storage().data_ptr() not in storages
        else:
            assert is_engine_owned(param) and param.untyped_storage().data_ptr() in storages, name
    inner = model.get_base_model()
    if tied:
        assert inner.lm_head.weight is inner.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, before)


def test_training_the_adapters_leaves_the_engines_weights_and_offload_leaves_them_in_place():
    model, config = _model()
    engine = _engine(config, model)
    share_base(model, engine)
    engine_before = {n: t.clone() for n, t in engine.named_parameters()}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(torch.tensor([[1, 5, 9, 2, 7]]), labels=torch.tensor([[1, 5, 9, 2, 7]])).loss.backward()
        opt.step()
    assert all(torch.equal(t, engine_before[n]) for n, t in engine.named_parameters())
    assert any(not torch.equal(p, adapters[n]) for n, p in model.named_parameters() if p.requires_grad)

    accel = get_accelerator("cpu")
    offloader = ParamOffloader(model, accel, HostBufferPool(accel))
    moved = [t for t in offloader.tensors()]
    assert moved and not any(is_engine_owned(t) for t in moved)
    assert {t.untyped_storage().data_ptr() for t in moved}.isdisjoint(
        t.untyped_storage().data_ptr() for _, t in engine.named_parameters())
    offloader.offload()
    try:
        assert all(torch.equal(t, engine_before[n]) for n, t in engine.named_parameters())
    finally:
        offloader.onload()


def test_a_trainable_base_tensor_is_refused_by_name():
    model, config = _model()
    engine = _engine(config, model)
    model.get_base_model().model.norm.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"model\.norm\.weight is trainable"):
        share_base(model, engine)


def test_an_engine_holding_other_values_is_refused_by_name():
    model, config = _model()
    engine = ReferenceEngine(config.to_dict(), num_kv_blocks=8, block_size=8)  # nothing synced into it
    with pytest.raises(ValueError, match="holds other values than the trainer's"):
        share_base(model, engine)
    assert not any(is_engine_owned(p) for p in model.parameters())


class _Repacked:
    """An engine like vLLM's CPU backend: in place in principle, but its linear weights were repacked."""

    capabilities = EngineCapabilities(writes_in_place=True)

    def named_parameters(self):
        raise RuntimeError("named_parameters() is not offered: vLLM repacked 14 parameters")


def test_an_engine_that_repacked_its_weights_is_refused_with_its_reason():
    model, _ = _model()
    with pytest.raises(ValueError, match="cannot share its weights with the trainer: .*repacked"):
        share_base(model, _Repacked())
