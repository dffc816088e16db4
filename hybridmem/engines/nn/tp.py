"""Tensor-parallel collectives as autograd functions (Megatron's column/row-parallel pattern).

- :func:`copy_to_group`: identity forward, all-reduce of the gradient backward (input of a
  column-parallel layer).
- :func:`reduce_from_group`: all-reduce forward, identity backward (output of a row-parallel layer).
- :func:`gather_last_dim`: all-gather along the last dim forward, take this rank's slice backward.
- :func:`vocab_parallel_embedding`: look up the rows this rank holds, zero the others, all-reduce.

With ``group`` of size 1 every function is the identity, so the same model code runs without TP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridmem.accel.group import rank_and_size

__all__ = ["group_size", "group_rank", "copy_to_group", "reduce_from_group", "gather_last_dim",
           "vocab_parallel_embedding"]


def group_size(group: Any) -> int:
    """Size of ``group`` (1 without ``torch.distributed``)."""
    return rank_and_size(group)[1]


def group_rank(group: Any) -> int:
    """This process's rank in ``group`` (0 without ``torch.distributed``)."""
    return rank_and_size(group)[0]


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _gather_last(x: torch.Tensor, group: Any) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):  # type: ignore[override]
        ctx.group = group
        ctx.width = x.shape[-1]
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        rank = group_rank(ctx.group)
        return grad[..., rank * ctx.width:(rank + 1) * ctx.width].contiguous(), None


def copy_to_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity forward; gradients are summed over ``group`` backward."""
    return x if group_size(group) == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over ``group`` forward; identity backward."""
    return x if group_size(group) == 1 else _ReduceFromGroup.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate every rank's ``x`` along the last dim (rank order)."""
    return x if group_size(group) == 1 else _GatherLastDim.apply(x, group)


def vocab_parallel_embedding(tokens: torch.Tensor, weight: torch.Tensor, group: Any) -> torch.Tensor:
    """Embedding whose rows are split evenly over ``group``: rank ``r`` holds rows
    ``[r * n, (r + 1) * n)`` with ``n = weight.shape[0]``."""
    if group_size(group) == 1:
        return F.embedding(tokens, weight)
    start = group_rank(group) * weight.shape[0]
    local = tokens - start
    outside = (local < 0) | (local >= weight.shape[0])
    out = F.embedding(local.masked_fill(outside, 0), weight)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return reduce_from_group(out, group)
