"""Decoder math of the Llama/Qwen2 family, written to match HF transformers' definitions.

Shared by the embedded inference engine and the example trainer, so both compute the same function
as ``transformers``' ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` for the same weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["rms_norm", "rope_cos_sin", "apply_rope", "swiglu"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF computes it: statistics in fp32, the weight applied in the input dtype."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``positions.shape + (head_dim,)`` for the default (unscaled) RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=positions.device)
                                / head_dim))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[..., seq, heads, head_dim]``) with ``cos/sin`` of shape ``[..., seq, head_dim]``
    (the "rotate half" convention of HF Llama/Qwen2)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return F.silu(gate) * up
