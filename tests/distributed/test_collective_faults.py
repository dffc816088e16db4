"""Fault injection at the collective calls of a multi-rank weight sync: nothing is lost whatever call fails.

Four gloo ranks, each with a ``from_pretrained`` Qwen2 checkpoint under FSDP2's ``fully_shard``, AdamW, a
``ReferenceEngine`` at tp=2 and a ``ShardingManager`` whose weight sync exchanges every tensor in small
buckets (16 KiB) with a 6 s collective deadline and the checksum comparison on. A dry run on every rank
enumerates the calls each switch makes into ``torch.distributed``, per kind (``batch_isend_irecv``,
``isend``, ``irecv``, ``all_reduce``, and the ``Work.wait`` of each work they return: ``isend.wait``, ...)
and per rank: the counts differ between ranks, since a rank only takes part in the buckets that move
its slices. INFER->TRAIN makes no collective call. An injection point is ``(rank or every rank, kind,
n)``: an ``Exception`` raised before the n-th call of that kind on that rank (on every rank, at its own
n-th call where it makes one). For each point the test checks, on every rank:

- every rank ends the switch in the same phase (the ranks' vote, [Note: switch agreement] in
  :mod:`hybridmem.switch.agreement`): all in TRAIN, rolled back, or all in INFER, committed. All commit only
  where the fault came at the vote's own wait, which a rank that posted its vote waits out again;
- where they rolled back: the faulted rank raised with the fault among the error's causes; a rank the
  fault did not reach raised ``CollectiveTimeoutError`` (as ``SwitchCollectiveTimeoutError``) naming the
  peers it waited for, within the deadline plus a margin (in a one-rank case, some rank of those raising
  names the faulted one);
- the phase is TRAIN (after INFER->TRAIN where the switch completed) and every param, grad and AdamW
  state tensor is bitwise what it was before;
- where any rank's error says the process group is no longer usable, every rank follows its advice: it
  destroys the group, initialises a new one (a fresh ``FileStore`` rendezvous) and builds a new engine,
  model (FSDP2 keeps the group it was built over) and manager, into which its intact shards of params,
  grads and AdamW state are carried; the state there is checked bitwise too. A rank that faulted while
  operations of its own were posted must say so as well: a group kept with them pending fails the next
  sync, or aborts a process on gloo's message-size check. No garbage collection runs first: a failed
  switch drops its works and staging buffers before its error leaves it (a garbage collection after the
  switch frees none of them; gloo keeps those of operations it has posted until its pairs close);
- the next round trip completes and the next training step gives exactly the loss of a run that never
  switched, group re-created or not.

A failure after the weight sync on one rank (its KV cache cannot be resumed) makes it vote no: the others
roll back at once with ``PeerAbortError`` naming it, and the group stays usable.

CI injects at a deterministic sample: one call of each kind on every rank at once, and one on one
rank, the ranks taking turns from kind to kind; the call is the first of every other kind in their sorted
order and the last of the rest, so both ends are in the sample (a one-rank point waits for the whole
deadline). ``HYBRIDMEM_FAULTS_FULL=1``
injects at every point: every call of every kind on every rank, and every n on all ranks.
``python tests/distributed/test_collective_faults.py`` prints the dry run and the number of points;
with ``--full`` it injects at all of them (``--full one-rank`` or ``--full every-rank``: one set), and
with ``--shard K/N`` at every N-th of them from the K-th, so that N runs side by side cover the set (a
point mostly waits for the deadline; docs/testing.md has the command and its timing).

"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: ``tests.distributed`` is imported from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest

from hybridmem.testing.workers import WorkerError, WorkerPool
from tests._faults import FULL
from tests.distributed import _collective_fault_tasks as tasks
from tests.distributed._collective_fault_tasks import ALL_RANKS, WAIT, Point
from tests.distributed.fsdp_job import save_tiny_qwen2

pytestmark = pytest.mark.slow

WORLD = 4
DEADLINE_S = float(os.environ.get("HYBRIDMEM_FAULTS_DEADLINE_S", "6.0"))
"""The sync's collective deadline (``HYBRIDMEM_FAULTS_DEADLINE_S`` overrides it for a full run on an idle
machine, where a fault-free switch stays far below 2 s). A fault-free sync takes 0.1-0.2 s on an idle 2-core
machine; with the machine loaded (load average 9: another test run beside this one) the first switches of a
task took up to 1.9 s and later ones 0.2-0.4 s, and a fault-free round must never reach the deadline. A rank
the fault did not reach waits for the whole of it, so it sets the one-rank sample's time (about 20 rounds)."""
MARGIN_S = 10.0
"""How long after the deadline a rank the fault did not reach may take to raise (its rollback, on a
loaded machine)."""
TASK_TIMEOUT_S = 900.0
"""How long the pool waits for one task of up to ROUNDS_PER_TASK rounds: a one-rank round takes the
deadline and a group re-creation, about 8-10 s each on a loaded 2-core machine; only a hang reaches it."""
BUCKET_BYTES = 16 * 2**10
"""Several buckets per sync (a rank receives about 1 MB), so a sync makes tens of calls of each kind."""
ROUNDS_PER_TASK = 24
"""Points injected in one pool task (in FULL runs, many tasks), each round on the state the previous left."""
COMMON = {"deadline_s": DEADLINE_S, "bucket_bytes": BUCKET_BYTES}


def _spread(count: int, k: int) -> list[int]:
    """The calls of the ``k``-th kind a sample injects at, of ``count`` (1-based): the first for even ``k``,
    the last for odd ``k`` (so the sample holds first and last calls, each a round, the one-rank rounds
    waiting out the deadline); all when FULL."""
    if FULL:
        return list(range(1, count + 1))
    return [1 if k % 2 == 0 else count] if count else []


def every_rank_points(counts: list[dict[str, int]]) -> list[Point]:
    """Points at which every rank faults at its own n-th call of a kind (n up to the most calls of any
    rank)."""
    kinds = sorted(set().union(*counts))
    return [(ALL_RANKS, kind, n) for k, kind in enumerate(kinds)
            for n in _spread(max(c.get(kind, 0) for c in counts), k)]


def one_rank_points(counts: list[dict[str, int]]) -> list[Point]:
    """Points at which one rank faults: in the sample, kind ``k``'s calls on rank ``k % WORLD`` (or the next
    rank that makes such calls), so every rank takes its turn; when FULL, every call on every rank."""
    kinds = sorted(set().union(*counts))
    points: list[Point] = []
    for k, kind in enumerate(kinds):
        ranks = range(WORLD) if FULL else [next(r % WORLD for r in range(k, k + WORLD)
                                                if counts[r % WORLD].get(kind))]
        points += [(rank, kind, n)
                   for rank in ranks for n in _spread(counts[rank].get(kind, 0), k)]
    return points


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_qwen2(tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def pool():
    """One pool for the module: a task that re-creates the process group leaves the new one to the next. A
    task (at most :data:`ROUNDS_PER_TASK` rounds) that has not returned in :data:`TASK_TIMEOUT_S` is stuck."""
    with WorkerPool(WORLD, timeout_s=TASK_TIMEOUT_S) as p:
        yield p


@pytest.fixture(scope="module")
def reference(pool, model_dir) -> list[dict]:
    """Per rank: the dry run's calls per kind of each switch, and the losses of a run that never switches."""
    return pool.run(tasks.reference_task, model_dir, steps=ROUNDS_PER_TASK, **COMMON)


def inject(pool, model_dir: str, store_dir: Path, points: list[Point], reference: list[dict]) -> list[str]:
    """Run ``points`` (in tasks of :data:`ROUNDS_PER_TASK`); the problems found, one line each."""
    problems = []
    for first in range(0, len(points), ROUNDS_PER_TASK):
        chunk = points[first:first + ROUNDS_PER_TASK]
        store = store_dir / f"task-{first}"
        store.mkdir()
        try:
            results = pool.run(tasks.collective_fault_task, model_dir, points=chunk,
                               store_dir=str(store), **COMMON)
        except WorkerError as exc:
            # a rank died or raised outside a round's checks: no rank's rounds came back
            where = {rank: int((store / f"progress-{rank}").read_text()) for rank in range(WORLD)
                     if (store / f"progress-{rank}").exists()}
            at = chunk[min(where.values())] if where else "before the first round"
            return problems + [f"{at}: the task failed (round reached per rank: {where}):\n"
                               f"{str(exc)[-3000:]}"]
        for i, point in enumerate(chunk):
            records = [results[rank][i] if i < len(results[rank]) else None for rank in range(WORLD)]
            print(point, outcome(records))
            found = [f"{point}: {p}" for p in check_round(point, records, [r["losses"][i] for r in reference],
                                                          [r["to_infer"] for r in reference])]
            for line in found:
                print("PROBLEM", line)
            problems += found
            if any(r is None or "next_error" in r for r in records):
                pool.close()  # the group is gone: the next task starts a fresh pool
                return problems
    return problems


def outcome(records: list[dict | None]) -> str:
    """One line: per rank, ``fault`` (injected there), ``timeout [peers]`` or ``completed``, and its seconds;
    whether the group was re-created."""
    def one(r: dict | None) -> str:
        if r is None:
            return "-"
        what = ("fault" if r["fired"] else f"peer abort {r['peers']}" if r["error"] == "SwitchPeerAbortError"
                else f"timeout {r['peers']}" if r["error"] else "completed")
        return f"{what} {r['seconds']:.1f}s"

    recreated = any(r is not None and r["recreated"] for r in records)
    return " | ".join(one(r) for r in records) + ("; group re-created" if recreated else "")


def _is_vote_wait(kind: str, n: int, counts: dict[str, int]) -> bool:
    """Whether call ``n`` of ``kind`` on a rank making ``counts`` calls is the wait of the ranks' vote: the
    last ``all_reduce`` of TRAIN->INFER ([Note: switch agreement] in :mod:`hybridmem.switch.agreement`)."""
    return kind == "all_reduce" + WAIT and n == counts.get(kind)


def check_round(point: Point, records: list[dict | None], losses: list[float],
                counts: list[dict[str, int]]) -> list[str]:
    """What went wrong in the round of ``point`` (per-rank ``records``), against the fault-free ``losses``
    and the dry run's ``counts`` per rank."""
    target, kind, n = point
    problems = []
    fired = [rank for rank, r in enumerate(records) if r is not None and r["fired"] is not None]
    if target != ALL_RANKS and fired != [target] or target == ALL_RANKS and not fired:
        problems.append(f"the fault fired on ranks {fired}: the switch no longer makes call {n} of {kind} "
                        "there")
    phases = {rank: r["phase"] for rank, r in enumerate(records) if r is not None}
    if len(set(phases.values())) > 1:
        problems.append(f"the ranks disagree on the switch's outcome: phases {phases}")
    committed = set(phases.values()) == {"INFER"}
    if committed and not all(_is_vote_wait(kind, n, counts[rank]) for rank in fired):
        problems.append(f"every rank committed though call {n} of {kind} failed on ranks {fired}, which is "
                        "not the wait of their vote")
    raised = [r for rank, r in enumerate(records) if r is not None and r["error"] and rank not in fired]
    if target != ALL_RANKS and raised and not any(target in r["peers"] for r in raised):
        problems.append(f"no rank names rank {target}, where the fault was: peers "
                        f"{[r['peers'] for r in raised]}")
    for rank, r in enumerate(records):
        if r is None:
            problems.append(f"rank {rank} returned no record of this round")
            continue
        if committed:
            if r["error"] is not None:
                problems.append(f"rank {rank} raised {r['error']} though every rank committed: "
                                f"{r['message']}")
        elif rank in fired:
            if not (r["error"] and r["injected"] and r["phase"] == "TRAIN"):
                problems.append(f"rank {rank} (faulted): error {r['error']} (injected fault among its "
                                f"causes: {r.get('injected')}), phase {r['phase']}: {r.get('message')}")
        elif r["error"] is None:
            problems.append(f"rank {rank}: the switch returned without an error in phase {r['phase']}")
        else:
            timeout = (r["collective"] and r["error"] == "SwitchCollectiveTimeoutError"
                       and r["group_usable"] is False)
            if not ((timeout or r["error"] == "SwitchPeerAbortError") and r["peers"]):
                problems.append(f"rank {rank}: raised {r['error']}, not a CollectiveTimeoutError or "
                                f"PeerAbortError naming its peers (peers {r['peers']}, group_usable "
                                f"{r['group_usable']}): {r['message']}")
            if r["seconds"] > DEADLINE_S + MARGIN_S:
                problems.append(f"rank {rank}: raised after {r['seconds']:.1f} s, deadline {DEADLINE_S} s")
        if r["buffers_alive"] != r["buffers_alive_after_gc"]:  # those gloo still holds for a posted op stay
            problems.append(f"rank {rank}: {r['buffers_alive'] - r['buffers_alive_after_gc']} staging "
                            "buffers of the switch were left to the garbage collector")
        if not r.get("state_intact"):
            problems.append(f"rank {rank}: training state not intact: {r.get('state_problem')}, phase "
                            f"{r['phase']}")
        if "next_error" in r:
            problems.append(f"rank {rank}: the next round trip or step failed (group re-created: "
                            f"{r['recreated']}):\n{r['next_error']}")
        elif r["loss"] != losses[rank]:
            problems.append(f"rank {rank}: next loss {r['loss']!r}, a run that never switched: "
                            f"{losses[rank]!r} (group re-created: {r['recreated']})")
    return problems


def test_the_dry_run_enumerates_the_collective_calls_of_each_switch(reference):
    counts = [r["to_infer"] for r in reference]
    for rank, c in enumerate(counts):
        print(f"rank {rank}: TRAIN->INFER {dict(sorted(c.items()))}; INFER->TRAIN "
              f"{reference[rank]['to_train']}")
    for rank, c in enumerate(counts):
        assert {"batch_isend_irecv", "isend", "irecv", "all_reduce"} <= set(c), (rank, c)
        for kind in ("isend", "irecv", "all_reduce"):
            assert c[kind + WAIT] == c[kind], (rank, kind, c)  # every work is waited for, once
        assert c["batch_isend_irecv"] > 1, (rank, c)  # the sync runs in several buckets
        assert reference[rank]["to_train"] == {}, (
            f"rank {rank}: INFER->TRAIN now makes collective calls {reference[rank]['to_train']}: inject "
            "there too")


@pytest.mark.parametrize("where,points_of",
                         [("every rank", every_rank_points), ("one rank", one_rank_points)],
                         ids=["every-rank", "one-rank"])
def test_a_fault_at_each_sampled_call_loses_nothing(pool, model_dir, reference, tmp_path, where, points_of):
    points = points_of([r["to_infer"] for r in reference])
    start = time.monotonic()
    problems = inject(pool, model_dir, tmp_path, points, reference)
    print(f"{len(points)} points on {where} in {time.monotonic() - start:.1f} s")
    assert not problems, "\n".join(problems)


def test_a_fault_on_one_rank_after_its_last_post_of_the_sync_fails_every_rank(pool, model_dir, reference,
                                                                              tmp_path):
    """The checksum comparison's wait is the sync's last call: the faulted rank has posted everything, its
    peers complete the sync, then wait for its vote and roll back too."""
    point = (1, "all_reduce" + WAIT, reference[1]["to_infer"]["all_reduce" + WAIT] - 1)
    records = [r[0] for r in pool.run(tasks.collective_fault_task, model_dir, points=[point],
                                      store_dir=str(tmp_path), **COMMON)]
    print(point, outcome(records))
    assert records[1]["injected"], f"rank 1 did not fault: {records[1]}"
    assert not check_round(point, records, [r["losses"][0] for r in reference],
                           [r["to_infer"] for r in reference])
    assert [r["phase"] for r in records] == ["TRAIN"] * WORLD and all(r["error"] for r in records), records


def test_a_fault_at_the_wait_of_a_ranks_vote_commits_every_rank(pool, model_dir, reference, tmp_path):
    """A rank that posted its vote and fails to learn the result waits again: the switch commits
    everywhere."""
    point = (2, "all_reduce" + WAIT, reference[2]["to_infer"]["all_reduce" + WAIT])
    records = [r[0] for r in pool.run(tasks.collective_fault_task, model_dir, points=[point],
                                      store_dir=str(tmp_path), **COMMON)]
    print(point, outcome(records))
    assert records[2]["fired"], f"rank 2 did not fault: {records[2]}"
    assert not check_round(point, records, [r["losses"][0] for r in reference],
                           [r["to_infer"] for r in reference])
    assert [r["phase"] for r in records] == ["INFER"] * WORLD, records


def test_a_failure_after_the_sync_on_one_rank_rolls_every_rank_back_at_once(pool, model_dir, reference,
                                                                            tmp_path):
    """Rank 3 cannot resume its KV cache after a completed sync: it votes no, its peers roll back without
    waiting for a deadline and name it, the group stays usable, and the next round trip needs no new group."""
    results = pool.run(tasks.local_fault_task, model_dir, rank=3, store_dir=str(tmp_path), **COMMON)
    for rank, r in enumerate(results):
        assert r["phase"] == "TRAIN" and r["state_intact"], (rank, r)
        if rank == 3:
            assert r["error"] == "SwitchError" and "kv_cache" in r["message"], r
        else:
            assert r["error"] == "SwitchPeerAbortError" and r["peers"] == [3] and r["group_usable"], r
            assert r["seconds"] < DEADLINE_S, (f"rank {rank} waited {r['seconds']:.1f} s: "
                                               "it did not hear the no")
        assert r["loss"] == reference[rank]["losses"][0], (rank, r["loss"])


if __name__ == "__main__":  # the dry run and the number of points; with --full, the full injection
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, WorkerPool(WORLD, timeout_s=TASK_TIMEOUT_S) as main_pool:
        directory = save_tiny_qwen2(Path(tmp) / "qwen2")
        ref = main_pool.run(tasks.reference_task, directory, steps=ROUNDS_PER_TASK, **COMMON)
        for rank_, r_ in enumerate(ref):
            print(f"rank {rank_}: TRAIN->INFER {dict(sorted(r_['to_infer'].items()))}; INFER->TRAIN "
                  f"{r_['to_train']}")
        counts_ = [r_["to_infer"] for r_ in ref]
        FULL = False
        ci = (len(every_rank_points(counts_)), len(one_rank_points(counts_)))
        FULL = True
        full = (every_rank_points(counts_), one_rank_points(counts_))
        print(f"points: CI {ci[0]} on every rank + {ci[1]} on one rank; full {len(full[0])} + {len(full[1])}")
        shard, shards = 0, 1  # --shard K/N: every N-th point from the K-th (0-based), for N runs side by side
        if "--shard" in sys.argv:
            shard, shards = map(int, sys.argv[sys.argv.index("--shard") + 1].split("/"))
        if "--full" in sys.argv:  # --full [every-rank|one-rank]: both sets, or one
            which = [a for a in sys.argv[sys.argv.index("--full") + 1:][:1] if not a.startswith("--")]
            for name, pts in zip(("every rank", "one rank"), full, strict=False):
                if which and which[0].replace("-", " ") != name:
                    continue
                pts = pts[shard::shards]
                t0 = time.monotonic()
                found = inject(main_pool, directory, Path(tempfile.mkdtemp(dir=tmp)), pts, ref)
                print(f"{name}: {len(pts)} points in {time.monotonic() - t0:.0f} s, {len(found)} problems")
                for line in found[:20]:
                    print("   ", line)
