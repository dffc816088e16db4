"""Co-resident models (the reference policy): offloaded except inside ``onloaded()``, in TRAIN and INFER."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridmem import HybridConfig, MemoryPlanError, Phase, PhaseError, ShardingManager
from hybridmem.engines import TorchCopyEngine
from hybridmem.switch.colocate import CoResidentState
from hybridmem.testing.tiny import TinyNet, assert_bitwise_equal, make_batch, snapshot


def _setup(device="cpu", config=None):
    torch.manual_seed(0)
    model = TinyNet().to(device)
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = ShardingManager(model, TorchCopyEngine(model, kv_cache_nbytes=4096), optimizer=opt,
                          config=config or HybridConfig(device=device))
    return mgr, model, ref


def _storage_nbytes(module):
    return {p.untyped_storage().nbytes() for p in [*module.parameters(), *module.buffers()]}


def test_reference_is_offloaded_outside_onloaded_and_bitwise_inside(device):
    mgr, _, ref = _setup(device)
    expected = snapshot(ref)
    co = mgr.add_coresident("reference", ref)
    assert _storage_nbytes(ref) == {0}
    assert mgr.residency().by_owner["reference"] == 0
    tokens, _ = make_batch(0, device)
    with mgr.onloaded("reference") as model:
        assert model is ref and co.state is CoResidentState.ONLOADED
        assert_bitwise_equal(snapshot(ref), expected)
        assert mgr.residency().by_owner["reference"] == co.live_nbytes() > 0
        out_train = model(tokens)
    assert _storage_nbytes(ref) == {0}
    assert co.last_transfers["onload"].copied_nbytes == co.live_nbytes()
    with mgr.inference():
        with mgr.onloaded("reference") as model:  # beside the engine, in INFER
            assert torch.equal(model(tokens), out_train)
        assert mgr.residency().leftovers.get("reference", 0) == 0
    assert not any(p.requires_grad for p in ref.parameters())


def test_onloaded_refuses_nesting_and_switches_refuse_while_onloaded():
    mgr, _, ref = _setup()
    mgr.add_coresident("reference", ref)
    with mgr.onloaded("reference"):
        with pytest.raises(PhaseError, match="already onloaded"):
            with mgr.onloaded("reference"):
                pass
        with pytest.raises(PhaseError, match=r"co-resident \['reference'\] is onloaded"):
            mgr.to_infer()
        assert mgr.phase is Phase.TRAIN
    with pytest.raises(KeyError, match="no co-resident named 'critic'; registered: \\['reference'\\]"):
        with mgr.onloaded("critic"):
            pass
    with pytest.raises(ValueError, match="owner name 'reference' is already taken"):
        mgr.add_coresident("reference", TinyNet())
    mgr.to_infer()
    with pytest.raises(PhaseError, match="INFER"):
        mgr.add_coresident("critic", TinyNet())
    mgr.to_train()


def test_exception_in_body_offloads_and_propagates():
    mgr, _, ref = _setup()
    expected = snapshot(ref)
    mgr.add_coresident("reference", ref)
    with pytest.raises(ZeroDivisionError):
        with mgr.onloaded("reference"):
            1 / 0  # noqa: B018 - raises ZeroDivisionError in the body on purpose
    assert _storage_nbytes(ref) == {0}
    with mgr.onloaded("reference"):
        assert_bitwise_equal(snapshot(ref), expected)


def test_onload_that_cannot_fit_is_refused_with_the_plan():
    first, model, ref = _setup()
    first.close()  # one manager per model
    train_nbytes = sum(p.numel() * p.element_size() for p in [*model.parameters(), *model.buffers()])
    mgr = ShardingManager(model, None,
                          config=HybridConfig(device="cpu", device_memory_budget_bytes=train_nbytes + 64))
    mgr.add_coresident("reference", ref)
    with pytest.raises(MemoryPlanError, match="onload reference"):
        with mgr.onloaded("reference"):
            pass
    assert _storage_nbytes(ref) == {0}


def test_close_brings_coresidents_back_before_dropping_arenas():
    mgr, _, ref = _setup()
    expected = snapshot(ref)
    mgr.add_coresident("reference", ref)
    mgr.close()
    assert_bitwise_equal(snapshot(ref), expected)
