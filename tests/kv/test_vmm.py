"""The ``cuda-vmm`` allocator on CPU: chunked mapping and its undo over a fake driver (CUDA:
test_vmm_cuda.py)."""

from __future__ import annotations

import pytest
from fake_vmm_driver import FakeVmmDriver
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmem.accel import CpuAccelerator
from hybridmem.errors import KVResumeError
from hybridmem.kv import KV_ALLOCATORS, CudaVmmKVAllocator, get_kv_allocator
from hybridmem.kv.vmm import VmmMapping

MIB = 1 << 20
GRAN = 2 * MIB


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# CPU: the mapping logic over a fake driver ------------------------------------------------------------
def test_cuda_vmm_is_registered_and_refuses_the_cpu_backend():
    assert KV_ALLOCATORS["cuda-vmm"] is CudaVmmKVAllocator
    assert CudaVmmKVAllocator.preserves_addresses is True
    with pytest.raises(ValueError, match=r"'cuda-vmm' does not support accelerator backend 'cpu'; "
                                         r"it supports \['cuda'\]"):
        get_kv_allocator("cuda-vmm", CpuAccelerator())


def test_map_unmap_cycles_keep_the_address_and_return_every_byte():
    drv = FakeVmmDriver(capacity_nbytes=1 << 30)
    nbytes = 100 * MIB + 3
    m = VmmMapping(drv, nbytes=nbytes, chunk_nbytes=16 * MIB)
    assert m.mapped_size == _round_up(nbytes, GRAN) == 102 * MIB
    assert m.num_chunks == 7  # six of 16 MiB and one of 6 MiB
    assert drv.reserved == {m.address: 102 * MIB} and drv.physical_nbytes == 0 and not m.is_mapped
    address = m.address
    for _ in range(3):
        m.map()
        assert m.address == address and m.resident_nbytes() == drv.physical_nbytes == 102 * MIB
        assert sorted(drv.mapped) == [address + i * 16 * MIB for i in range(7)]
        assert drv.accessible == set(drv.mapped)
        assert [n for n, _ in drv.mapped.values()] == [16 * MIB] * 6 + [6 * MIB]
        m.map()  # no-op while mapped
        assert len(drv.handles) == 7
        assert m.unmap() == 102 * MIB
        assert drv.mapped == {} and drv.handles == {} and drv.physical_nbytes == 0
        assert drv.reserved == {address: 102 * MIB}  # the range stays reserved
    m.map()
    m.free()
    assert drv.reserved == {} and drv.mapped == {} and drv.handles == {}
    m.free()  # idempotent
    with pytest.raises(RuntimeError, match="was freed"):
        m.map()


@pytest.mark.parametrize(
    ("fail_at", "step", "mapped_before_failure"),
    [
        ({"cuMemCreate": 4}, "cuMemCreate", 3),
        ({"cuMemMap": 1}, "cuMemMap", 0),
        ({"cuMemMap": 5}, "cuMemMap", 4),
        ({"cuMemSetAccess": 2}, "cuMemSetAccess", 2),  # the chunk was mapped before access failed
        ({"cuMemSetAccess": 8}, "cuMemSetAccess", 8),
    ],
)
def test_a_failed_map_undoes_everything_and_can_be_retried(fail_at, step, mapped_before_failure):
    drv = FakeVmmDriver(capacity_nbytes=1 << 30, fail_at=fail_at)
    m = VmmMapping(drv, nbytes=64 * MIB, chunk_nbytes=8 * MIB)
    with pytest.raises(KVResumeError, match=f"{step} failed") as info:
        m.map()
    assert info.value.step == step
    assert info.value.mapped_nbytes == mapped_before_failure * 8 * MIB
    assert info.value.requested_nbytes == 64 * MIB
    assert drv.mapped == {} and drv.handles == {} and drv.physical_nbytes == 0 and not m.is_mapped
    assert ("unmap", m.address) in drv.log or mapped_before_failure == 0
    m.map()  # the injected failure does not repeat
    assert m.resident_nbytes() == drv.physical_nbytes == 64 * MIB


def test_out_of_memory_halfway_leaves_nothing_mapped():
    drv = FakeVmmDriver(capacity_nbytes=40 * MIB)
    m = VmmMapping(drv, nbytes=64 * MIB, chunk_nbytes=16 * MIB)
    with pytest.raises(KVResumeError, match="CUDA_ERROR_OUT_OF_MEMORY") as info:
        m.map()
    assert info.value.mapped_nbytes == 32 * MIB and info.value.step == "cuMemCreate"
    assert drv.physical_nbytes == 0 and drv.mapped == {}
    drv.capacity_nbytes = 64 * MIB
    m.map()
    assert drv.physical_nbytes == 64 * MIB


@settings(max_examples=40, deadline=None)
@given(nbytes=st.integers(1, 1 << 32), chunk=st.integers(1, 1 << 31), gran_mib=st.sampled_from([1, 2, 32]))
def test_chunks_tile_the_range_exactly(nbytes, chunk, gran_mib):
    gran = gran_mib * MIB
    drv = FakeVmmDriver(capacity_nbytes=1 << 40, granularity=gran)
    m = VmmMapping(drv, nbytes=nbytes, chunk_nbytes=chunk)
    m.map()
    spans = sorted((a - m.address, n) for a, (n, _) in drv.mapped.items())
    assert len(spans) == m.num_chunks
    ends = 0
    for offset, n in spans:
        assert offset == ends and n % gran == 0 and n <= m.chunk_nbytes
        ends = offset + n
    assert ends == m.mapped_size == _round_up(nbytes, gran) >= nbytes
    assert m.unmap() == m.mapped_size
