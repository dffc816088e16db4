"""Module-level tasks for test_ray_group.py, run in Ray worker actors (importable there by reference)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from hybridmem.errors import ConfigError


def environment(ctx) -> dict:
    """What torchrun's variables read in the actor, and a sum over the process group."""
    total = torch.tensor([float(ctx.rank)])
    dist.all_reduce(total)
    return {key: os.environ.get(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                  "MASTER_ADDR", "MASTER_PORT")} | {
        "sum": float(total), "dist_rank": dist.get_rank(), "dist_world": dist.get_world_size(),
        "backend": dist.get_backend(), "pid": os.getpid()}


def raise_on(ctx, rank: int) -> int:
    """Rank ``rank`` raises hybridmem's ConfigError (a keyword-only constructor); the others return their
    rank."""
    if ctx.rank == rank:
        raise ConfigError("offload_train_param", "maybe", "true or false")
    return ctx.rank
