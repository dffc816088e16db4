"""VLLMEngine against a fake vllm.LLM (hybridmem.testing.fake_vllm).

These tests check hybridmem's side of the contract (which vLLM calls, in which order, with which tags
and tensors) and what the vLLM CPU backend cannot show (a sleep that frees memory, GPU-only calls); the
adapter against a real vLLM is tested in test_vllm_real.py.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmem import Direction, ShardingManager
from hybridmem.adapters.vllm import KVOnlyRelease, TagState, VLLMEngine, bucket_weights
from hybridmem.adapters.vllm.outputs import to_vllm_sampling_kwargs
from hybridmem.engines import SamplingParams
from hybridmem.errors import PhaseError, SwitchError
from hybridmem.testing.fake_vllm import (
    FakeDeviceAccelerator,
    FakeLLM,
    make_fake_vllm_module,
)
from hybridmem.testing.tiny import TinyNet, train_step
from hybridmem.weight_sync import SyncStats, WeightSync

GREEDY_N = lambda n: SamplingParams(max_tokens=n, temperature=0.0, logprobs=True)  # noqa: E731
KV_NBYTES = 1 << 16


def weights_nbytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct storage of params and buffers (the fake's "weights" pool)."""
    seen = {t.untyped_storage()._cdata: t.numel() * t.element_size()
            for t in [*model.parameters(), *model.buffers()]}
    return sum(seen.values())


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in ``vllm`` module in sys.modules (for SamplingParams and LLM)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    # "some/model" is a hub id: online, create lets it through
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    accel = FakeDeviceAccelerator()
    module = make_fake_vllm_module(lambda **kw: FakeLLM(TinyNet(), accel=accel, kv_cache_nbytes=KV_NBYTES))
    monkeypatch.setitem(sys.modules, "vllm", module)
    # The real vLLM's submodules, imported by an earlier test in this process, would answer for the stand-in
    # (vllm.platforms would say the CPU backend, which has no sleep mode): hidden for this test.
    for name in [n for n in sys.modules if n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    return module


def build(*, backend: str = "external_launcher", **engine_kwargs):
    accel = FakeDeviceAccelerator()
    torch.manual_seed(1)  # the engine starts with different weights than training
    llm = FakeLLM(TinyNet(), accel=accel, kv_cache_nbytes=KV_NBYTES, backend=backend)
    engine = VLLMEngine(llm, accel=accel, **engine_kwargs)
    return llm, engine, accel


@torch.no_grad()
def reference_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int):
    """Greedy decoding and per-token log-probs computed directly with the training model."""
    tokens, logprobs = list(prompt), []
    for _ in range(max_tokens):
        lp = torch.log_softmax(model(torch.tensor([tokens]))[0, -1].double(), -1)
        token = int(lp.argmax())
        tokens.append(token)
        logprobs.append(float(lp[token]))
    return tokens[len(prompt):], logprobs


def without_resets(calls):
    """The calls, less prefix-cache resets and the worker probe the adapter runs when it attaches."""
    return [c for c in calls if c[0] != "reset_prefix_cache" and c != ("collective_rpc", "probe_worker")]


# Lazy import ---------------------------------------------------------------------------------------
def test_importing_hybridmem_never_imports_vllm():
    code = textwrap.dedent(
        """
        import sys

        class Refuse:
            def find_spec(self, name, path=None, target=None):
                if name == "vllm" or name.startswith("vllm."):
                    raise AssertionError(f"import of {name} at hybridmem import time")
                return None

        sys.meta_path.insert(0, Refuse())
        import hybridmem, hybridmem.adapters, hybridmem.adapters.vllm
        import hybridmem.kv, hybridmem.testing.fake_vllm
        assert 'vllm-sleep' in hybridmem.kv.KV_ALLOCATORS
        assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
        print("ok")
        """
    )
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_create_without_vllm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"pip install hybridmem\[vllm\]"):
        VLLMEngine.create("Qwen/Qwen2.5-0.5B", tensor_parallel_size=1)


TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500"}


@pytest.fixture
def plain_process(monkeypatch):
    """No torchrun variables and no process group: ``python train.py``."""
    for key in [*TORCHRUN_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING"]:
        monkeypatch.delenv(key, raising=False)
    assert not torch.distributed.is_initialized()


def test_create_under_torchrun_builds_with_sleep_mode_and_external_launcher(fake_vllm, monkeypatch):
    for key, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(key, value)
    env_before = dict(os.environ)
    engine = VLLMEngine.create("some/model", tensor_parallel_size=2, gpu_memory_utilization=0.4,
                               dtype="bfloat16")
    (kwargs,) = fake_vllm.llm_kwargs
    assert kwargs == {
        "model": "some/model",
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.4,
        "enable_sleep_mode": True,
        "distributed_executor_backend": "external_launcher",
        "dtype": "bfloat16",
    }
    assert dict(os.environ) == env_before  # vLLM sets what external_launcher needs itself
    # Built released, as ShardingManager expects: one level-2 sleep, nothing resident.
    assert without_resets(engine.llm.calls) == [("sleep", 2)]
    assert engine.state("weights") is TagState.RELEASED and engine.state("kv_cache") is TagState.RELEASED


@pytest.mark.parametrize("value", [None, "1"])
def test_create_in_a_plain_process_needs_nothing_set_and_restores_what_it_sets(fake_vllm, plain_process,
                                                                                monkeypatch, value):
    if value is not None:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", value)
    env_before = dict(os.environ)
    torch.manual_seed(7)
    expected_draw = torch.rand(3)
    torch.manual_seed(7)
    VLLMEngine.create("some/model")
    (kwargs,) = fake_vllm.llm_kwargs
    assert "distributed_executor_backend" not in kwargs  # vLLM's single in-process worker
    assert fake_vllm.llm_environ[0]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # set while the LLM was built
    assert dict(os.environ) == env_before  # ... and put back
    assert torch.equal(torch.rand(3), expected_draw)  # vLLM's re-seeding did not reach the training code


def test_create_in_a_plain_process_refuses_tp_above_one_naming_torchrun(fake_vllm, plain_process):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .*torchrun --nproc-per-node 2"):
        VLLMEngine.create("some/model", tensor_parallel_size=2)
    assert fake_vllm.llm_kwargs == []  # no LLM was built


def test_create_refuses_executors_in_other_processes_before_building(fake_vllm):
    with pytest.raises(ValueError, match="distributed_executor_backend='mp'"):
        VLLMEngine.create("some/model", distributed_executor_backend="mp")
    assert fake_vllm.llm_kwargs == []


def test_create_with_a_group_initialised_without_rank_variables_sets_them_for_the_build(fake_vllm,
                                                                                         plain_process):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", world_size=1, rank=0)
    try:
        VLLMEngine.create("some/model", tensor_parallel_size=1)
        VLLMEngine.create("some/model", tensor_parallel_size=1,
                          distributed_executor_backend="external_launcher")
    finally:
        dist.destroy_process_group()
    replica, launcher = fake_vllm.llm_kwargs
    assert "distributed_executor_backend" not in replica  # TP 1 in a group: a replica per rank
    assert launcher["distributed_executor_backend"] == "external_launcher"
    assert fake_vllm.llm_environ[1]["RANK"] == "0" and fake_vllm.llm_environ[1]["LOCAL_RANK"] == "0"
    assert "RANK" not in os.environ and "LOCAL_RANK" not in os.environ


def test_create_on_npu_needs_nz_layout_off(fake_vllm, monkeypatch):
    class FakeNpu(FakeDeviceAccelerator):
        name = "npu"

    monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ", raising=False)
    with pytest.raises(ValueError, match="VLLM_ASCEND_ENABLE_NZ=0"):
        VLLMEngine.create("some/model", accel=FakeNpu())
    assert "VLLM_ASCEND_ENABLE_NZ" not in os.environ
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    engine = VLLMEngine.create("some/model", accel=FakeNpu())
    assert engine.accel.name == "npu"


def test_create_from_a_config_writes_it_and_loads_dummy_weights(fake_vllm):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    engine = VLLMEngine.create(config, distributed_executor_backend=None)  # the written config lives with it
    (kwargs,) = fake_vllm.llm_kwargs
    assert kwargs["load_format"] == "dummy" and kwargs["skip_tokenizer_init"] is True
    assert "distributed_executor_backend" not in kwargs
    saved = transformers.AutoConfig.from_pretrained(kwargs["model"])
    assert saved.hidden_size == 32 and saved.vocab_size == 64
    del engine


def test_the_config_written_for_vllm_goes_with_the_engine(fake_vllm):
    import gc
    import os

    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    engine = VLLMEngine.create(config, distributed_executor_backend=None)
    path = fake_vllm.llm_kwargs[-1]["model"]
    assert os.path.isdir(path)
    del engine
    gc.collect()
    assert not os.path.exists(path)


def test_llm_without_sleep_mode_is_refused():
    accel = FakeDeviceAccelerator()
    llm = FakeLLM(TinyNet(), accel=accel, enable_sleep_mode=False)
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        VLLMEngine(llm, accel=accel)


# A full TRAIN -> INFER -> TRAIN cycle through ShardingManager -------------------------------------------
def test_full_cycle_call_order_weights_and_generation(fake_vllm):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    llm, engine, accel = build(bucket_nbytes=8 << 10)
    assert accel.used_nbytes == 0 and engine.last_freed_nbytes == weights_nbytes(model) + KV_NBYTES
    manager = ShardingManager(model, engine, optimizer=opt)
    names = sorted(n for n, _ in [*model.named_parameters(), *model.named_buffers()])
    prompts = [[1, 2, 3], [7, 8, 9, 10]]
    for cycle in range(3):
        train_step(model, opt, cycle)
        expected = [reference_greedy(model, p, max_tokens=5) for p in prompts]
        llm.calls.clear()
        llm.worker.model.load_calls.clear()
        manager.to_infer()
        # Weights first, then the load in buckets, a prefix-cache reset, then the KV cache.
        num_buckets = engine.last_load.num_buckets
        assert num_buckets > 1, "bucket_nbytes=8 KiB must split TinyNet's 40 KiB"
        assert llm.calls == [("wake_up", ["weights"])] + [("apply_model", "load_bucket")] * num_buckets + [
            ("reset_prefix_cache",),
            ("wake_up", ["kv_cache"]),
        ]
        assert sorted(n for call in llm.worker.model.load_calls for n in call) == names
        assert engine.resident_nbytes("weights") == weights_nbytes(model)
        assert engine.resident_nbytes("kv_cache") == KV_NBYTES
        assert accel.used_nbytes == weights_nbytes(model) + KV_NBYTES
        owners = manager.residency().by_owner
        assert owners["engine weights"] == weights_nbytes(model) and owners["kv cache"] == KV_NBYTES
        outputs = engine.generate(prompts, GREEDY_N(5))
        for out, prompt, (tokens, logprobs) in zip(outputs, prompts, expected):
            assert out.prompt_ids == list(prompt) and out.token_ids == tokens
            assert out.logprobs == pytest.approx(logprobs, abs=1e-6)
        llm.calls.clear()
        manager.to_train()
        # KV release: one level-2 sleep (LLM.sleep resets the prefix cache itself); weights: no call.
        assert llm.calls == [("sleep", 2), ("reset_prefix_cache",)]
        assert accel.used_nbytes == 0 and engine.last_freed_nbytes == weights_nbytes(model) + KV_NBYTES
        assert engine.resident_nbytes("weights") == 0 and engine.resident_nbytes("kv_cache") == 0
        assert engine.planned_nbytes("weights") == weights_nbytes(model)
    assert llm.stale_prefix_hits == 0


class InPlaceSync(WeightSync):
    """Writes training tensors straight into the engine's own parameters, as ReshardSync does."""

    def __init__(self, model, engine):
        self.model, self.engine = model, engine

    def sync(self) -> SyncStats:
        dst = dict(self.engine.named_parameters())
        with torch.no_grad():
            for name, tensor in self.model.named_parameters():
                dst[name].copy_(tensor)
        return SyncStats(num_tensors=len(dst))


def test_in_place_sync_through_named_parameters(fake_vllm):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    llm, engine, _ = build()
    manager = ShardingManager(model, engine, optimizer=opt, weight_sync=InPlaceSync(model, engine))
    for cycle in range(2):
        train_step(model, opt, cycle)
        scale = model.scale.clone()  # the training model's storage is offloaded in INFER
        expected = reference_greedy(model, [2, 4, 6], 4)[0]
        llm.calls.clear()
        manager.to_infer()
        # The KV resume after an in-place write resets the prefix cache.
        assert llm.calls == [
            ("wake_up", ["weights"]),
            ("apply_model", "identity"),
            ("wake_up", ["kv_cache"]),
            ("reset_prefix_cache",),
        ]
        # Buffers are not written by the sync: vLLM's level-2 sleep saved and restored them.
        assert torch.equal(dict(llm.worker.model.named_buffers())["scale"], scale)
        assert engine.generate([[2, 4, 6]], GREEDY_N(4))[0].token_ids == expected
        manager.to_train()
    assert llm.stale_prefix_hits == 0


def test_manager_cycle_with_offload_weights_policy(fake_vllm):
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    llm, engine, accel = build(kv_only_release="offload_weights")
    manager = ShardingManager(model, engine, optimizer=opt)
    for cycle in range(2):
        train_step(model, opt, cycle)
        expected = reference_greedy(model, [5, 5], 3)[0]
        llm.calls.clear()
        with manager.inference():
            assert engine.generate([[5, 5]], GREEDY_N(3))[0].token_ids == expected
        # KV release: a level-1 sleep parks the weights on host; the weights release is bookkeeping.
        assert without_resets(llm.calls)[-2:] == [("generate", 1), ("sleep", 1)]
        assert engine.state("weights") is TagState.RELEASED and accel.used_nbytes == 0
    assert llm.stale_prefix_hits == 0


def test_plan_uses_measured_nbytes(fake_vllm):
    torch.manual_seed(0)
    model = TinyNet()
    llm, engine, _ = build()
    manager = ShardingManager(model, engine)
    assert engine.planned_nbytes("kv_cache") == 0  # unknown before the first wake-up
    manager.to_infer()
    manager.to_train()
    estimates = {s.name: s.estimate() for s in manager.steps(Direction.TO_INFER)}
    assert estimates["resume engine weights"].alloc_nbytes == weights_nbytes(model)
    assert estimates["resume engine kv_cache"].alloc_nbytes == KV_NBYTES


def loaded_engine():
    """An engine built on the fake vLLM, woken, with a seeded TinyNet's weights loaded."""
    torch.manual_seed(0)
    model = TinyNet()
    _, engine, _ = build()
    engine.resume(["weights"])
    engine.load_weights(model.named_parameters())
    engine.resume(["kv_cache"])
    return engine


def test_generate_with_seeded_sampling_maps_params(fake_vllm):
    engine = loaded_engine()
    params = SamplingParams(max_tokens=4, temperature=0.7, top_p=1.0, seed=3, logprobs=False)
    a = engine.generate([[5, 6]], params)
    b = engine.generate([[5, 6]], params)
    assert a == b and a[0].logprobs is None and len(a[0].token_ids) == 4


# Tags and levels ------------------------------------------------------------------------------------
def awake(engine, model):
    engine.resume(["weights", "kv_cache"])
    engine.load_weights([*model.named_parameters(), *model.named_buffers()])
    engine.llm.calls.clear()


def test_release_weights_alone_keeps_kv_resident():
    torch.manual_seed(0)
    model = TinyNet()
    llm, engine, accel = build()
    awake(engine, model)
    engine.release(["weights"])
    assert without_resets(llm.calls) == [("sleep", 2), ("wake_up", ["kv_cache"])]
    assert engine.state("weights") is TagState.RELEASED and engine.state("kv_cache") is TagState.RESIDENT
    assert accel.used_nbytes == KV_NBYTES


def test_kv_only_release_discard_weights_requires_a_reload(fake_vllm):
    torch.manual_seed(0)
    model = TinyNet()
    llm, engine, _ = build()
    awake(engine, model)
    engine.release(["kv_cache"])
    assert without_resets(llm.calls) == [("sleep", 2)]
    engine.resume(["weights", "kv_cache"])
    with pytest.raises(PhaseError, match="discarded"):
        engine.generate([[1, 2]])
    engine.load_weights([*model.named_parameters(), *model.named_buffers()])
    assert engine.generate([[1, 2]], GREEDY_N(3))[0].token_ids == reference_greedy(model, [1, 2], 3)[0]


def test_kv_only_release_offload_weights_parks_them_on_host(fake_vllm):
    torch.manual_seed(0)
    model = TinyNet()
    llm, engine, accel = build(kv_only_release="offload_weights")
    assert engine.kv_only_release is KVOnlyRelease.OFFLOAD_WEIGHTS
    awake(engine, model)
    before = {n: p.detach().clone() for n, p in llm.worker.model.named_parameters()}
    engine.release(["kv_cache"])
    assert without_resets(llm.calls) == [("sleep", 1)]
    assert engine.state("weights") is TagState.ON_HOST and accel.used_nbytes == 0
    with pytest.raises(PhaseError, match="resume"):
        engine.load_weights(model.named_parameters())
    engine.resume(["weights", "kv_cache"])  # restored from the host backup, no reload
    for name, p in llm.worker.model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert engine.generate([[4]], GREEDY_N(2))[0].token_ids == reference_greedy(model, [4], 2)[0]
    engine.release(["kv_cache"])
    engine.release(["weights"])  # already off the device: bookkeeping only, no vLLM call
    assert without_resets(llm.calls)[-1] == ("sleep", 1)
    assert engine.state("weights") is TagState.RELEASED


def test_offloaded_weights_survive_a_second_kv_only_release(fake_vllm):
    torch.manual_seed(0)
    model = TinyNet()
    llm, engine, accel = build(kv_only_release="offload_weights")
    awake(engine, model)
    before = {n: p.detach().clone() for n, p in llm.worker.model.named_parameters()}
    engine.release(["kv_cache"])
    engine.resume(["kv_cache"])  # weights stay on host
    engine.release(["kv_cache"])  # must wake the weights so vLLM accepts the sleep, and keep them
    assert without_resets(llm.calls) == [("sleep", 1), ("wake_up", ["kv_cache"]), ("wake_up", ["weights"]),
                                         ("sleep", 1)]
    assert engine.state("weights") is TagState.ON_HOST
    engine.resume(["weights", "kv_cache"])
    for name, p in llm.worker.model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert engine.generate([[3, 1]], GREEDY_N(2))[0].token_ids == reference_greedy(model, [3, 1], 2)[0]


def test_releasing_weights_while_kv_sleeps_wakes_kv_first():
    """Undoing resume(["weights"]) before the KV cache was resumed (a TRAIN->INFER rollback)."""
    torch.manual_seed(0)
    llm, engine, accel = build()
    llm.calls.clear()
    engine.resume(["weights"])
    engine.release(["weights"])
    assert without_resets(llm.calls) == [("wake_up", ["weights"]), ("wake_up", ["kv_cache"]), ("sleep", 2)]
    assert not llm.is_sleeping or llm.sleeping_tags == {"weights", "kv_cache"}
    assert accel.used_nbytes == 0


def test_unknown_and_malformed_tags_raise():
    llm, engine, _ = build()
    with pytest.raises(ValueError, match="'kv'"):
        engine.release(["kv"])
    with pytest.raises(ValueError, match="'activations'"):
        engine.resume(["weights", "activations"])
    with pytest.raises(TypeError, match="string"):
        engine.release("weights")
    with pytest.raises(ValueError, match="'kv'"):
        engine.resident_nbytes("kv")
    # nothing else reached vLLM
    assert llm.calls == [("collective_rpc", "probe_worker"), ("sleep", 2), ("reset_prefix_cache",)]


def fail_kv_wake_once(monkeypatch, llm):
    """The next ``wake_up(tags=["kv_cache"])`` raises an OOM; later ones go through."""
    real_wake = llm.wake_up
    failures = []

    def wake_failing_once(tags=None):
        if tags == ["kv_cache"] and not failures:
            failures.append(tags)
            raise RuntimeError("out of memory")
        real_wake(tags)

    monkeypatch.setattr(llm, "wake_up", wake_failing_once)


def test_resume_is_all_or_nothing_when_the_undo_can_wake_kv(monkeypatch):
    llm, engine, accel = build()
    fail_kv_wake_once(monkeypatch, llm)
    llm.calls.clear()
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.resume(["weights", "kv_cache"])
    assert engine.state("weights") is TagState.RELEASED and engine.state("kv_cache") is TagState.RELEASED
    assert without_resets(llm.calls) == [("wake_up", ["weights"]), ("wake_up", ["kv_cache"]), ("sleep", 2)]
    assert accel.used_nbytes == 0


def test_resume_undo_puts_host_parked_weights_back_on_host(monkeypatch, fake_vllm):
    torch.manual_seed(0)
    model = TinyNet()
    llm, engine, accel = build(kv_only_release="offload_weights")
    awake(engine, model)
    before = {n: p.detach().clone() for n, p in llm.worker.model.named_parameters()}
    engine.release(["kv_cache"])
    fail_kv_wake_once(monkeypatch, llm)
    llm.calls.clear()
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.resume(["weights", "kv_cache"])
    assert without_resets(llm.calls) == [("wake_up", ["weights"]), ("wake_up", ["kv_cache"]), ("sleep", 1)]
    assert engine.state("weights") is TagState.ON_HOST and accel.used_nbytes == 0
    engine.resume(["weights", "kv_cache"])
    for name, p in llm.worker.model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert engine.generate([[9]], GREEDY_N(2))[0].token_ids == reference_greedy(model, [9], 2)[0]


def test_resume_undo_that_cannot_wake_kv_says_so(monkeypatch):
    llm, engine, accel = build()
    real_wake = llm.wake_up

    def wake_never_kv(tags=None):
        if tags == ["kv_cache"]:
            raise RuntimeError("out of memory")
        real_wake(tags)

    monkeypatch.setattr(llm, "wake_up", wake_never_kv)
    with pytest.raises(RuntimeError, match="out of memory") as info:
        engine.resume(["weights", "kv_cache"])
    assert any("cannot put one tag back to sleep" in note for note in info.value.__notes__)
    assert engine.state("weights") is TagState.RESIDENT and engine.state("kv_cache") is TagState.RELEASED


def test_manager_rolls_back_a_failed_kv_resume(monkeypatch, fake_vllm):
    torch.manual_seed(0)
    model = TinyNet()
    snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
    llm, engine, accel = build()
    manager = ShardingManager(model, engine)
    fail_kv_wake_once(monkeypatch, llm)
    with pytest.raises(SwitchError, match="resume engine kv_cache"):
        manager.to_infer()
    assert manager.phase.name == "TRAIN" and accel.used_nbytes == 0
    for n, p in model.named_parameters():
        assert torch.equal(p, snapshot[n]), n


# Weights ---------------------------------------------------------------------------------------------
def test_named_parameters_are_the_in_process_models_own_tensors():
    llm, engine, _ = build()
    engine.resume(["weights"])
    ours = dict(engine.named_parameters())
    theirs = dict(llm.worker.model.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(ours[n] is theirs[n] for n in ours)


def test_out_of_process_engine_core_is_refused_naming_the_env_var():
    accel = FakeDeviceAccelerator()
    llm = FakeLLM(TinyNet(), accel=accel, backend="mp")
    with pytest.raises(ValueError, match="'mp'.*VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        VLLMEngine(llm, accel=accel)
    assert llm.calls == []  # refused before anything reached vLLM


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), max_size=12), limit=st.integers(4, 64))
def test_bucket_weights_partitions_in_order(sizes, limit):
    weights = [(f"w{i}", torch.zeros(n, dtype=torch.float32)) for i, n in enumerate(sizes)]
    buckets = list(bucket_weights(weights, limit))
    assert [name for b in buckets for name, _ in b] == [name for name, _ in weights]
    for b in buckets:
        nbytes = sum(t.numel() * 4 for _, t in b)
        assert b and (nbytes <= limit or len(b) == 1)
    for b, nxt in zip(buckets, buckets[1:]):  # greedy: the next tensor did not fit
        assert sum(t.numel() * 4 for _, t in b) + nxt[0][1].numel() * 4 > limit


def test_sampling_params_mapping_and_validation():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, seed=11, logprobs=True)
    kw = to_vllm_sampling_kwargs(params)
    assert kw == {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 11, "logprobs": 0}
    # Request i of a batch is seeded seed + i, as the embedded engine seeds sequence i.
    assert to_vllm_sampling_kwargs(params, 3)["seed"] == 14
    assert to_vllm_sampling_kwargs(SamplingParams(logprobs=False))["logprobs"] is None
    assert to_vllm_sampling_kwargs(SamplingParams(stop_token_ids=(2, 9)))["stop_token_ids"] == [2, 9]
    with pytest.raises(TypeError, match="lacks fields"):
        to_vllm_sampling_kwargs(object())


def test_generate_seeds_each_request_and_stops_on_stop_tokens(fake_vllm):
    engine = loaded_engine()
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, logprobs=True)
    pair = engine.generate([[5, 6], [5, 6]], params)
    # The same prompt twice in one batch: seeds 5 and 6, as ReferenceEngine seeds sequences 0 and 1.
    assert pair[0].token_ids == engine.generate([[5, 6]], params)[0].token_ids
    assert pair[1].token_ids == engine.generate([[5, 6]], SamplingParams(max_tokens=6, temperature=1.0,
                                                                         seed=6))[0].token_ids
    first = pair[0].token_ids[0]
    stopped = engine.generate([[5, 6]], SamplingParams(max_tokens=6, temperature=1.0, seed=5,
                                                       stop_token_ids=(first,)))
    assert stopped[0].token_ids == [first]


def test_generate_while_released_raises():
    _, engine, _ = build()
    with pytest.raises(PhaseError, match="not resident"):
        engine.generate([[1]])


# Post-load processing (MLA) -------------------------------------------------------------------------
@pytest.fixture
def reprocess_calls(fake_vllm, monkeypatch):
    """vLLM's process_weights_after_loading replaced by a recorder; returns the calls."""
    calls = []
    utils = types.ModuleType("vllm.model_executor.model_loader.utils")
    utils.process_weights_after_loading = lambda model, model_config, device: calls.append(
        (model, model_config, device))
    for name in ("vllm.model_executor", "vllm.model_executor.model_loader"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.model_loader.utils", utils)
    return calls


def _mla_engine(use_mla: bool, **kwargs):
    accel = FakeDeviceAccelerator()
    llm = FakeLLM(TinyNet(), accel=accel, kv_cache_nbytes=KV_NBYTES)
    model_config = llm.llm_engine.vllm_config.model_config
    model_config.use_mla = use_mla
    llm.worker.model_runner = types.SimpleNamespace(model=llm.worker.model, model_config=model_config)
    llm.worker.device = torch.device("cpu")
    return llm, VLLMEngine(llm, accel=accel, **kwargs)


def test_mla_models_reprocess_weights_once_per_update(reprocess_calls):
    llm, engine = _mla_engine(use_mla=True)
    assert engine.reprocess_after_update
    model = TinyNet()
    engine.resume(["weights"])
    engine.load_weights(model.named_parameters())
    assert len(reprocess_calls) == 1 and reprocess_calls[0][0] is llm.worker.model
    assert reprocess_calls[0][1] is llm.llm_engine.vllm_config.model_config
    engine.resume(["kv_cache"])
    engine.generate([[5, 6]], SamplingParams(max_tokens=2))
    assert len(reprocess_calls) == 1  # nothing changed since the load
    for _, p in engine.named_parameters():  # an in-place update ...
        p.data.add_(0.0)
    engine.generate([[5, 6]], SamplingParams(max_tokens=2))
    engine.generate([[5, 6]], SamplingParams(max_tokens=2))
    assert len(reprocess_calls) == 2  # ... is processed once, before the next generation


def test_other_models_do_not_reprocess_unless_asked(reprocess_calls):
    _, engine = _mla_engine(use_mla=False)
    engine.resume(["weights"])
    engine.load_weights(TinyNet().named_parameters())
    assert not engine.reprocess_after_update and reprocess_calls == []
    _, forced = _mla_engine(use_mla=False, reprocess_after_update=True)
    forced.resume(["weights"])
    forced.load_weights(TinyNet().named_parameters())
    assert len(reprocess_calls) == 1


def test_gpu_memory_utilization_must_be_the_share_vllm_was_built_with(fake_vllm):
    from hybridmem import ConfigError, HybridConfig

    model = TinyNet()
    _, engine, _ = build()  # the fake LLM reports cache_config.gpu_memory_utilization=0.5
    assert engine.gpu_memory_utilization == 0.5
    with pytest.raises(ConfigError,
                       match=r"gpu_memory_utilization=0\.4 .*expected 0\.5, the share the VLLMEngine"):
        ShardingManager(model, engine, config=HybridConfig(gpu_memory_utilization=0.4))
    ShardingManager(model, engine, config=HybridConfig(gpu_memory_utilization=0.5))


def test_weights_content_is_one_state(reprocess_calls):
    """An in-place update owes a prefix reset and a reprocess; a KV resume pays the first, the next
    generation the second; a level-2 sleep makes the weights stale until a load."""
    from hybridmem.adapters.vllm.inprocess.state import WeightsContent

    llm, engine = _mla_engine(use_mla=True)
    engine.resume(["weights"])
    engine.load_weights(TinyNet().named_parameters())
    assert engine.weights is WeightsContent.CURRENT and len(reprocess_calls) == 1
    for _, p in engine.named_parameters():
        p.data.add_(0.0)
    assert engine.weights is WeightsContent.UPDATED
    resets = sum(c == ("reset_prefix_cache",) for c in llm.calls)
    engine.resume(["kv_cache"])
    assert engine.weights is WeightsContent.REPROCESS_OWED
    assert sum(c == ("reset_prefix_cache",) for c in llm.calls) == resets + 1
    engine.generate([[5, 6]], SamplingParams(max_tokens=2))
    assert engine.weights is WeightsContent.CURRENT and len(reprocess_calls) == 2
    assert sum(c == ("reset_prefix_cache",) for c in llm.calls) == resets + 1  # not reset twice
    engine.release(["kv_cache", "weights"])
    assert engine.weights is WeightsContent.STALE
    engine.resume(["weights", "kv_cache"])
    with pytest.raises(PhaseError, match="phase STALE; the weights were discarded by a sleep"):
        engine.generate([[5, 6]], SamplingParams(max_tokens=2))


FP8_CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
QWEN3_FIELDS = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                    intermediate_size=512, vocab_size=256)


def _quantized_engine(quantization_config, quantization):
    """A VLLMEngine of a fake LLM whose model config says what vLLM's says of a Qwen3 it serves quantized:
    the checkpoint's ``quantization_config`` and vLLM's ``quantization`` (vLLM's CPU build cannot build FP8
    layers, so no real one can be made here)."""
    transformers = pytest.importorskip("transformers")
    accel = FakeDeviceAccelerator()
    llm = FakeLLM(TinyNet(), accel=accel, kv_cache_nbytes=KV_NBYTES)
    config = transformers.Qwen3Config(**QWEN3_FIELDS, num_hidden_layers=2)
    if quantization_config is not None:
        config.quantization_config = quantization_config
    model_config = llm.llm_engine.vllm_config.model_config
    model_config.hf_config, model_config.quantization = config, quantization
    return VLLMEngine(llm, accel=accel, check_names=False)


def test_an_fp8_model_is_declared_and_taken_as_its_checkpoints_tensors():
    """A block-FP8 model: the engine reports it (so the resharding sync quantizes) and is never written in
    place (vLLM's post-load processing may re-lay its weights and scales): it takes the FP8 checkpoint's
    tensors through load_weights, which reruns vLLM's processing."""
    engine = _quantized_engine(FP8_CONFIG, "fp8")
    assert engine.fp8_block == (128, 128) and engine.quantization_config == FP8_CONFIG
    assert engine.capabilities.reports_quantization and not engine.capabilities.writes_in_place
    plain = _quantized_engine(None, None)
    assert plain.fp8_block is None and plain.quantization_config is None
    assert not plain.capabilities.reports_quantization and plain.capabilities.writes_in_place


@pytest.mark.parametrize(("quantization_config", "quantization", "named"), [
    ({"quant_method": "awq", "bits": 4}, "awq", "in this process serves has quantization_config "
                                                "quant_method='awq'"),
    (dict(FP8_CONFIG, weight_block_size=[64, 64]), "fp8", r"weight_block_size=\[64, 64\]"),
    (None, "fp8", "was built with quantization='fp8' for a model whose config has no quantization_config"),
])
def test_another_quantization_is_refused_when_the_engine_is_built(quantization_config, quantization, named):
    with pytest.raises(ValueError, match=named):
        _quantized_engine(quantization_config, quantization)


def test_an_fp8_models_name_check_expects_its_block_scales():
    """The worker's parameters of an FP8 model are checked against the FP8 layout: each quantized weight
    beside its ``weight_scale_inv`` (vLLM's names, tests/reshard/test_vllm_fp8.py)."""
    transformers = pytest.importorskip("transformers")
    from hybridmem.adapters.vllm.names import engine_layout_shapes

    config = transformers.Qwen3Config(**QWEN3_FIELDS, num_hidden_layers=1)
    parallel = types.SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    plain, _ = engine_layout_shapes(config, parallel, 0)
    config.quantization_config = FP8_CONFIG
    fp8, what = engine_layout_shapes(config, parallel, 0)
    assert set(fp8) - set(plain) == {f"model.layers.0.{n}.weight_scale_inv" for n in (
        "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    assert fp8["model.layers.0.self_attn.qkv_proj.weight_scale_inv"].shape == (8, 2)  # 1024 x 256 rows, cols
    assert "in FP8 (128x128 blocks)" in what
