"""Each family's ``architectures`` are the class names transformers and vLLM give its text model, and a config
saved without ``model_type`` is read as the family of its class."""

from __future__ import annotations

import pytest

from hybridmem.engines.nn.config import embedded_spec
from hybridmem.models import FAMILIES, model_type_of
from hybridmem.reshard import ModelSpec

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_architecture_is_a_transformers_class(name):
    family = FAMILIES[name]
    assert family.architectures, f"{name} names no architecture"
    missing = [arch for arch in family.architectures if not hasattr(transformers, arch)]
    assert not missing, f"{name}: transformers has no class {missing}"


def test_every_architecture_is_a_vllm_model_class():
    registry = pytest.importorskip("vllm.model_executor.models").ModelRegistry
    known = set(registry.get_supported_archs())
    missing = {name: arch for name, f in FAMILIES.items() for arch in f.architectures if arch not in known}
    assert not missing, f"vLLM registers no model class {missing}"


def test_a_config_without_model_type_is_read_as_the_family_of_its_class():
    config = transformers.Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=48, num_hidden_layers=2, vocab_size=64,
                                      architectures=["Qwen2ForCausalLM"]).to_dict()
    del config["model_type"]
    spec = ModelSpec.from_hf_config(config)
    # Qwen2's q/k/v biases, which Llama's reader leaves out
    assert (spec.family, spec.qkv_bias) == ("qwen2", True)
    assert embedded_spec(config).family == "qwen2"
    assert model_type_of({"architectures": ["SomeOtherForCausalLM"]}.get) == "llama"
    assert model_type_of({}.get) == "llama"
