"""The Hub's multimodal checkpoints of Qwen3.5 (``qwen3_5``, ``qwen3_5_moe``) and Gemma 4 (``gemma4``, dense,
MoE, and with per-layer input embeddings): a nested ``text_config``, text weights under
``model.language_model.*``, served as the text model: vLLM's own ``Qwen3_5ForCausalLM`` /
``Qwen3_5MoeForCausalLM`` / ``Gemma4ForCausalLM`` and ``load_weights`` read the prefixed checkpoint, and
every rank's parameters (and the buffers the loader fills, Gemma 4's ``layer_scalar``) equal ``shard`` of its
text weights (the prefix dropped) under ``vllm_layout`` of the spec its config.json gives.

The checkpoints are written by transformers' multimodal classes (``save_pretrained``) with every value
replaced by a distinct number; the vision tower's weights are left out (the text model has no place for them;
vLLM's Gemma 4 text class also skips them by name, which the Gemma 4 cases check by keeping them).
As in test_vllm_names.py, four workers build the model with vLLM's classes on CPU over gloo.
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridmem.config import ParallelLayout
from hybridmem.reshard import ModelSpec, shard, vllm_layout
from hybridmem.testing.workers import WorkerPool
from tests.reshard import _vllm_tasks
from tests.reshard.families import COMMON, MODELS, distinct_values, take_checkpoint

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.slow

WORLD = 4
_QWEN3_5_VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                       out_hidden_size=COMMON["hidden_size"], num_position_embeddings=16)
_GEMMA4_VISION = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=16, position_embedding_size=16)
MULTIMODAL = {
    # model id: (multimodal model_type, vLLM's text class, vision config, the vision tower's checkpoint
    # prefixes left out of the checkpoint)
    "qwen3.5": ("qwen3_5", "Qwen3_5ForCausalLM", _QWEN3_5_VISION, ("model.visual.",)),
    "qwen3.5-moe": ("qwen3_5_moe", "Qwen3_5MoeForCausalLM", _QWEN3_5_VISION, ("model.visual.",)),
    "gemma4": ("gemma4", "Gemma4ForCausalLM", _GEMMA4_VISION, ()),
    "gemma4-moe": ("gemma4", "Gemma4ForCausalLM", _GEMMA4_VISION, ()),
    "gemma4-ple": ("gemma4", "Gemma4ForCausalLM", _GEMMA4_VISION, ()),
}
PREFIX = "model.language_model."
TOWERS = ("model.visual.", "model.vision_tower.", "model.embed_vision.")


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(WORLD, timeout_s=300) as p:
        yield p


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{model id: (dir, spec, {text hf name: tensor})}``."""
    out = {}
    for model_id, (model_type, architecture, vision, left_out) in MULTIMODAL.items():
        kw = MODELS[model_id][1]
        cfg = transformers.AutoConfig.for_model(model_type, text_config={**COMMON, **kw},
                                                vision_config=vision,
                                                tie_word_embeddings=kw.get("tie_word_embeddings", True))
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(model_id)
        transformers.AutoModelForImageTextToText.from_config(cfg).save_pretrained(path)
        names = take_checkpoint(path)
        assert any(n.startswith(TOWERS) for n in names)
        names = {n: t for n, t in names.items() if not (left_out and n.startswith(left_out))}
        weights = distinct_values(names)
        assert any(n.startswith(PREFIX) for n in weights)
        safetensors_torch.save_file(weights, path / "model.safetensors")
        config = json.loads((path / "config.json").read_text())
        config["architectures"] = [architecture]  # the text model, reading the multimodal checkpoint
        (path / "config.json").write_text(json.dumps(config))
        text = {("model." + n[len(PREFIX):] if n.startswith(PREFIX) else n): t for n, t in weights.items()
                if not n.startswith(TOWERS)}
        spec = ModelSpec.from_hf_config(config)
        assert spec.family == MODELS[model_id][0], (model_id, spec.family)
        out[model_id] = (str(path), spec, text)
    return out


CASES = [(model, tp, pp) for model in MULTIMODAL for tp, pp in ((2, 1), (1, 2))]


@pytest.mark.parametrize("model_id,tp,pp", CASES, ids=[f"{m}-tp{tp}-pp{pp}" for m, tp, pp in CASES])
def test_multimodal_checkpoint_loads_as_the_text_layout(pool, checkpoints, model_id, tp, pp):
    path, spec, text = checkpoints[model_id]
    got = pool.run(_vllm_tasks.vllm_loaded_parameters, path, tp, pp, 1, world_size=WORLD)
    layout = vllm_layout(spec, ParallelLayout(tp=tp, pp=pp), WORLD)
    for rank in range(WORLD):
        ours = shard(text, layout, rank)
        assert set(ours) == set(got[rank]), (rank, sorted(set(ours) ^ set(got[rank])))
        for name, tensor in got[rank].items():
            assert torch.equal(ours[name], tensor), (rank, name)
