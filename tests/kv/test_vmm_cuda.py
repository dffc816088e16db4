"""The ``cuda-vmm`` allocator on a GPU: fixed addresses, CUDA graphs across resume, memory really freed."""

from __future__ import annotations

import pytest
import torch

from hybridmem.accel import get_accelerator
from hybridmem.errors import KVResumeError
from hybridmem.kv import CudaVmmKVAllocator, KVState

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not CudaVmmKVAllocator.is_available(), reason="needs a CUDA device and cuda.bindings"),
]

MIB = 1 << 20
GRAN = 2 * MIB


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.fixture
def kv():
    torch.cuda.empty_cache()
    allocator = CudaVmmKVAllocator(get_accelerator("cuda"), chunk_nbytes=64 * MIB)
    yield allocator
    allocator.close()


@pytest.mark.parametrize("num_blocks", [256, 255])
def test_data_ptr_is_identical_and_released_bytes_show_up_free(kv, num_blocks):
    block = 2 * MIB + 4096  # not a granularity multiple: the pool is rounded up
    free0 = _free()
    kv.allocate(block_nbytes=block, num_blocks=num_blocks)
    mapped = _round_up(num_blocks * block, GRAN)
    assert kv.resident_nbytes() == kv.mapping.mapped_size == mapped
    assert free0 - _free() >= mapped
    view = kv.view(torch.float32, (num_blocks, block // 4))
    ptr = view.data_ptr()
    assert ptr == kv.data_ptr
    for cycle in range(3):
        free_before = _free()
        assert kv.release() == mapped
        assert kv.state is KVState.RELEASED and kv.resident_nbytes() == 0
        free_released = _free()
        freed = free_released - free_before
        assert freed >= mapped - GRAN, f"release freed {freed / MIB:.1f} MiB of {mapped / MIB:.1f} MiB"
        kv.resume()  # maps the pool again: free memory drops from the released state
        retaken = free_released - _free()
        assert retaken >= mapped - GRAN, f"resume took {retaken / MIB:.1f} MiB of {mapped / MIB:.1f} MiB"
        assert view.data_ptr() == ptr
        assert kv.view(torch.float32, (num_blocks, block // 4)).data_ptr() == ptr
        view.fill_(cycle + 0.5)
        assert torch.equal(view, torch.full_like(view, cycle + 0.5))
    kv.close()
    assert _free() >= free0 - GRAN


def test_a_cuda_graph_captured_over_the_pool_replays_after_resume(kv):
    n = 1 << 20
    kv.allocate(block_nbytes=4 * n // 8, num_blocks=8)
    pool = kv.view(torch.float32, (n,))
    y = pool[n // 2 :]
    x = torch.randn(n // 2, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture, as torch.cuda.graphs recommends
        y.copy_(x * 2)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.copy_(x * 2)
    for cycle in range(3):
        kv.release()
        kv.resume()
        pool.zero_()
        x.copy_(torch.randn(n // 2, generator=torch.Generator().manual_seed(cycle)).cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, x * 2)
        assert torch.equal(pool[: n // 2], torch.zeros(n // 2, device="cuda"))


def test_resume_without_enough_memory_raises_and_leaves_nothing_mapped(kv):
    nbytes = 1 << 30
    kv.allocate(block_nbytes=GRAN, num_blocks=nbytes // GRAN)
    kv.release()
    free_released = _free()
    filler = torch.empty(free_released - nbytes // 2, dtype=torch.uint8, device="cuda")  # ~512 MiB stay free
    free_before = _free()
    with pytest.raises(KVResumeError, match="cuMemCreate failed with CUDA_ERROR_OUT_OF_MEMORY") as info:
        kv.resume()
    assert 0 < info.value.mapped_nbytes < nbytes
    assert kv.state is KVState.RELEASED and kv.resident_nbytes() == 0 and not kv.mapping.is_mapped
    assert abs(_free() - free_before) <= GRAN, "a failed resume left memory mapped"
    del filler
    torch.cuda.empty_cache()
    kv.resume()  # enough memory again
    assert kv.resident_nbytes() == nbytes


def test_allocate_by_utilization_fills_the_cap(kv):
    free, total = torch.cuda.mem_get_info()
    block = 64 * MIB
    util = (total - free + 3 * block + block // 2) / total  # room for 3.5 blocks
    assert kv.allocate(block_nbytes=block, utilization=util) == 3
    assert kv.resident_nbytes() == 3 * block
