"""Training states declare what they offer (TrainingCapabilities); the manager acts on the declaration, a
declaration the state cannot keep is refused when the manager is built, and a state that declares nothing
gets what its methods offer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hybridmem import HybridConfig, PhaseError, ShardingManager
from hybridmem.adapters.torch import TorchTrainingState
from hybridmem.contract.training import TrainingCapabilities, training_capabilities_of
from hybridmem.engines import ReferenceEngine, TorchCopyEngine
from hybridmem.weight_sync import ReshardSync


class _ThirdParty:
    """A training state of its own: the protocol's two methods plus misuse guards and ``attach``."""

    def __init__(self, capabilities: TrainingCapabilities | None = None):
        self._plain = TorchTrainingState(torch.nn.Linear(4, 4))
        self.model = self._plain.modules[0]
        self.attached_to = []
        if capabilities is not None:
            self.capabilities = capabilities

    def build_offloaders(self, accel, pool, config):
        return self._plain.build_offloaders(accel, pool, config)

    def named_weights(self):
        return self._plain.named_weights()

    def guard_targets(self):
        return [self.model], []

    def attach(self, manager):
        self.attached_to.append(manager)


class _ClaimsTooMuch(_ThirdParty):
    capabilities = TrainingCapabilities(megatron_names=True)


def test_a_capability_without_its_method_is_refused_at_construction():
    with pytest.raises(TypeError, match=r"_ClaimsTooMuch.capabilities declares megatron_names=True but the "
                                        r"training state has no callable \['megatron_convention'\]"):
        ShardingManager(_ClaimsTooMuch(), TorchCopyEngine(torch.nn.Linear(4, 4)),
                        config=HybridConfig(device="cpu"))


def test_capabilities_of_another_type_are_refused():
    state = _ThirdParty()
    state.capabilities = {"guards_misuse": True}
    with pytest.raises(TypeError, match=r"_ThirdParty.capabilities must be a TrainingCapabilities, got dict"):
        training_capabilities_of(state)


def test_a_state_declaring_nothing_gets_what_its_methods_offer():
    state = _ThirdParty()
    assert training_capabilities_of(state) == TrainingCapabilities(guards_misuse=True, attaches_itself=True)
    manager = ShardingManager(state, TorchCopyEngine(state.model), config=HybridConfig(device="cpu"))
    assert state.attached_to == [manager]
    with manager.inference():
        with pytest.raises(PhaseError):
            state.model(torch.ones(1, 4))


def test_the_manager_acts_on_the_declaration_not_on_the_methods():
    # The same methods, declared off: the manager neither guards the model nor attaches the state.
    state = _ThirdParty(TrainingCapabilities())
    manager = ShardingManager(state, TorchCopyEngine(state.model), config=HybridConfig(device="cpu",
                                                                                       offload_train_param=False))
    assert state.attached_to == []
    with manager.inference():
        assert state.model(torch.ones(1, 4)).shape == (1, 4)


def test_a_from_pretrained_model_declares_its_config_guards_and_checkpoint(tmp_path):
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    opt = torch.optim.AdamW(model.parameters())
    manager = ShardingManager(model, ReferenceEngine(model.config), optimizer=opt)
    assert manager.training_capabilities == TrainingCapabilities(guards_misuse=True, has_hf_config=True,
                                                                 lists_checkpoint_weights=True,
                                                                 reports_layout=True, holds_module=True)
    assert isinstance(manager.weight_sync, ReshardSync)  # the spec read from the declared hf_config
    with manager.inference():
        with pytest.raises(PhaseError):
            opt.step()
