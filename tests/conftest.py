"""Shared fixtures. Tests mirror the package; CUDA tests skip cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch

from hybridmem.testing.tiny import TinyNet

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, requires_cuda])])
def device(request) -> str:
    """Each test using it runs on CPU always and on CUDA when a GPU is present."""
    return request.param


@pytest.fixture
def tiny_setup():
    """Factory: ``(model, optimizer)`` for an optimizer name ("adamw" or "sgd") on a device."""

    def build(device: str = "cpu", optimizer: str = "adamw", seed: int = 0):
        torch.manual_seed(seed)
        model = TinyNet().to(device)
        if optimizer == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        elif optimizer == "sgd":
            opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        else:
            raise ValueError(f"optimizer={optimizer!r}")
        return model, opt

    return build
