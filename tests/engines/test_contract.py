"""The InferenceEngine contract, run against every engine hybridmem ships or wraps.

ReferenceEngine always runs (CPU); the ``vllm`` entry builds ``hybridmem.adapters.vllm.VLLMEngine`` and
skips unless vLLM and a CUDA device are present. Each factory takes a HF config and returns an engine
whose weights are resident (not yet loaded).
"""

from __future__ import annotations

import pytest
import torch
from engine_cases import MAX_TOKENS, PROMPTS, build_hf

from hybridmem.contract.engine import capabilities_of
from hybridmem.engines import (
    ENGINE_TAGS,
    InferenceEngine,
    ReferenceEngine,
    SamplingParams,
)


def reference_factory(config):
    return ReferenceEngine(config, num_kv_blocks=32, block_size=4)


def vllm_factory(config):
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA device")
    from hybridmem.adapters.vllm import (
        VLLMEngine,  # lazy: the adapter imports vLLM itself
    )

    return VLLMEngine.create(config, tensor_parallel_size=1, gpu_memory_utilization=0.3,
                             distributed_executor_backend=None, dtype="float32", enforce_eager=True,
                             max_model_len=128)


FACTORIES = {"reference": reference_factory, "vllm": vllm_factory}


@pytest.fixture(scope="module", params=list(FACTORIES))
def setup(request):
    config, model = build_hf("qwen2_gqa_bias")
    engine = FACTORIES[request.param](config)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    yield engine, weights, model
    engine.release(list(ENGINE_TAGS))


def _greedy(engine) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True)
    outs = engine.generate(PROMPTS, params)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        assert list(out.prompt_ids) == prompt
        assert len(out.token_ids) == MAX_TOKENS and len(out.logprobs) == MAX_TOKENS
        assert all(lp <= 0.0 for lp in out.logprobs)
    return [list(o.token_ids) for o in outs]


def _ready(engine, weights) -> None:
    engine.resume(list(ENGINE_TAGS))
    engine.load_weights(weights.items())


def test_is_an_inference_engine(setup):
    engine, _, _ = setup
    assert isinstance(engine, InferenceEngine)


def test_load_weights_then_generate_matches_hf(setup):
    engine, weights, model = setup
    _ready(engine, weights)
    ref = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                             do_sample=False, pad_token_id=0)
        ref.append(out[0, len(prompt):].tolist())
    assert _greedy(engine) == ref
    assert _greedy(engine) == ref  # a second call is not affected by the first's KV blocks


@pytest.mark.parametrize("tags", [["weights"], ["kv_cache"], ["weights", "kv_cache"]])
def test_release_resume_tags(setup, tags):
    engine, weights, _ = setup
    _ready(engine, weights)
    before = _greedy(engine)
    resident = {tag: engine.resident_nbytes(tag) for tag in ENGINE_TAGS}
    assert all(n > 0 for n in resident.values())
    engine.release(tags)
    engine.release(tags)  # releasing a released tag is a no-op
    for tag in ENGINE_TAGS:
        assert engine.resident_nbytes(tag) == (0 if tag in tags else resident[tag]), tag
    engine.resume(tags)
    for tag in tags:
        assert engine.resident_nbytes(tag) > 0, tag
    engine.load_weights(weights.items())
    assert _greedy(engine) == before


def test_unknown_tag_is_refused(setup):
    engine, _, _ = setup
    with pytest.raises(ValueError, match="optimizer"):
        engine.release(["optimizer"])
    with pytest.raises(ValueError, match="optimizer"):
        engine.resume(["optimizer"])


def test_named_parameters_are_the_live_weights(setup):
    engine, weights, _ = setup
    _ready(engine, weights)
    if not capabilities_of(engine).writes_in_place:  # optional (vLLM's CPU build repacks its weights)
        pytest.skip(f"{type(engine).__name__} does not write its weights in place here")
    params = dict(engine.named_parameters())
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(qkv[: q.shape[0]].cpu(), q)  # TP1: [q; k; v] stacked as in vLLM
