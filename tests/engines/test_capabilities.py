"""Engines declare what they can do (EngineCapabilities); a declaration the engine cannot keep is refused
when the manager is built, and an engine that declares nothing gets what its methods offer."""

from __future__ import annotations

import pytest
import torch

from hybridmem import HybridConfig, ShardingManager
from hybridmem.contract.engine import EngineCapabilities, capabilities_of
from hybridmem.engines import TorchCopyEngine


class _Minimal:
    """Only the three protocol methods."""

    def load_weights(self, weights):
        for _ in weights:
            pass

    def release(self, tags):
        pass

    def resume(self, tags):
        pass


class _Claims(_Minimal):
    capabilities = EngineCapabilities(writes_in_place=True, reports_residency=True)


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    return model, torch.optim.AdamW(model.parameters())


def test_a_capability_without_its_method_is_refused_at_construction():
    model, opt = _model()
    with pytest.raises(TypeError, match=r"_Claims.capabilities declares writes_in_place=True but the engine "
                                        r"has no callable \['named_parameters'\]"):
        ShardingManager(model, _Claims(), optimizer=opt, config=HybridConfig(device="cpu"))


def test_an_engine_declaring_nothing_gets_what_its_methods_offer():
    caps = capabilities_of(_Minimal())
    assert caps == EngineCapabilities()
    assert not (caps.writes_in_place or caps.reports_residency or caps.reports_weight_coverage)


def test_the_copy_engine_declares_its_capabilities_and_the_manager_uses_them():
    model, opt = _model()
    engine = TorchCopyEngine(model)
    assert capabilities_of(engine).loads_training_names and capabilities_of(engine).reports_weight_coverage
    manager = ShardingManager(model, engine, optimizer=opt, config=HybridConfig(device="cpu"))
    assert manager.engine_capabilities is engine.capabilities
    with manager.inference():
        # The residency report reads the engine's bytes because the engine says it reports them.
        assert manager.residency().by_owner["engine weights"] == sum(
            p.numel() * 4 for p in model.parameters())


def test_a_wrong_type_of_declaration_is_named():
    class Bad(_Minimal):
        capabilities = {"writes_in_place": True}

    with pytest.raises(TypeError, match="Bad.capabilities must be an EngineCapabilities, got dict"):
        capabilities_of(Bad())


class _SaysItsLayoutWithoutDeclaring(_Minimal):
    capabilities = EngineCapabilities()
    parallel_layout = {"tp": 4}


class _DeclaresALayoutItLacks(_Minimal):
    capabilities = EngineCapabilities(reports_layout=True)


def test_what_an_engine_serves_is_read_only_when_declared():
    """Declared, not probed: an engine declaring capabilities is read through them alone, attributes too."""
    model, opt = _model()
    manager = ShardingManager(model, _SaysItsLayoutWithoutDeclaring(), optimizer=opt,
                              config=HybridConfig(device="cpu"))
    assert manager.config.infer_tensor_parallel_size == 1  # its undeclared parallel_layout is not read
    manager.close()
    with pytest.raises(TypeError, match=r"_DeclaresALayoutItLacks.capabilities declares reports_layout=True "
                                        r"but the engine has no attribute \['parallel_layout'\]"):
        ShardingManager(model, _DeclaresALayoutItLacks(), optimizer=opt, config=HybridConfig(device="cpu"))


def test_an_engine_declaring_nothing_has_its_attributes_read_once():
    engine = _Minimal()
    engine.parallel_layout = {"tp": 1}
    engine.check_weights = lambda expected, what="": None
    caps = capabilities_of(engine)
    assert caps.reports_layout and caps.checks_weights and not caps.describes_weights
