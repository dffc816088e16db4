"""No worker of a :class:`~hybridmem.testing.workers.WorkerPool` outlives an interrupted test run.

A pytest run of its own (one test holding a session-scoped pool of 2 workers busy in a task) is started
in a new session, so that it and everything it starts share one process group; once the workers have
reported their pids it is interrupted as a user or a CI runner would: Ctrl-C in a terminal (SIGINT to
the whole group), SIGTERM to the pytest process, or SIGTERM to the pytest-xdist worker that owns the
pool. Then no process of that group may be left (see [Note: workers die with their parent] in
:mod:`hybridmem.testing.workers`).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table from /proc"),
]

ROOT = pathlib.Path(__file__).resolve().parents[2]

START_S = 300.0
"""How long the inner run may take to start its pool on a loaded 2-core machine."""

GONE_S = 180.0
"""How long after the signal every process of the run may take to be gone: the pool's close waits 5 s,
then kills; before that pytest reports the interrupt, which took over a minute at load average 40."""

INNER = '''
import faulthandler, os, pathlib, pytest, signal
faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it hangs, if it does
from hybridmem.testing.workers import WorkerPool
from tests.testing import _pool_tasks as tasks

@pytest.fixture(scope="session")
def pool():
    with WorkerPool(2, timeout_s=900.0) as p:
        yield p

def test_hold_the_pool_busy(pool):
    out = pathlib.Path(os.environ["HYBRIDMEM_TEST_PIDS"])
    pids = pool.run(tasks.pids)
    out.with_suffix(".tmp").write_text(" ".join(f"{pid}:{ppid}" for pid, ppid in pids))
    out.with_suffix(".tmp").rename(out)
    pool.run(tasks.sleep, 900.0)
'''


def _as_in_a_terminal() -> None:
    """SIGINT's default action in the run, as in a terminal's foreground job: this test may itself run with
    SIGINT ignored (a background job of a non-interactive shell), which the run would inherit, and Python
    then installs no KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _group(pgid: int) -> dict[int, str]:
    """``{pid: state}`` of the live (not zombie) processes whose process group is ``pgid``."""
    found = {}
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it ended while we looked
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            found[int(entry.name)] = stat[:stat.rindex(")") + 1]
    return found


def _wait_for(path: pathlib.Path, proc: subprocess.Popen, timeout_s: float) -> None:
    give_up = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"the inner run ended (exit {proc.returncode}) before its pool "
                        f"started:\n{_output(proc)}")
        if time.monotonic() > give_up:
            pytest.fail(f"the inner run's pool did not start in {timeout_s} s")
        time.sleep(0.2)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm-pytest", "sigterm-xdist-worker"])
def test_no_worker_outlives_an_interrupted_run(tmp_path, how):
    (tmp_path / "test_inner.py").write_text(INNER)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    pids_file = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "HYBRIDMEM_TEST_PIDS": str(pids_file)}
    xdist = ["-n", "1"] if how == "sigterm-xdist-worker" else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
           "no:randomly", *xdist, "test_inner.py"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, preexec_fn=_as_in_a_terminal)
    try:
        _wait_for(pids_file, proc, START_S)
        workers = [tuple(map(int, w.split(":"))) for w in pids_file.read_text().split()]
        parents = {ppid for _, ppid in workers}
        assert len(workers) == 2 and len(parents) == 1, workers
        assert all(pid in _group(proc.pid) for pid, _ in workers), \
            "the workers are not in the run's process group"
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        elif how == "sigterm-pytest":
            assert parents == {proc.pid}, (workers, proc.pid)
            os.kill(proc.pid, signal.SIGTERM)
        else:
            (owner,) = parents
            assert owner != proc.pid, "with -n 1 the pool belongs to the xdist worker"
            os.kill(owner, signal.SIGTERM)
        give_up = time.monotonic() + GONE_S
        while (left := _group(proc.pid)) and time.monotonic() < give_up:
            proc.poll()  # reap the pytest process itself once it exits
            time.sleep(0.2)
        if left:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGUSR1)
                time.sleep(2)
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"{how}: alive {GONE_S} s after the signal: {left}; the run's "
                        f"output:\n{_output(proc)}")
        assert proc.wait(timeout=10) != 0
    finally:
        if proc.poll() is None or _group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)  # leave nothing behind, whatever the outcome
        proc.wait(timeout=30)
        if proc.stdout:
            proc.stdout.close()


def _output(proc: subprocess.Popen) -> str:
    proc.wait(timeout=30)
    return proc.stdout.read()[-6000:] if proc.stdout else ""
