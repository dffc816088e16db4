"""One outcome per switch: the ranks of a multi-rank TRAIN->INFER switch agree whether it committed.

[Note: switch agreement]
Each rank runs its own steps of a switch and rolls back on its own when one fails. Without more, a rank
that fails after its last part in the weight sync (at the sync's last wait, or in a later step such as
resuming its KV cache) rolls back alone while its peers reach INFER: nothing is lost, but the job is
split, and its next collective hangs. So a switch whose weight sync spans several ranks ends with a vote,
the last TRAIN->INFER step (:class:`AgreeStep`): one ``all_reduce`` over the sync's group of a flag per
rank, set on the ranks that cannot finish.

- A rank whose every step ran votes yes; once the vote completes with no flag set, the switch is
  committed on every rank, and a signal held during the switch no longer rolls it back.
- A rank whose step failed after its weight sync completed, with the group still usable, votes no before
  rolling back (:meth:`SwitchAgreement.vote_no`): its peers learn it at once, roll back, and raise
  :class:`~hybridmem.errors.PeerAbortError` naming it; the group stays usable.
- A rank that failed before or inside its weight sync does not vote (its peers may still be waiting for
  its sends, where a vote would not match): its peers time out at the sync's deadline, in the sync or in
  the vote, and roll back with ``CollectiveTimeoutError``.
- The vote's own failure: a rank that fails to post its vote is a rank that does not vote (as above). A
  rank that posted yes and then fails to learn the result may have completed its peers' votes, so it
  must not decide alone: it waits again, until the deadline (:func:`~hybridmem.reshard.deadline.
  wait_to_deadline`). Only a rank whose own transport keeps failing until the deadline after it posted
  ends without knowing; it rolls back and its error says its peers may have committed (with gloo and
  NCCL a peer's all_reduce cannot complete without every rank's part of the exchange, so in practice
  its peers time out too).

tests/distributed/test_collective_faults.py injects a fault at each sampled collective call of a 4-rank
switch, the vote's included, and checks that every rank ends in the same phase.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from hybridmem.accel.group import rank_and_size
from hybridmem.errors import CollectiveTimeoutError, PeerAbortError
from hybridmem.reshard.deadline import deadline_bound, post, wait_to_deadline
from hybridmem.switch.memplan import StepEstimate
from hybridmem.switch.steps import StepResult, SwitchStep

__all__ = ["AgreeStep", "SwitchAgreement"]

log = logging.getLogger(__name__)


class SwitchAgreement:
    """The vote of one rank over the weight sync's group (see [Note: switch agreement]).

    Args:
        group: The process group (``None``: the default group).
        deadline_s: Seconds the vote may wait for the slowest rank to finish its switch.
        device: Where the flags live: the CPU for gloo, the accelerator for NCCL/HCCL.
    """

    def __init__(self, group: Any, *, deadline_s: float, device: torch.device | str = "cpu"):
        if deadline_s <= 0:
            raise ValueError(f"deadline_s={deadline_s} must be > 0")
        self.group = group
        self.deadline_s = float(deadline_s)
        self.rank, self.world_size = rank_and_size(group)
        self.device = torch.device("cpu") if dist.get_backend(group) == "gloo" else torch.device(device)

    def vote(self, ok: bool) -> tuple[int, ...]:
        """Post this rank's vote and wait for everyone's; returns the ranks that voted no.

        Raises:
            CollectiveTimeoutError: Not every rank voted within the deadline (the group is not usable), or
                this rank could not learn the result after posting its vote.
        """
        bound = deadline_bound(self.deadline_s)
        flags = torch.zeros(self.world_size, dtype=torch.float32, device=self.device)
        flags[self.rank] = 0.0 if ok else 1.0
        everyone = tuple(r for r in range(self.world_size) if r != self.rank)
        what = f"rank {self.rank}: the vote on the switch's outcome"
        work = post(lambda: dist.all_reduce(flags, group=self.group, async_op=True), everyone, bound, what)
        wait_to_deadline(work, everyone, bound, what, after=("this rank posted its vote; its peers may have "
                                                             "committed the switch" if ok else ""))
        return tuple(r for r, flag in enumerate(flags.cpu().tolist()) if flag)

    def vote_no(self, reason: str) -> None:
        """Tell the peers this rank cannot finish (best effort: a vote that fails is logged, not raised)."""
        try:
            self.vote(False)
        except Exception as exc:  # this rank rolls back whatever its peers do
            log.warning("hybridmem: rank %d could not tell its peers it rolls back (%s): %s",
                        self.rank, reason, exc)


class AgreeStep(SwitchStep):
    """The last TRAIN->INFER step of a multi-rank switch: the vote (see [Note: switch agreement]).

    After it ran, the switch is committed: nothing rolls it back (``commits``).
    """

    name = "agree on the outcome"
    kind = None
    commits = True
    touches_training_tensors = False

    def __init__(self, agreement: SwitchAgreement):
        self.agreement = agreement

    def estimate(self) -> StepEstimate:
        return StepEstimate()

    def run(self) -> StepResult:
        start = time.perf_counter()
        refused = self.agreement.vote(True)
        if refused:
            raise PeerAbortError(refused, rank=self.agreement.rank)
        return StepResult(seconds=time.perf_counter() - start, extra={"ranks": self.agreement.world_size})


def is_collective_loss(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or its cause chain) left the group unusable, so this rank must not vote."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, CollectiveTimeoutError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
