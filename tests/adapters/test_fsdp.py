"""FSDP2 (and replicated) transformers models switched into inference TP k with ShardingManager.

World 4 on gloo, the user's code as the docs show it. Independent references: transformers' own
greedy generation on the full weights (``DTensor.full_tensor()``), the same training without switches,
vLLM shards cut by ``tests/reshard/reference.py`` and the bytes each rank lacks counted from element
ids (``tests/reshard/hf_reference.py``).
"""

from __future__ import annotations

import pytest
import torch

from hybridmem.reshard import ModelSpec
from hybridmem.testing.workers import WorkerPool

transformers = pytest.importorskip("transformers")

import _fsdp_tasks as tasks  # noqa: E402

from tests.reshard.hf_reference import fsdp_to_vllm_lacking, unfused  # noqa: E402
from tests.reshard.reference import vllm_shard  # noqa: E402

pytestmark = pytest.mark.slow

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(WORLD, timeout_s=300.0) as p:
        yield p


@pytest.fixture(scope="module")
def baselines(pool):
    """Per case, every rank's losses of 3 steps without any switch."""
    return {case: [[r["loss"] for r in rank] for rank in pool.run(tasks.train_task, case, 1, switch=False)]
            for case in ("qwen2", "llama_tied", "mistral", "phi3")}


def _spec_and_names(case: str):
    cfg_cls, model_cls, kwargs = tasks.CASES[case]
    cfg = cfg_cls(**kwargs)
    names = [n for n, _ in model_cls(cfg).named_parameters()]
    return ModelSpec.from_hf_config(cfg), names


FSDP_CASES = ([(case, k) for case in ("qwen2", "llama_tied") for k in (1, 2, 4)]
              + [("mistral", 2), ("phi3", 2)])


@pytest.mark.parametrize("case,k", FSDP_CASES, ids=[f"{c}-{k}" for c, k in FSDP_CASES])
def test_fsdp2_into_reference_engine(pool, baselines, case, k):
    results = pool.run(tasks.train_task, case, k, switch=True)
    spec, names = _spec_and_names(case)
    lacking = fsdp_to_vllm_lacking(spec, names, world=WORLD, shards=WORLD, tp=k)
    for rank, steps in enumerate(results):
        assert [s["loss"] for s in steps] == baselines[case][rank], (
            f"rank {rank}: losses differ from a run without switches")
        for i, s in enumerate(steps):
            ref = results[0][i]["ref_tokens"]
            assert s["tokens"] == ref, (
                f"{case} TP{k} rank {rank} step {i}: engine greedy differs from transformers")
            assert s["sync"]["received_nbytes"] == s["sync"]["min_received_nbytes"] == 4 * lacking[rank], (
                f"rank {rank} step {i}: received {s['sync']['received_nbytes']} B, plan minimum "
                f"{s['sync']['min_received_nbytes']} B, independent minimum {4 * lacking[rank]} B")
            assert s["unsharded_before"] > 0, "the eval forward should leave FSDP2's root unsharded"
            assert s["unsharded_infer"] == 0, f"rank {rank}: FSDP2 buffers survive into INFER"
            for kind, nbytes in s["infer_storages"].items():
                assert nbytes and not any(nbytes), (
                    f"rank {rank} step {i}: {kind} storages hold {nbytes} B in INFER")
            assert not s["leftovers"], s["leftovers"]
            assert s["restored"], f"rank {rank} step {i}: local shards, grads or optimizer state changed"


def test_replicated_model_into_reference_engine(pool):
    """A plain (non-FSDP) transformers model on every rank, TP2 engines: nothing crosses the network."""
    results = pool.run(tasks.train_task, "qwen2", 2, switch=True, fsdp=False, steps=2)
    for rank, steps in enumerate(results):
        for i, s in enumerate(steps):
            assert s["tokens"] == results[0][i]["ref_tokens"], f"rank {rank} step {i}"
            assert s["sync"]["received_nbytes"] == s["sync"]["min_received_nbytes"] == 0
            for kind, nbytes in s["infer_storages"].items():
                assert nbytes and not any(nbytes), f"rank {rank}: {kind} in INFER: {nbytes}"
            assert s["restored"]


def test_qwen3_moe_fused_experts_at_tp2(pool):
    results = pool.run(tasks.moe_task, 2)
    spec, names = _spec_and_names("qwen3_moe")
    lacking = fsdp_to_vllm_lacking(spec, names, world=WORLD, shards=WORLD, tp=2)
    assert [r[0]["local_experts"] for r in results] == [2, 2, 2, 0]  # uneven: the last rank holds no expert
    for i in range(len(results[0])):
        full = unfused(results[0][i]["full"])
        for rank, steps in enumerate(results):
            s = steps[i]
            want = vllm_shard(full, spec, tp=2, pp=1, ep=1, world=WORLD, rank=rank)
            assert sorted(s["engine"]) == sorted(want)
            for name, tensor in want.items():
                assert torch.equal(s["engine"][name], tensor), f"rank {rank} step {i}: {name}"
            assert s["sync"]["received_nbytes"] == s["sync"]["min_received_nbytes"] == 4 * lacking[rank]
            assert s["unsharded_infer"] == 0
            for kind, nbytes in s["infer_storages"].items():
                assert nbytes and not any(nbytes), f"rank {rank}: {kind} in INFER: {nbytes}"
            assert s["restored"]


def test_one_process_plain_model_with_model_spec():
    """k = 1 in one process (no torch.distributed): ``model_spec=`` reshards from HF names."""
    cfg, model = tasks.build("qwen2", fsdp=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = tasks.ReferenceEngine(cfg.to_dict())
    engine.release(["weights", "kv_cache"])
    manager = tasks.ShardingManager(model, engine, optimizer=opt, model_spec=cfg,
                                    config=tasks.HybridConfig(infer_tensor_parallel_size=1))
    for step in range(2):
        opt.zero_grad()
        x = tasks._batch(0, step)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        ref = tasks.hf_greedy("qwen2", {n: p.detach().clone() for n, p in model.named_parameters()})
        with manager.inference() as eng:
            tokens = [o.token_ids for o in eng.generate(tasks.PROMPTS, tasks.SamplingParams(
                max_tokens=tasks.MAX_TOKENS, temperature=0.0))]
            assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        assert tokens == ref, f"step {step}"


def test_the_fsdp2_model_refuses_forward_and_step_inside_inference(pool, baselines):
    for rank, r in enumerate(pool.run(tasks.misuse_task)):
        assert [what for what, _ in r["refused"]] == ["forward", "step"] * 2, rank
        assert all("INFER" in message for _, message in r["refused"]), r["refused"]
        # Nothing moved by the refused calls: training goes on as a run without switches does.
        assert r["losses"] == baselines["qwen2"][rank][:2], rank


def test_release_drops_unsharded_params_and_comm_buffers(pool):
    for rank, r in enumerate(pool.run(tasks.buffers_task)):
        assert r["after_backward"] == 0
        # The root (embedding, final norm, LM head) stays unsharded, padded, after a forward without backward.
        assert r["after_eval"] == r["root_nbytes"], (rank, r)
        assert r["with_comm"] == r["after_eval"] + 4 * (1000 + 300)
        assert r["planned"] == r["released"] == r["with_comm"], (rank, r)
        assert r["left"] == 0 and r["comm_left"] == (False, 0), (rank, r)
