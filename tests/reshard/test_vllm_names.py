"""Our vLLM layouts equal what vLLM's own model classes and weight loaders build from the same HF weights.

For each model (Llama tied, Qwen2 with q/k/v bias and fewer kv heads than TP, Qwen2-MoE, Qwen3-MoE, Mistral,
Mixtral, Phi-3, Gemma 3, GLM-4.5, gpt-oss, Llama and Granite with q/k/v/o and MLP biases,
DeepSeek-V3 with and without ``q_lora_rank``) a tiny HF checkpoint is written by transformers
(``save_pretrained``: HF's checkpoint names, per-expert tensors) with every value replaced by a distinct
random number. Four worker processes then build the model with the installed vLLM's classes
(``initialize_model`` under a ``VllmConfig``, on CPU, vLLM's tp/pp groups over gloo, no engine) for each
(tp, pp, ep), and fill it with the model's own ``load_weights`` from that checkpoint. Every rank's
named parameters, name and value (padding rows included), must equal ``shard(checkpoint,
vllm_layout(...), rank)``.

Values are read right after ``load_weights``: when a model loader loads weights it then runs
``process_weights_after_loading``, where the CPU backend repacks linear weights into its own kernel
format (and leaves the parameters empty); that step is not called here, so the parameters still hold
the layout that vLLM's weight loaders produce and that an in-place sync writes into.

The layouts follow the installed vLLM's release (``vllm.__version__``, see [Note: vLLM versions] in
:mod:`hybridmem.reshard.vllm_versions`), so the same test checks each supported release in an environment
that has it.
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridmem.config import ParallelLayout
from hybridmem.models import get_family
from hybridmem.reshard import (
    ModelSpec,
    build_plan,
    hf_layout,
    hf_source_layout,
    shard,
    vllm_layout,
)
from hybridmem.reshard.transforms import build_local
from hybridmem.reshard.vllm_versions import installed_vllm_version
from hybridmem.testing.workers import WorkerError, WorkerPool
from tests.reshard import _vllm_tasks
from tests.reshard.families import COMMON as _COMMON
from tests.reshard.families import MODELS, MULTIMODAL, distinct_values, take_checkpoint

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.slow

WORLD = 4
"""Pool size: vLLM's groups span every process, so each (tp, pp) runs as WORLD / (tp * pp) replicas."""

MODELS_CONFIG = dict(model_type="llama", **{k: v for k, v in _COMMON.items() if k != "torch_dtype"},
                     num_attention_heads=4, intermediate_size=96)
DENSE_PARALLEL = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 1), (2, 2, 1)]
MOE_PARALLEL = DENSE_PARALLEL + [(2, 1, 2), (4, 1, 4)]


def _has_experts(family: str, kw: dict) -> bool:
    """A MoE family's model, unless the family's experts are optional and the config has none (Gemma 4)."""
    traits = get_family(family)
    return traits.moe and (not traits.experts_optional or bool(kw.get("num_experts")))


CASES = [(model, tp, pp, ep) for model, (family, kw) in MODELS.items()
         for tp, pp, ep in (MOE_PARALLEL if _has_experts(family, kw) else DENSE_PARALLEL)]


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(WORLD, timeout_s=300) as p:
        yield p


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{model id: (dir, config dict, {hf name: tensor})}``: a transformers checkpoint, random values."""
    out = {}
    for model_id, (family, kw) in MODELS.items():
        mm = MULTIMODAL.get(family)
        cfg = transformers.AutoConfig.for_model(family, **{**_COMMON, **kw})
        torch.manual_seed(0)
        # A multimodal model's checkpoint: its text model's as the Hub keeps it (see MULTIMODAL), no vision
        # weights.
        text_cfg = (transformers.AutoConfig.for_model(mm["text_model_type"], **kw["text_config"]) if mm
                    else cfg)
        hf_model = transformers.AutoModelForCausalLM.from_config(text_cfg)
        path = tmp_path_factory.mktemp(model_id)
        hf_model.save_pretrained(path)
        names = take_checkpoint(path)
        if mm:
            names = {mm["checkpoint_prefix"] + n: t for n, t in names.items()}
            data = cfg.to_dict()
            data["architectures"] = [mm["architecture"]]
            data["text_config"]["model_type"] = mm["hub_text_model_type"]
            (path / "config.json").write_text(json.dumps(data))
        weights = distinct_values(names)
        if family == "deepseek_v3" and kw.get("topk_method") != "noaux_tc":
            # vLLM builds no correction bias without noaux_tc routing and its loader has nowhere to put it.
            weights = {n: t for n, t in weights.items() if not n.endswith("e_score_correction_bias")}
        safetensors_torch.save_file(weights, path / "model.safetensors")
        config = json.loads((path / "config.json").read_text())
        out[model_id] = (str(path), config, weights)
    return out


def test_layouts_follow_installed_release(pool):
    reported = pool.run(_vllm_tasks.vllm_version, world_size=1)[0]
    assert installed_vllm_version() == reported
    series = ".".join(reported.split(".")[:2])
    assert (vllm_layout(ModelSpec.from_hf_config(MODELS_CONFIG), ParallelLayout(), 1).convention.version
            == series)


_LOADED: dict = {}
"""vLLM's loaded parameters per (model, tp, pp, ep), shared by the tests of one worker."""


def _run_vllm(pool, *args):
    """``vllm_loaded_parameters`` on every rank. vLLM's own group setup over gloo (``new_group`` in
    ``initialize_model_parallel``) now and then fails to connect on a loaded 2-core machine ("Gloo
    connectFullMesh failed ... Connection closed by peer"); only that failure is tried once more, on the
    restarted pool. What the build returns is compared as before, but for a multimodal model's parameters
    that are not synced (its vision tower and projector, named in MULTIMODAL)."""
    try:
        got = pool.run(_vllm_tasks.vllm_loaded_parameters, *args, world_size=WORLD)
    except WorkerError as exc:
        if "connectFullMesh" not in str(exc):
            raise
        got = pool.run(_vllm_tasks.vllm_loaded_parameters, *args, world_size=WORLD)
    with open(f"{args[0]}/config.json") as f:
        mm = MULTIMODAL.get(json.load(f)["model_type"])
    if mm is None:
        return got
    for rank in got:
        # the multimodal class was built
        assert any(n.startswith(mm["vllm_not_synced"]) for n in rank), sorted(rank)
    return [{n: t for n, t in rank.items() if not n.startswith(mm["vllm_not_synced"])} for rank in got]


def _vllm_loaded(pool, checkpoints, model_id, tp, pp, ep):
    key = (model_id, tp, pp, ep)
    if key not in _LOADED:
        _LOADED[key] = _run_vllm(pool, checkpoints[model_id][0], tp, pp, ep)
    return _LOADED[key]


@pytest.mark.parametrize("model_id,tp,pp,ep", CASES,
                         ids=[f"{m}-tp{tp}-pp{pp}-ep{ep}" for m, tp, pp, ep in CASES])
def test_vllm_names_and_tensors(pool, checkpoints, model_id, tp, pp, ep):
    path, config, weights = checkpoints[model_id]
    spec = ModelSpec.from_hf_config(config)
    layout = vllm_layout(spec, ParallelLayout(tp=tp, pp=pp, ep=ep), WORLD)
    got = _vllm_loaded(pool, checkpoints, model_id, tp, pp, ep)
    differ = []  # every (rank, name) whose values differ, so a failure names each rank, not the first
    for rank in range(WORLD):
        ours = shard(weights, layout, rank)
        theirs = got[rank]
        assert set(ours) == set(theirs), (rank, sorted(set(ours) - set(theirs)),
                                          sorted(set(theirs) - set(ours)))
        for name, tensor in theirs.items():
            assert ours[name].shape == tensor.shape, (rank, name, ours[name].shape, tensor.shape)
            if not torch.equal(ours[name], tensor):
                differ.append((rank, name))
    assert not differ, differ


STREAM_CASES = [(model, tp, pp) for model in MODELS for tp, pp in ((1, 2), (2, 2))]


@pytest.mark.parametrize("model_id,tp,pp", STREAM_CASES,
                         ids=[f"{m}-tp{tp}-pp{pp}" for m, tp, pp in STREAM_CASES])
def test_hf_stream_of_each_stage_is_what_vllm_loads_there(pool, checkpoints, model_id, tp, pp):
    """A streaming weight sync sends each pipeline stage ``hf_layout``'s tensors of that stage: vLLM's own
    loaders accept them, and every parameter the stage builds ends up with the checkpoint's values (a
    tensor the stream lacks would keep its dummy values; one vLLM has no place for would raise)."""
    path, config, weights = checkpoints[model_id]
    layout = vllm_layout(ModelSpec.from_hf_config(config), ParallelLayout(tp=tp, pp=pp), WORLD)
    got = _run_vllm(pool, path, tp, pp, 1, True)
    for rank in range(WORLD):
        ours = shard(weights, layout, rank)
        assert set(ours) == set(got[rank]), rank
        for name, tensor in got[rank].items():
            assert torch.equal(ours[name], tensor), (rank, name)


def test_hf_stream_sends_deepseek_router_bias_only_with_noaux_tc(checkpoints):
    for model_id, want in (("deepseek-v3", True), ("deepseek-v3-no-q-lora", False)):
        _, config, _ = checkpoints[model_id]
        layout = hf_layout(ModelSpec.from_hf_config(config), ParallelLayout(pp=2), 2)
        names = {n for rank in range(2) for n in layout.tensors(rank)}
        # transformers' DeepSeek-V3 checkpoints always hold the bias on every MoE layer (layer 1 here).
        assert ("model.layers.1.mlp.gate.e_score_correction_bias" in names) is want, model_id


@pytest.mark.parametrize("model_id", list(MODELS))
def test_fsdp2_plan_receives_exactly_what_vllm_lacks(pool, checkpoints, model_id):
    """From transformers' own model of the checkpoint (``from_pretrained``, its module names), sharded as
    FSDP2 shards it (``torch.chunk`` of dim 0 over 4 ranks), into vLLM at TP 2: the source layout's tensors
    equal those chunks, and the plan receives exactly the elements of each rank's vLLM parameters (as vLLM's
    own loaders fill them) that the rank does not hold, counted by value (every checkpoint value is distinct);
    run over gloo, it writes exactly the values vLLM's loaders put there."""
    path, config, weights = checkpoints[model_id]
    spec = ModelSpec.from_hf_config(config)
    model, module, bias = _vllm_tasks.transformers_model(path)
    src = hf_source_layout(spec, WORLD, shard_size=WORLD, replicated=bias)
    dst = vllm_layout(spec, ParallelLayout(tp=2), WORLD)
    plan = build_plan(src, dst, itemsize=4)
    theirs = _vllm_loaded(pool, checkpoints, model_id, 2, 1, 1)
    for rank in range(WORLD):
        local = src.tensors(rank)
        assert sorted(local) == sorted(module), (rank, sorted(set(local) ^ set(module)))
        held = set()
        for name, t in module.items():
            mine = t if name in bias else (list(t.chunk(WORLD)) + [t[:0]] * WORLD)[rank]
            if name in bias and any(p.hf_name not in weights for p in local[name].pieces):
                continue  # DeepSeek-V3 without noaux_tc: the fixture's checkpoint drops the bias vLLM lacks
            assert torch.equal(build_local(local[name], weights, dtype=torch.float32), mine), (rank, name)
            held.update(mine.flatten().tolist())
        # Counted with multiplicity: a value vLLM holds twice on one rank (Gemma 4's keys, also its values) is
        # received twice.
        lacking = sum(1 for t in theirs[rank].values() for v in t.flatten().tolist()
                      if v != 0.0 and v not in held)
        assert plan.recv_nbytes(rank) == plan.min_recv_nbytes(rank) == 4 * lacking, (
            model_id, rank, plan.recv_nbytes(rank), 4 * lacking)
    # The plan run over gloo writes exactly what vLLM's own loaders put in each parameter.
    written = pool.run(_vllm_tasks.fsdp_chunks_through_plan, str(path), 2)
    for rank in range(WORLD):
        assert set(written[rank]) == set(theirs[rank]), rank
        for name, tensor in theirs[rank].items():
            assert torch.equal(written[rank][name], tensor), (model_id, rank, name)
