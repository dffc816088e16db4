"""The CPU harness maps Megatron's CUDA calls to the CPU inside the block and restores them after."""

from __future__ import annotations

import pytest
import torch

from hybridmem.testing.megatron_cpu import megatron_on_cpu

pytestmark = pytest.mark.megatron


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour of torch.cuda")
def test_patches_apply_inside_and_are_restored():
    from megatron.core.tensor_parallel import random as mrandom

    before = (torch.cuda.current_device, torch.cuda.Stream, mrandom._get_cuda_rng_state)
    with megatron_on_cpu():
        t = torch.zeros(3, device=torch.cuda.current_device())
        assert t.device.type == "cpu"
        assert torch.ones(2, device="cuda").cuda().pin_memory().device.type == "cpu"
        assert t.type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        # [Note: CUDA RNG on CPU] in :mod:`hybridmem.testing.megatron_cpu`: the "CUDA" generator is the CPU
        # default one.
        torch.cuda.manual_seed(7)
        state = torch.cuda.get_rng_state()
        a = torch.rand(4)
        mrandom._set_cuda_rng_state(state)
        assert torch.equal(torch.rand(4), a)
        with torch.cuda.stream(torch.cuda.Stream()):
            torch.cuda.current_stream().wait_stream(torch.cuda.Stream())
    assert (torch.cuda.current_device, torch.cuda.Stream, mrandom._get_cuda_rng_state) == before
    assert torch.zeros(1).type() == "torch.FloatTensor"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


def test_restored_after_an_exception():
    saved = torch.cuda.synchronize
    with pytest.raises(ValueError, match="boom"):
        with megatron_on_cpu():
            raise ValueError("boom")
    assert torch.cuda.synchronize is saved
