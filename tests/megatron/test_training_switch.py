"""Real Megatron-core training on CPU with a TRAIN<->INFER switch after every step.

Each configuration trains twice from the same seed, once with ``to_infer()``/``to_train()`` after every
optimizer step and once without; the losses must be identical, every DDP buffer and optimizer storage
must be 0 bytes inside INFER, and buffers and optimizer state must round-trip bitwise.
"""

from __future__ import annotations

import _megatron_tasks as tasks
import pytest

from hybridmem.testing.megatron_models import TinyGPTSpec

pytestmark = pytest.mark.megatron

NUM_STEPS = 3

# Ordered by world size so the pool fixture starts each size once.
CONFIGS = {
    # name: (spec, world_size[, options of train_with_switches])
    "tp2-fp32": (TinyGPTSpec(tp=2), 2),
    "tp2-fp32-engine-zerograds": (TinyGPTSpec(tp=2), 2, {"use_engine": True, "zero_grads": True}),
    "ep2-moe-distopt": (
        TinyGPTSpec(ep=2, num_moe_experts=4, moe_ffn_hidden_size=32, use_distributed_optimizer=True), 2),
    "tp2xpp2-bf16-distopt": (
        TinyGPTSpec(tp=2, pp=2, num_layers=4, precision="bf16", use_distributed_optimizer=True), 4),
    "tp2xdp2-fp16-distopt": (TinyGPTSpec(tp=2, precision="fp16", use_distributed_optimizer=True), 4),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def runs(request, megatron_pools):
    spec, world, *rest = CONFIGS[request.param]
    options = rest[0] if rest else {}
    pool = megatron_pools.get(world)
    switched = pool.run(tasks.train_with_switches, spec, NUM_STEPS, True, **options)
    plain = pool.run(tasks.train_with_switches, spec, NUM_STEPS, False, **options)
    return request.param, spec, switched, plain, options


def test_losses_equal_with_and_without_switches(runs):
    name, _, switched, plain, _ = runs
    for rank, (a, b) in enumerate(zip(switched, plain)):
        assert a["losses"] == b["losses"], f"{name} rank {rank}: {a['losses']} != {b['losses']}"
    # Training really happened: the loss moved.
    assert switched[0]["losses"][0] != switched[0]["losses"][-1]


def test_everything_is_zero_bytes_inside_infer(runs):
    name, _, switched, _, options = runs
    for rank, out in enumerate(switched):
        for step, checks in enumerate(out["infer"]):
            where = f"{name} rank {rank} step {step}"
            assert checks["phase"] == "INFER", where
            assert checks["num_buffers"] >= 1, where
            assert all(p == 0 and g == 0 for p, g in checks["buffer_storage_nbytes"]), (where, checks)
            assert checks["max_param_storage_nbytes"] == 0, where
            assert checks["num_optimizer_tensors"] > 0, where
            assert checks["max_optimizer_storage_nbytes"] == 0, where
            assert checks["leftovers"] == {}, (where, checks["residency_by_owner"])
            training_owners = ("train param", "train grad", "optimizer", tasks.WORKSPACE_OWNER)
            assert ({o: checks["residency_by_owner"][o] for o in training_owners}
                    == dict.fromkeys(training_owners, 0)), (where, checks["residency_by_owner"])


def test_offload_moves_the_bytes_the_buffers_hold(runs):
    name, _, switched, _, options = runs
    for rank, out in enumerate(switched):
        for step, (expected, report) in enumerate(zip(out["expected"], out["reports"])):
            where = f"{name} rank {rank} step {step}"
            copied, zero, _ = report["offload param"]
            assert copied + zero == expected["train param"] and zero == 0, (where, report, expected)
            copied, zero, _ = report["offload grad"]
            if options.get("zero_grads"):
                # All-zero grad buffers are released without a copy (and re-zeroed on onload).
                assert copied == 0 and zero == expected["train grad"] > 0, (where, report, expected)
            else:
                # Grads are live after the step (not zeroed yet): copied, not skipped.
                assert copied + zero == expected["train grad"] and copied > 0, (where, report, expected)
            copied, zero, _ = report["offload optimizer"]
            assert copied == expected["optimizer"] > 0 and zero == 0, (where, report, expected)
            released = report["release megatron workspaces"][2]["released_nbytes"]
            # Megatron's own scratch tensors plus the probe; all of it dropped.
            assert released == out["workspace_before"][step] >= tasks.WORKSPACE_PROBE_NUMEL * 4, (
                where, released)


def test_round_trip_is_bitwise(runs):
    name, _, switched, _, options = runs
    for rank, out in enumerate(switched):
        assert out["round_trip_diffs"] == [[]] * NUM_STEPS, f"{name} rank {rank}: {out['round_trip_diffs']}"
        assert out["same_param_objects"], f"{name} rank {rank}: parameter objects were replaced"


def test_optimizer_kinds(runs):
    name, spec, switched, _, _ = runs
    leaves = switched[0]["leaf_optimizers"]
    if spec.use_distributed_optimizer:
        assert set(leaves) == {"DistributedOptimizer"}, (name, leaves)
    elif spec.precision == "fp32":
        assert set(leaves) == {"FP32Optimizer"}, (name, leaves)
    if spec.num_moe_experts:
        assert len(leaves) == 2, (name, leaves)  # dense + expert optimizer in a ChainedOptimizer


def test_engine_receives_the_training_weights_by_megatron_name(runs):
    name, _, switched, _, options = runs
    if not options.get("use_engine"):
        pytest.skip("configuration without an engine")
    for rank, out in enumerate(switched):
        for step, checks in enumerate(out["infer"]):
            assert checks["engine_diffs"] == [], f"{name} rank {rank} step {step}: {checks['engine_diffs']}"
            assert checks["residency_by_owner"]["engine weights"] > 0, (name, rank, step)
