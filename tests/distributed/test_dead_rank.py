"""A rank that stalls or dies during a switch does not hang the others (4 gloo ranks, FSDP2, a weight
sync that exchanges every tensor): the survivors raise ``CollectiveTimeoutError`` within the deadline,
naming the step and the peer they waited for (the lost rank, or a rank waiting for it), back in TRAIN
with their training state bitwise what it was; a rank lost while no collective is pending
(INFER->TRAIN) stops nobody.

See [Note: collective deadlines] in :mod:`hybridmem.reshard.execute`.
"""

from __future__ import annotations

import pytest

from hybridmem.testing.workers import WorkerError, WorkerPool
from tests._full import full_only
from tests.distributed import _dead_rank_tasks as tasks
from tests.distributed.fsdp_job import save_tiny_qwen2

pytestmark = pytest.mark.slow

WORLD = 4
BAD = 3
DEADLINE_S = 6.0
"""The sync's collective deadline: above the up to 2 s a fresh pool's first (fault-free) switch takes on a
loaded 2-core machine, so that only the misbehaving rank makes the others reach it."""
MARGIN_S = 10.0
"""How long after the deadline a survivor may take to raise (its rollback, on a loaded machine)."""
STALL_S = DEADLINE_S + MARGIN_S
"""How long the stalled rank sleeps: past the last survivor's timeout, so every survivor sees it."""


@pytest.fixture
def pool():
    """A fresh pool per case: each case leaves its process group closed, as the error says."""
    with WorkerPool(WORLD, timeout_s=300.0) as p:
        yield p


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2"))


def _run(pool, model_dir, **kwargs) -> dict[int, dict]:
    try:
        return dict(enumerate(pool.run(tasks.bad_rank_task, model_dir, bad_rank=BAD, deadline_s=DEADLINE_S,
                                       stall_s=STALL_S, **kwargs)))
    except WorkerError as exc:  # the killed rank never returns
        assert "rank 3 died" in str(exc), str(exc)[-2000:]
        return exc.results


_EACH_ONCE = "a stall and a kill each run once in CI, at the other point"
CASES = [  # (how, where, call): where in TRAIN->INFER the bad rank misbehaves
    ("stall", "resume", 1),    # before the weight sync: the others wait for it in the first bucket
    pytest.param("kill", "resume", 1, marks=full_only(_EACH_ONCE)),
    pytest.param("stall", "exchange", 1, marks=full_only(_EACH_ONCE)),  # at its first bucket: mid-sync
    ("kill", "exchange", 1),
]


@pytest.mark.parametrize("how,where,call", CASES,
                         ids=["stall-resume", "kill-resume", "stall-exchange", "kill-exchange"])
def test_survivors_raise_within_the_deadline_with_nothing_lost(pool, model_dir, how, where, call):
    results = _run(pool, model_dir, how=how, where=where, call=call, direction="to_infer")
    survivors = [r for r in range(WORLD) if r != BAD]
    assert set(survivors) <= set(results), sorted(results)
    print(f"{how} at {where}: survivors raised after",
          [round(results[r]["seconds"], 2) for r in survivors], "s")
    for rank in survivors:
        r = results[rank]
        assert r["error"] == "SwitchCollectiveTimeoutError" and r["collective"], (rank, r)
        assert ("weight sync" in r["message"]
                and "process group is no longer usable" in r["message"]), r["message"]
        assert r["peers"] and r["group_usable"] is False, (rank, r)
        assert r["seconds"] < DEADLINE_S + MARGIN_S, (rank, r["seconds"])
        assert r["phase"] == "TRAIN" and r["state_intact"], (rank, r)
    # A rank names the peers it waited for: the bad rank, or a peer waiting for it in turn.
    assert any(BAD in results[r]["peers"] for r in survivors), [results[r]["peers"] for r in survivors]
    if how == "stall":  # the stalled rank comes back to a group its peers closed: it rolls back too
        r = results[BAD]
        assert r["collective"] and r["phase"] == "TRAIN" and r["state_intact"], r


@full_only("the fault harness's every-rank sample injects before the first exchange too "
           "(tests/distributed/test_collective_faults.py)")
def test_a_fault_on_every_rank_before_a_collective_keeps_the_group_and_the_run(pool, model_dir):
    """Every rank fails on its way into the first bucket's exchange (before anything is posted): each rolls
    back with the fault named, the group stays usable, and the next switch and training step give the
    loss a run without the fault gives."""
    faulted = pool.run(tasks.bad_rank_task, model_dir, bad_rank=-1, how="raise", where="exchange", call=1,
                       direction="to_infer", deadline_s=DEADLINE_S, stall_s=STALL_S)
    clean = pool.run(tasks.bad_rank_task, model_dir, bad_rank=-1, how="none", where="exchange", call=1,
                     direction="to_infer", deadline_s=DEADLINE_S, stall_s=STALL_S)
    for rank in range(WORLD):
        f, c = faulted[rank], clean[rank]
        assert f["error"] == "SwitchError" and "injected before the collective" in f["message"], f
        assert "weight sync" in f["message"] and f["phase"] == "TRAIN" and f["state_intact"], f
        assert c["error"] is None
        assert f["next_loss"] == c["next_loss"], (rank, f["next_loss"], c["next_loss"])


SMALL_BUCKETS = 16 * 2**10
"""Several buckets per sync (a rank receives about 1 MB), so a sync makes several exchanges."""


@full_only("the fault harness's every-rank sample covers the first, middle and last exchange "
           "(tests/distributed/test_collective_faults.py)")
def test_a_fault_on_every_rank_at_each_exchange_keeps_the_group_and_the_run(pool, model_dir):
    """The fault harness's rule over the collectives of a multi-rank sync: a fault on every rank on the way
    into the first, middle and last step of the plan (each rank at its first step at or after that step's
    key: ranks run only the steps of their own share); each rank rolls back with the state intact, and the
    next switch and step give the loss of a run without faults."""
    common = dict(bad_rank=-1, where="exchange", direction="to_infer", deadline_s=DEADLINE_S, stall_s=STALL_S,
                  bucket_bytes=SMALL_BUCKETS)
    clean = pool.run(tasks.bad_rank_task, model_dir, how="none", call=0, **common)
    assert all(r["exchanges"] >= 1 for r in clean), [r["exchanges"] for r in clean]
    # The steps of the whole plan up to the last one every rank still has: a fault there hits every rank.
    upto = min(tuple(r["keys"][-1]) for r in clean)
    keys = sorted({tuple(k) for r in clean for k in r["keys"] if tuple(k) <= upto})
    assert len(keys) >= 3, keys
    for key in sorted({keys[0], keys[len(keys) // 2], keys[-1]}):
        faulted = pool.run(tasks.bad_rank_task, model_dir, how="raise", call=0, at_key=key, **common)
        for rank, (f, c) in enumerate(zip(faulted, clean, strict=False)):
            assert f["error"] == "SwitchError" and "injected before the collective" in f["message"], (key, f)
            assert f["phase"] == "TRAIN" and f["state_intact"], (key, f)
            assert f["next_loss"] == c["next_loss"], (key, rank, f["next_loss"], c["next_loss"])


@pytest.mark.parametrize("call", [pytest.param(1, marks=full_only("the third exchange runs the same path")),
                                  3])
def test_a_fault_on_one_rank_at_an_exchange_fails_the_others_by_the_deadline(pool, model_dir, call):
    """Rank 3 fails on its way into its ``call``-th exchange; it rolls back at once, the others wait for it
    until the deadline and roll back; every rank keeps its training state."""
    results = pool.run(tasks.bad_rank_task, model_dir, bad_rank=BAD, how="raise", where="exchange", call=call,
                       direction="to_infer", deadline_s=DEADLINE_S, stall_s=STALL_S,
                       bucket_bytes=SMALL_BUCKETS)
    assert results[BAD]["error"] == "SwitchError" and "injected" in results[BAD]["message"], results[BAD]
    for rank, r in enumerate(results):
        assert r["phase"] == "TRAIN" and r["state_intact"], (rank, r)
        if rank != BAD:  # each names the peer it waited for: rank 3, or one waiting for rank 3 in turn
            assert r["collective"] and r["peers"] and r["seconds"] < DEADLINE_S + MARGIN_S, (rank, r)
    assert any(BAD in r["peers"] for rank, r in enumerate(results) if rank != BAD), results


def test_a_rank_lost_in_infer_to_train_stops_nobody(pool, model_dir):
    results = _run(pool, model_dir, how="kill", where="release", call=1, direction="to_train")
    for rank in range(WORLD - 1):
        r = results[rank]
        assert r["error"] is None and r["phase"] == "TRAIN" and r["state_intact"], (rank, r)
        assert r["seconds"] < DEADLINE_S, (rank, r["seconds"])
