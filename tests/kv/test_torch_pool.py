"""The ``torch`` KV-cache allocator: bytes really given back, views surviving release/resume."""

from __future__ import annotations

import pytest
import torch

from hybridmem.accel import get_accelerator
from hybridmem.errors import KVResumeError
from hybridmem.kv import KVState, TorchKVAllocator, get_kv_allocator

MIB = 1 << 20


def test_release_gives_back_exactly_the_pool_and_resume_restores_it(device):
    kv = get_kv_allocator("torch", device)
    assert kv.preserves_addresses is False
    num_blocks, block = 37, 16 * 1024 + 64
    assert kv.allocate(block_nbytes=block, num_blocks=num_blocks) == num_blocks
    assert kv.state is KVState.ALLOCATED
    assert kv.storage.nbytes() == kv.nbytes == kv.resident_nbytes() == num_blocks * block
    assert kv.storage.device.type == torch.device(device).type
    for _ in range(3):
        assert kv.release() == num_blocks * block
        assert kv.state is KVState.RELEASED
        assert kv.storage.nbytes() == 0 and kv.resident_nbytes() == 0
        kv.resume()
        assert kv.state is KVState.ALLOCATED
        assert kv.storage.nbytes() == kv.resident_nbytes() == num_blocks * block
    kv.close()
    assert kv.state is KVState.EMPTY and kv.nbytes == 0 and kv.resident_nbytes() == 0
    kv.close()  # idempotent


def test_views_are_the_same_objects_and_writable_after_resume(device):
    kv = get_kv_allocator("torch", device)
    num_blocks, block_size, num_heads, head_dim = 8, 4, 2, 16
    block_nbytes = 2 * block_size * num_heads * head_dim * 2  # K and V, bf16
    kv.allocate(block_nbytes=block_nbytes, num_blocks=num_blocks)
    cache = kv.view(torch.bfloat16, (2, num_blocks, block_size, num_heads, head_dim))
    flat = kv.view(torch.int16, (num_blocks * block_nbytes // 2,))
    keys, values = cache[0], cache[1]
    held = [cache, flat, keys, values]
    ids = [id(t) for t in held]
    for cycle in range(3):
        kv.release()
        assert all(t.untyped_storage().nbytes() == 0 for t in held)
        kv.resume()
        assert [id(t) for t in held] == ids
        assert all(t.untyped_storage().nbytes() == kv.nbytes for t in held)
        ref_k = torch.randn(keys.shape, generator=torch.Generator().manual_seed(cycle)).to(torch.bfloat16)
        keys.copy_(ref_k.to(device))
        values.fill_(cycle + 1)
        assert torch.equal(cache[0].cpu(), ref_k)
        assert torch.equal(cache[1].cpu(), torch.full(values.shape, cycle + 1, dtype=torch.bfloat16))
        # All views alias the one pool: the int16 view sees the bf16 bits written through ``cache``.
        assert torch.equal(flat.cpu(), cache.cpu().flatten().view(torch.int16))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_release_on_cuda_shows_up_in_mem_get_info():
    accel = get_accelerator("cuda")
    torch.cuda.empty_cache()
    kv = TorchKVAllocator(accel)
    nbytes = 512 * MIB
    free0 = torch.cuda.mem_get_info()[0]
    kv.allocate(block_nbytes=2 * MIB, num_blocks=nbytes // (2 * MIB))
    taken = free0 - torch.cuda.mem_get_info()[0]
    assert taken >= nbytes, f"allocate took only {taken / MIB:.1f} MiB of {nbytes / MIB:.0f} MiB"
    for _ in range(3):
        free_before = torch.cuda.mem_get_info()[0]
        assert kv.release() == nbytes
        free_released = torch.cuda.mem_get_info()[0]
        freed = free_released - free_before
        assert freed >= nbytes, f"release freed only {freed / MIB:.1f} MiB of {nbytes / MIB:.0f} MiB"
        kv.resume()  # takes the pool back from the device: free memory drops from the released state
        retaken = free_released - torch.cuda.mem_get_info()[0]
        assert retaken >= nbytes, f"resume took only {retaken / MIB:.1f} MiB of {nbytes / MIB:.0f} MiB"
    kv.close()
    assert torch.cuda.mem_get_info()[0] >= free0 - 2 * MIB


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_allocate_by_utilization_on_cuda_matches_mem_get_info():
    torch.cuda.empty_cache()
    kv = TorchKVAllocator(get_accelerator("cuda"))
    free, total = torch.cuda.mem_get_info()
    block = 64 * MIB
    util = (total - free + 4 * block + block // 2) / total  # room for exactly 4.5 blocks
    assert kv.allocate(block_nbytes=block, utilization=util) == 4
    kv.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_resume_without_enough_memory_on_cuda_raises_and_stays_released():
    torch.cuda.empty_cache()
    kv = TorchKVAllocator(get_accelerator("cuda"))
    nbytes = 1 << 30
    kv.allocate(block_nbytes=2 * MIB, num_blocks=nbytes // (2 * MIB))
    kv.release()
    filler = torch.empty(torch.cuda.mem_get_info()[0] - nbytes // 2, dtype=torch.uint8, device="cuda")
    with pytest.raises(KVResumeError, match="resuming the torch KV pool of 1073741824 bytes"):
        kv.resume()
    assert kv.state is KVState.RELEASED and kv.storage.nbytes() == 0
    del filler
    torch.cuda.empty_cache()
    kv.resume()
    assert kv.storage.nbytes() == nbytes
    kv.close()


def test_a_failed_resume_raises_kv_resume_error_and_stays_released(monkeypatch):
    kv = get_kv_allocator("torch", "cpu")
    kv.allocate(block_nbytes=4096, num_blocks=4)
    view = kv.view(torch.int32, (4096,))
    kv.release()
    real_resize = torch.UntypedStorage.resize_

    def failing_resize(storage, nbytes):
        if nbytes > 0:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory (injected)")
        return real_resize(storage, nbytes)

    monkeypatch.setattr(torch.UntypedStorage, "resize_", failing_resize)
    with pytest.raises(KVResumeError, match=r"16384 bytes on cpu failed: .*injected") as info:
        kv.resume()
    assert info.value.requested_nbytes == 16384 and info.value.mapped_nbytes == 0
    assert kv.state is KVState.RELEASED and kv.storage.nbytes() == 0 and kv.resident_nbytes() == 0
    monkeypatch.undo()
    kv.resume()
    view.fill_(7)
    assert torch.equal(view, torch.full((4096,), 7, dtype=torch.int32))
