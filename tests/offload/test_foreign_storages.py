"""Storages torch cannot resize (memory-mapped safetensors, NumPy, Python buffers, DLPack, shared memory)
are offloaded and brought back bitwise through ShardingManager, like the rest.

The reference for "nothing changed" is a copy of the same model and optimizer trained without hybridmem;
the fault-injection harness (tests/test_fault_injection.py, configuration ``adamw-foreign``) injects a
failure at every call of a switch of such a model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _foreign import KINDS, foreign_copy, make_foreign

from hybridmem import Direction, ShardingManager
from hybridmem.engines import TorchCopyEngine
from hybridmem.testing.tiny import TinyNet, assert_bitwise_equal, snapshot, train_step


def test_torch_cannot_resize_these_storages_in_place():
    for kind in KINDS:
        storage = foreign_copy(torch.randn(4, 4), kind).untyped_storage()
        if kind == "shared-memory":  # resizable() says yes, but growing it back after a shrink crashes
            assert storage.is_shared()
            continue
        assert not storage.resizable(), kind
        with pytest.raises(RuntimeError, match="not resizable"):
            storage.resize_(0)


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        train_step(model, opt, step)
    return model, opt


@pytest.mark.parametrize("kind", KINDS)
def test_foreign_storages_round_trip_through_the_manager(kind):
    model, opt = _trained()
    reference_model = copy.deepcopy(model)
    reference_opt = torch.optim.AdamW(reference_model.parameters(), lr=1e-2)
    reference_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    make_foreign(model, opt, (kind,))
    head = model.head.weight
    engine = TorchCopyEngine(model, kv_cache_nbytes=4096)
    manager = ShardingManager(model, engine, optimizer=opt)
    for cycle in range(3):
        before = snapshot(model, opt)
        with manager.inference():
            residency = manager.residency()
            assert not residency.leftovers, residency
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                assert t.untyped_storage().nbytes() == 0, f"{kind}: {name} still holds device memory in INFER"
        assert_bitwise_equal(before, snapshot(model, opt))
        assert model.head.weight is head and model.embed.weight is head, "tied weight replaced"
        assert train_step(model, opt, 2 + cycle) == train_step(reference_model, reference_opt,
                                                               2 + cycle), cycle
    # Re-homed once: the parameters now live on storages torch owns, which later switches resize.
    assert all(p.untyped_storage().resizable() and not p.untyped_storage().is_shared()
               for p in model.parameters())
    assert_bitwise_equal(snapshot(reference_model, reference_opt), snapshot(model, opt))


def test_views_of_one_foreign_storage_stay_views_of_one_storage():
    module = torch.nn.Module()
    flat = foreign_copy(torch.arange(24, dtype=torch.float32), "numpy")
    module.a = torch.nn.Parameter(flat[:8].view(2, 4))  # two parameters over one buffer, at offsets 0 and 8
    module.b = torch.nn.Parameter(flat[8:].view(4, 4))
    assert module.a.untyped_storage()._cdata == module.b.untyped_storage()._cdata
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    manager = ShardingManager(module, None, optimizer=opt)
    with manager.inference():
        assert module.a.untyped_storage().nbytes() == 0
    assert module.a.untyped_storage()._cdata == module.b.untyped_storage()._cdata
    assert (module.a.storage_offset(), module.b.storage_offset()) == (0, 8)
    assert torch.equal(torch.cat([module.a.reshape(-1), module.b.reshape(-1)]),
                       torch.arange(24, dtype=torch.float32))
    with torch.no_grad():  # still one buffer: a write through one is seen by a view over both
        module.a.add_(1)
    whole = torch.empty(0).set_(module.a.untyped_storage(), 0, (24,), (1,))
    assert torch.equal(whole[:8], torch.arange(8, dtype=torch.float32) + 1)


def test_memory_plan_counts_the_transient_storage_of_a_rehoming():
    model, opt = _trained()
    make_foreign(model, opt, ("numpy",))
    manager = ShardingManager(model, None, optimizer=opt)
    plan = {s.name: s for s in manager.plan(Direction.TO_INFER).steps}
    largest_param = max(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert plan["offload param"].estimate.transient_nbytes == largest_param
    manager.to_infer()
    manager.to_train()
    plan = {s.name: s for s in manager.plan(Direction.TO_INFER).steps}
    assert plan["offload param"].estimate.transient_nbytes == 0  # re-homed: nothing transient any more
