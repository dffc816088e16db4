"""The vllm-sleep KV allocator against a fake vllm.LLM (hybridmem.testing.fake_vllm).

Fake-based: these tests check hybridmem's side of the contract (calls, tags, byte accounting) only.
"""

from __future__ import annotations

import pytest
import torch

from hybridmem.accel import CpuAccelerator
from hybridmem.adapters.vllm import TagState, VLLMEngine
from hybridmem.errors import KVStateError
from hybridmem.kv import KVState, get_kv_allocator
from hybridmem.kv.vllm_sleep import VLLMSleepKVAllocator
from hybridmem.testing.fake_vllm import FakeDeviceAccelerator, FakeLLM
from hybridmem.testing.tiny import TinyNet

BLOCK_NBYTES = 2048
NUM_BLOCKS = 24
KV_NBYTES = BLOCK_NBYTES * NUM_BLOCKS


def weights_nbytes(model: torch.nn.Module) -> int:
    seen = {t.untyped_storage()._cdata: t.numel() * t.element_size()
            for t in [*model.parameters(), *model.buffers()]}
    return sum(seen.values())


class FakeCuda(FakeDeviceAccelerator):
    """The fake device, named as the backend vLLM's sleep mode runs on."""

    name = "cuda"


@pytest.fixture
def setup():
    accel = FakeCuda()
    llm = FakeLLM(TinyNet(), accel=accel, kv_cache_nbytes=KV_NBYTES, kv_block_nbytes=BLOCK_NBYTES,
                  gpu_memory_utilization=0.6)
    engine = VLLMEngine(llm, accel=accel, kv_only_release="offload_weights")
    engine.resume(["weights", "kv_cache"])  # as after TRAIN->INFER
    llm.calls.clear()
    kv = get_kv_allocator("vllm-sleep", accel, engine=engine)
    return accel, llm, engine, kv


def test_registered_with_capabilities(setup):
    *_, kv = setup
    assert isinstance(kv, VLLMSleepKVAllocator)
    assert kv.name == "vllm-sleep" and kv.preserves_addresses and set(kv.backends) == {"cuda", "npu"}


def test_refuses_the_cpu_backend(setup):
    *_, engine, _ = setup
    with pytest.raises(ValueError, match="'cpu'"):
        get_kv_allocator("vllm-sleep", CpuAccelerator(), engine=engine)


def test_allocate_records_vllms_pool(setup):
    accel, llm, engine, kv = setup
    assert kv.allocate(block_nbytes=BLOCK_NBYTES) == NUM_BLOCKS
    assert kv.nbytes == KV_NBYTES and kv.state is KVState.ALLOCATED
    assert kv.resident_nbytes() == KV_NBYTES  # measured by the engine's wake-up
    assert llm.calls == []  # nothing allocated, nothing called
    with pytest.raises(KVStateError, match="allocate"):
        kv.allocate(block_nbytes=BLOCK_NBYTES)


def test_allocate_accepts_matching_checks(setup):
    *_, kv = setup
    assert kv.allocate(block_nbytes=BLOCK_NBYTES, num_blocks=NUM_BLOCKS, utilization=0.6) == NUM_BLOCKS


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_blocks": NUM_BLOCKS + 1}, f"num_blocks={NUM_BLOCKS + 1} but vLLM built {NUM_BLOCKS}"),
        ({"utilization": 0.9}, "utilization=0.9 but .*gpu_memory_utilization=0.6"),
        ({"reserve_nbytes": 1}, "reserve_nbytes=1"),
        ({"block_nbytes": 0}, "block_nbytes=0 must be"),
    ],
)
def test_allocate_refuses_what_vllm_did_not_build(setup, kwargs, match):
    *_, kv = setup
    with pytest.raises(ValueError, match=match):
        kv.allocate(**{"block_nbytes": BLOCK_NBYTES, **kwargs})


def test_release_and_resume_go_through_sleep_and_wake_up(setup):
    accel, llm, engine, kv = setup
    model_nbytes = weights_nbytes(llm.worker.model)
    kv.allocate(block_nbytes=BLOCK_NBYTES)
    for _ in range(3):
        freed = kv.release()
        # vLLM cannot release the KV pool alone: the level-1 sleep also parks the weights on host.
        assert freed == KV_NBYTES + model_nbytes
        assert kv.state is KVState.RELEASED and kv.resident_nbytes() == 0
        assert engine.state("weights") is TagState.ON_HOST
        assert kv.release() == 0  # twice: no-op
        kv.resume()
        assert kv.state is KVState.ALLOCATED and kv.resident_nbytes() == KV_NBYTES
        engine.resume(["weights"])
        assert accel.used_nbytes == KV_NBYTES + model_nbytes
    calls = [c for c in llm.calls if c[0] != "reset_prefix_cache"]
    assert calls == [("sleep", 1), ("wake_up", ["kv_cache"]), ("wake_up", ["weights"])] * 3


def test_view_is_not_available(setup):
    *_, kv = setup
    kv.allocate(block_nbytes=BLOCK_NBYTES)
    with pytest.raises(NotImplementedError, match="vLLM owns its KV tensors"):
        kv.view(torch.bfloat16, (NUM_BLOCKS, 1024))


def test_release_before_allocate_and_after_close_raise(setup):
    accel, llm, engine, kv = setup
    with pytest.raises(KVStateError, match="release"):
        kv.release()
    kv.allocate(block_nbytes=BLOCK_NBYTES)
    kv.close()
    assert kv.state is KVState.EMPTY and kv.nbytes == 0
    assert engine.state("kv_cache") is TagState.RESIDENT  # vLLM still owns its pool
    with pytest.raises(KVStateError, match="resume"):
        kv.resume()


def test_needs_an_engine():
    with pytest.raises(TypeError, match="VLLMEngine"):
        VLLMSleepKVAllocator(FakeCuda(), engine=object())
