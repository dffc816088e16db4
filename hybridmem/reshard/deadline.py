"""Bounded waits for the collectives of a weight sync (see [Note: collective deadlines] in
:mod:`hybridmem.reshard.execute`)."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from hybridmem.errors import CollectiveTimeoutError

__all__ = ["Bound", "deadline_bound", "wait_all", "wait_to_deadline", "post", "exchange", "global_rank"]

RETRIES_AFTER_POST = 3
"""How many times :func:`wait_to_deadline` waits again after an error of this rank's, within the deadline."""

Bound = tuple[float, float]
"""``(start, deadline)`` on ``time.monotonic()``."""


def deadline_bound(deadline_s: float | None) -> Bound | None:
    """``(now, now + deadline_s)``, or ``None`` without a deadline.

    Raises:
        ValueError: ``deadline_s`` is not positive.
    """
    if deadline_s is None:
        return None
    if deadline_s <= 0:
        raise ValueError(f"deadline_s={deadline_s} must be > 0 or None")
    now = time.monotonic()
    return now, now + deadline_s


def post(start_ops: Callable[[], Any], peers: tuple[int, ...], bound: Bound | None, what: str) -> Any:
    """``start_ops()`` (posting sends and receives); a failure there (a peer's connection already closed,
    or any error once some operations may be posted) raises ``CollectiveTimeoutError`` as :func:`wait_all`
    does."""
    start = bound[0] if bound is not None else time.monotonic()
    try:
        return start_ops()
    except Exception as exc:
        raise _lost(what, peers, bound, start, exc) from exc


def wait_all(works: Sequence[tuple[Any, tuple[int, ...]]], bound: Bound | None, what: str) -> None:
    """Wait for ``(work, peers)`` pairs in order, each with what is left of ``bound``; a wait that times out,
    or fails because a peer's connection closed, or any error while works are pending (they stay posted, so
    the group is not usable either), raises ``CollectiveTimeoutError`` naming ``what`` and the peers of the
    works not known to be done."""
    start = bound[0] if bound is not None else time.monotonic()
    for i, (work, _) in enumerate(works):
        try:
            if bound is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=max(0.001, bound[1] - time.monotonic())))
        except Exception as exc:
            raise _lost(what, [peer for _, some in works[i:] for peer in some], bound, start, exc) from exc


def wait_to_deadline(work: Any, peers: tuple[int, ...], bound: Bound, what: str, *, after: str = "") -> None:
    """Wait for ``work`` until ``bound``'s deadline even if a wait fails on this rank: a collective this rank
    has posted may have completed on its peers, so its outcome must be learned, not guessed (see [Note:
    switch agreement] in :mod:`hybridmem.switch.agreement`). Up to :data:`RETRIES_AFTER_POST` more waits while
    time is left; then ``CollectiveTimeoutError`` as :func:`wait_all` raises, with ``after`` appended to
    its cause."""
    start = bound[0]
    for attempt in range(RETRIES_AFTER_POST + 1):
        try:
            work.wait(datetime.timedelta(seconds=max(0.001, bound[1] - time.monotonic())))
            return
        except Exception as exc:
            if attempt == RETRIES_AFTER_POST or time.monotonic() >= bound[1]:
                lost = _lost(what, peers, bound, start, exc)
                if after:
                    lost.add_note(after)
                raise lost from exc


def _lost(what: str, peers: Sequence[int], bound: Bound | None, start: float,
          exc: BaseException) -> CollectiveTimeoutError:
    """The error for a collective that ``exc`` ended (a timeout, a peer's closed connection, or an error of
    this rank's while operations were posted)."""
    return CollectiveTimeoutError(what, peers=tuple(sorted(set(peers))),
                                  deadline_s=(bound[1] - start) if bound else float("inf"),
                                  elapsed_s=time.monotonic() - start,
                                  cause=f"{type(exc).__name__}: {exc}".splitlines()[0][:200])


def exchange(ops: Sequence[Any], peers: Sequence[int], bound: Bound | None, what: str) -> None:
    """Post point-to-point ``ops`` (one per entry of ``peers``) in one ``batch_isend_irecv`` and wait for
    them within ``bound``, as :func:`post` and :func:`wait_all` do; nothing when ``ops`` is empty."""
    if not ops:
        return
    works = post(lambda: dist.batch_isend_irecv(list(ops)), tuple(peers), bound, what)
    pairs = (list(zip(works, ((p,) for p in peers))) if len(works) == len(peers)
             else [(w, tuple(peers)) for w in works])  # one work for the whole batch (NCCL coalesces)
    wait_all(pairs, bound, what)


def global_rank(group: Any, rank: int) -> int:
    """``rank`` of ``group`` as a rank of the default group (``group=None``: itself)."""
    return rank if group is None else dist.get_global_rank(group, rank)
