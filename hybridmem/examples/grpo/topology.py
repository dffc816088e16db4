"""Process groups of a co-located actor: training TP and DP groups, inference TP groups.

Rank order follows the two conventions the resharding engine assumes (see ``hybridmem.reshard``):
training ranks are ``tp`` fastest, then ``dp`` (Megatron's default without PP); inference ranks form
replicas of ``tp`` consecutive ranks (vLLM's). Every rank creates every group in the same order, as
``torch.distributed.new_group`` requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hybridmem.accel.group import rank_and_size
from hybridmem.config import ParallelLayout

__all__ = ["Topology", "build_topology", "train_rows"]


@dataclass(frozen=True)
class Topology:
    """This rank's place in the training and inference layouts, with its groups."""

    rank: int
    world_size: int
    train: ParallelLayout
    infer: ParallelLayout
    train_tp_group: Any
    train_dp_group: Any
    infer_tp_group: Any

    @property
    def train_tp_rank(self) -> int:
        return self.rank % self.train.tp

    @property
    def train_rows(self) -> slice:
        """This rank's training share of a batch (:func:`train_rows`)."""
        return train_rows(self.rank, self.world_size, self.train.tp)

    @property
    def train_dp_rank(self) -> int:
        return self.rank // self.train.tp

    @property
    def train_dp_size(self) -> int:
        return self.world_size // self.train.tp

    @property
    def infer_replica(self) -> int:
        """Which inference replica (group of ``infer.tp`` consecutive ranks) this rank is in."""
        return self.rank // self.infer.tp

    @property
    def num_infer_replicas(self) -> int:
        return self.world_size // self.infer.tp


def train_rows(rank: int, world_size: int, train_tp: int) -> slice:
    """The rows of a batch (all replicas' rollouts, in replica order) that training rank ``rank`` trains
    on: every ``dp_size``-th from its data-parallel rank, the same for the ``train_tp`` ranks of a TP
    group."""
    return slice(rank // train_tp, None, world_size // train_tp)


def build_topology(train: ParallelLayout, infer: ParallelLayout) -> Topology:
    """Create the groups for ``train`` and ``infer`` on the initialised default group.

    Raises:
        ValueError: A layout does not fit the world size, or uses PP/EP (the example trains dense
            models with TP and DP only).
    """
    rank, world = rank_and_size()
    for side, layout in (("training", train), ("inference", infer)):
        if layout.pp != 1 or layout.ep != 1:
            raise ValueError(f"the GRPO example supports TP and DP only; {side} layout is {layout}")
        layout.data_parallel_size(world)  # raises naming the numbers
    tp_groups = [dist.new_group(list(range(s, s + train.tp))) for s in range(0, world, train.tp)]
    dp_groups = [dist.new_group(list(range(t, world, train.tp))) for t in range(train.tp)]
    infer_groups = [dist.new_group(list(range(s, s + infer.tp))) for s in range(0, world, infer.tp)]
    return Topology(
        rank=rank,
        world_size=world,
        train=train,
        infer=infer,
        train_tp_group=tp_groups[rank // train.tp],
        train_dp_group=dp_groups[rank % train.tp],
        infer_tp_group=infer_groups[rank // infer.tp],
    )
