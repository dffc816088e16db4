"""The trainer ranks that serve one vLLM engine in its own process: one per worker rank, in order.

Rank 0 of them makes the control calls; the others agree with it over ``group`` within a deadline (see
[Note: vllm server switch] in :mod:`hybridmem.adapters.vllm.server.engine`).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch
import torch.distributed as dist

from hybridmem.accel import Accelerator
from hybridmem.accel.group import rank_and_size
from hybridmem.reshard.deadline import deadline_bound, wait_all

__all__ = ["EngineRanks", "engine_ranks"]


def engine_ranks(group: Any) -> tuple[int, int]:
    """This process's rank in ``group`` and its size; ``group=None`` is this process alone, also where
    torch.distributed is initialised (an engine with one worker, served by each rank on its own)."""
    return (0, 1) if group is None else rank_and_size(group)


class EngineRanks:
    """The ranks of ``group`` serving one engine (``None``: this process alone).

    Args:
        group: The trainer ranks, one per worker rank in order.
        accel: Where a flag travels when the group's backend is not gloo.
        timeout_s: The default deadline of an agreement.
    """

    def __init__(self, group: Any, *, accel: Accelerator, timeout_s: float):
        self.group = group
        self.accel = accel
        self.timeout_s = float(timeout_s)
        self.rank, self.size = engine_ranks(group)

    def shared_directory(self, parent: str) -> str:
        """One new directory under ``parent`` for every rank (rank 0 names it; the first rank there makes
        it)."""
        name = [os.path.join(parent, f"hybridmem-{uuid.uuid4().hex[:12]}")] if self.rank == 0 else [None]
        if self.size > 1:
            dist.broadcast_object_list(name, src=dist.get_global_rank(self.group, 0) if self.group else 0,
                                       group=self.group)
        os.makedirs(name[0], exist_ok=True)  # on every rank: another rank's files may come before rank 0's
        return str(name[0])

    def gather(self, value: Any, *, what: str) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order, on every rank."""
        if self.size == 1:
            return [value]
        out: list[Any] = [None] * self.size
        try:
            dist.all_gather_object(out, value, group=self.group)
        except RuntimeError as exc:
            raise RuntimeError(f"rank {self.rank}: gathering {what} failed ({exc})") from exc
        return out

    def barrier(self, what: str) -> None:
        """Wait for every rank to get here, within :attr:`timeout_s`."""
        if self.size > 1:
            self.broadcast_flag(1.0, what=what, reduce=True)

    def broadcast_flag(self, value: float, *, what: str = "the update's outcome", reduce: bool = False,
                       deadline_s: float | None = None) -> float:
        """Rank 0's ``value`` on every rank (``reduce``: the minimum over the ranks), within ``deadline_s``
        (default: :attr:`timeout_s`)."""
        if self.size == 1:
            return value
        device = torch.device("cpu") if dist.get_backend(self.group) == "gloo" else self.accel.device
        flag = torch.tensor([value], dtype=torch.float32, device=device)
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        work = (dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True) if reduce
                else dist.broadcast(flag, src=src, group=self.group, async_op=True))
        deadline = deadline_bound(self.timeout_s if deadline_s is None else deadline_s)
        wait_all([(work, tuple(range(self.size)))], deadline, f"rank {self.rank}: {what}")
        return float(flag.item())
