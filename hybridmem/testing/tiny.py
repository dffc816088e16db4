"""A tiny model and helpers to snapshot and compare training state bit for bit (tests, benchmarks)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["TinyNet", "make_batch", "train_step", "snapshot", "assert_bitwise_equal"]


class TinyNet(torch.nn.Module):
    """A small model with what offloading must handle: a buffer, a tied weight, a norm."""

    def __init__(self, dim: int = 32, vocab: int = 50):
        super().__init__()
        self.vocab = vocab
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage, two names
        self.register_buffer("scale", torch.full((dim,), 0.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(tokens)) * self.scale
        h = h + self.fc2(torch.nn.functional.gelu(self.fc1(h)))
        return self.head(h)


def make_batch(step: int, device: Any, vocab: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic next-token batch for ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (4, 12), generator=g)
    return tokens.to(device), tokens.roll(-1, dims=1).to(device)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    """One optimizer step on :func:`make_batch`; returns the loss."""
    device = next(model.parameters()).device
    tokens, targets = make_batch(step, device, getattr(model, "vocab", 50))
    opt.zero_grad(set_to_none=False)
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    opt.step()
    return loss.item()


def snapshot(model: torch.nn.Module, opt: Any = None) -> dict[str, torch.Tensor]:
    """Clones of every param, buffer, grad and optimizer-state tensor, by a stable name."""
    out = {f"param:{k}": v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    for name, p in model.named_parameters():
        if p.grad is not None:
            out[f"grad:{name}"] = p.grad.clone()
    if opt is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for p, state in opt.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"opt:{names[id(p)]}:{key}"] = value.clone()
    return out


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Every tensor in ``a`` equals the one of the same name in ``b``, byte for byte."""
    assert a.keys() == b.keys(), f"different tensors: {sorted(a.keys() ^ b.keys())}"
    for key in a:
        x, y = a[key], b[key]
        assert x.dtype == y.dtype and x.shape == y.shape, (
            f"{key}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
        # Bytes, not values: -0.0 vs 0.0 and NaN payloads must survive too.
        xb = x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        yb = y.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(xb, yb), f"{key} differs"
