"""The KV-cache allocator contract on CPU: sizing, states, views, registry."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmem.accel import CpuAccelerator
from hybridmem.errors import KVStateError
from hybridmem.kv import (
    KV_ALLOCATORS,
    KVState,
    TorchKVAllocator,
    blocks_for_utilization,
    get_kv_allocator,
    register_kv_allocator,
)

MIB = 1 << 20


def test_registry_lists_torch_and_rejects_unknown_names_listing_the_registered_ones():
    assert KV_ALLOCATORS["torch"] is TorchKVAllocator
    assert isinstance(get_kv_allocator("torch", "cpu"), TorchKVAllocator)
    with pytest.raises(ValueError, match=r"unknown KV-cache allocator 'nope'.*'torch'"):
        get_kv_allocator("nope", "cpu")


def test_register_refuses_a_second_class_under_a_taken_name():
    class Impostor(TorchKVAllocator):
        name = "torch"

    with pytest.raises(ValueError, match="'torch' is already taken by TorchKVAllocator"):
        register_kv_allocator(Impostor)
    assert KV_ALLOCATORS["torch"] is TorchKVAllocator
    # Re-registering the same class is fine.
    assert register_kv_allocator(TorchKVAllocator) is TorchKVAllocator


def test_allocator_refuses_an_unsupported_backend():
    class CudaOnly(TorchKVAllocator):
        name = "test-cuda-only"
        backends = frozenset({"cuda"})

    with pytest.raises(ValueError,
                       match=r"'test-cuda-only' does not support accelerator backend 'cpu'.*\['cuda'\]"):
        CudaOnly(CpuAccelerator())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_nbytes": 0, "num_blocks": 1}, "block_nbytes=0"),
        ({"block_nbytes": 16}, "exactly one of num_blocks and utilization.*None.*None"),
        ({"block_nbytes": 16, "num_blocks": 2, "utilization": 0.5}, "num_blocks=2, utilization=0.5"),
        ({"block_nbytes": 16, "num_blocks": 0}, "num_blocks=0"),
        ({"block_nbytes": 16, "utilization": 1.5}, r"utilization=1.5 must be in \(0, 1\]"),
        ({"block_nbytes": 16, "utilization": 0.0}, r"utilization=0.0 must be in \(0, 1\]"),
        ({"block_nbytes": 16, "num_blocks": 1, "reserve_nbytes": -1}, "reserve_nbytes=-1"),
    ],
)
def test_allocate_names_bad_arguments(kwargs, match):
    kv = TorchKVAllocator(CpuAccelerator())
    with pytest.raises(ValueError, match=match):
        kv.allocate(**kwargs)
    assert kv.state is KVState.EMPTY and kv.nbytes == 0


def test_allocate_by_utilization_uses_the_accelerator_figures():
    capacity = 64 * MIB
    kv = TorchKVAllocator(CpuAccelerator(capacity_nbytes=capacity))
    block = 3 * 4096 + 7  # not a divisor of anything, so the floor matters
    num_blocks = kv.allocate(block_nbytes=block, utilization=0.5, reserve_nbytes=MIB)
    # The CPU backend reports nothing in use: (64 MiB * 0.5 - 0 - 1 MiB) // block.
    assert num_blocks == (capacity // 2 - MIB) // block == 2643
    assert kv.num_blocks == num_blocks and kv.block_nbytes == block
    assert kv.nbytes == kv.resident_nbytes() == kv.storage.nbytes() == num_blocks * block


def test_allocate_by_utilization_raises_with_the_figures_when_no_block_fits():
    kv = TorchKVAllocator(CpuAccelerator(capacity_nbytes=MIB))
    with pytest.raises(ValueError, match=r"no KV block fits: utilization=0.5 of free_nbytes=1048576 minus "
                                         r"reserve_nbytes=524288 leaves less than block_nbytes=1"):
        kv.allocate(block_nbytes=1, utilization=0.5, reserve_nbytes=MIB // 2)
    assert kv.state is KVState.EMPTY


@settings(max_examples=60, deadline=None)
@given(
    total=st.integers(1, 1 << 40),
    used_frac=st.floats(0, 1),
    block=st.integers(1, 1 << 24),
    util=st.floats(0.01, 1.0),
    reserve=st.integers(0, 1 << 30),
)
def test_blocks_for_utilization_is_the_largest_count_under_the_cap(total, used_frac, block, util, reserve):
    free = int(total * (1 - used_frac))
    n = blocks_for_utilization(
        total_nbytes=total, free_nbytes=free, block_nbytes=block, utilization=util, reserve_nbytes=reserve
    )
    cap = int(total * util) - (total - free) - reserve  # bytes the pool may take
    assert n * block <= cap < (n + 1) * block
    # Host memory (the CPU backend): a share of what is free.
    n = blocks_for_utilization(total_nbytes=total, free_nbytes=free, block_nbytes=block, utilization=util,
                               reserve_nbytes=reserve, host_memory=True)
    cap = int(free * util) - reserve
    assert n * block <= cap < (n + 1) * block


def test_state_errors_name_the_state():
    kv = TorchKVAllocator(CpuAccelerator())
    for op in (kv.release, kv.resume, lambda: kv.view(torch.uint8, (0,))):
        with pytest.raises(KVStateError, match="torch KV-cache allocator cannot .* in state EMPTY") as info:
            op()
        assert info.value.state is KVState.EMPTY
    kv.allocate(block_nbytes=8, num_blocks=2)
    with pytest.raises(KVStateError, match="cannot allocate in state ALLOCATED"):
        kv.allocate(block_nbytes=8, num_blocks=2)
    kv.release()
    with pytest.raises(KVStateError, match="cannot allocate in state RELEASED"):
        kv.allocate(block_nbytes=8, num_blocks=2)


def test_repeated_release_and_resume_are_no_ops():
    kv = TorchKVAllocator(CpuAccelerator())
    kv.allocate(block_nbytes=64, num_blocks=3)
    kv.resume()  # already allocated
    assert kv.state is KVState.ALLOCATED and kv.resident_nbytes() == 192
    assert kv.release() == 192
    assert kv.release() == 0
    assert kv.state is KVState.RELEASED and kv.resident_nbytes() == 0


def test_view_size_mismatch_names_both_sizes():
    kv = TorchKVAllocator(CpuAccelerator())
    kv.allocate(block_nbytes=32, num_blocks=4)
    with pytest.raises(ValueError,
                       match=r"covers 256 bytes \(128 x 2\), but the pool has nbytes=128 \(4 blocks x 32\)"):
        kv.view(torch.float16, (4, 32))
    assert kv.view(torch.float16, (4, 16)).shape == (4, 16)
    assert kv.view(torch.float64, (16,)).numel() == 16
