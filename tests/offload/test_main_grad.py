"""Megatron-style gradients: ``param.main_grad`` views into one fp32 buffer, ``param.grad`` unset."""

from __future__ import annotations

import torch

from hybridmem import ShardingManager
from hybridmem.accel import get_accelerator
from hybridmem.offload import GradOffloader
from hybridmem.offload.host_pool import HostBufferPool


def _megatron_style_module():
    """Two bf16 params whose fp32 grads live in one contiguous buffer, as Megatron's DDP lays them out."""
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.a = torch.nn.Parameter(torch.randn(8, 4).bfloat16())
    module.b = torch.nn.Parameter(torch.randn(6).bfloat16())
    buffer = torch.randn(8 * 4 + 6)
    module.a.main_grad = buffer[:32].view(8, 4)
    module.b.main_grad = buffer[32:]
    return module, buffer


def test_grad_offloader_moves_main_grad_buffers():
    module, buffer = _megatron_style_module()
    expected = buffer.clone()
    assert module.a.grad is None and module.b.grad is None
    off = GradOffloader(module, get_accelerator("cpu"), HostBufferPool(get_accelerator("cpu")))
    stats = off.offload()
    assert (stats.num_storages, stats.copied_nbytes) == (1, 38 * 4)  # one shared buffer, moved once
    assert buffer.untyped_storage().nbytes() == 0
    off.onload()
    assert torch.equal(buffer, expected)
    assert torch.equal(module.b.main_grad, expected[32:])


def test_manager_offloads_main_grad_and_brings_it_back():
    module, buffer = _megatron_style_module()
    expected = buffer.clone()
    manager = ShardingManager(module)
    report = manager.to_infer()
    assert buffer.untyped_storage().nbytes() == 0
    assert report.bytes_by_kind["grad"] == 38 * 4
    manager.to_train()
    assert torch.equal(buffer, expected)


def test_an_all_zero_main_grad_buffer_is_released_without_a_copy():
    module, buffer = _megatron_style_module()
    buffer.zero_()
    pool = HostBufferPool(get_accelerator("cpu"))
    off = GradOffloader(module, get_accelerator("cpu"), pool)
    stats = off.offload()
    assert (stats.copied_nbytes, stats.zero_nbytes) == (0, 38 * 4) and pool.held_nbytes() == 0
    assert buffer.untyped_storage().nbytes() == 0
    off.onload()
    assert torch.equal(buffer, torch.zeros(38))
