"""The trainer rank's listener of the engine-in-its-own-process transport, with real Unix sockets and the
worker's own end (:class:`WorkerChannel`): which worker connection a switch gets, whenever it comes."""

from __future__ import annotations

import os
import tempfile
import threading

import pytest

from hybridmem.adapters.vllm.server.channel import ChannelError, Listener, WorkerChannel


@pytest.fixture
def listener():
    directory = tempfile.mkdtemp(prefix="chan-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    listening = Listener(os.path.join(directory, "c.sock"), 1, run="run-a")
    yield listening
    listening.close()
    os.rmdir(directory)


def _connect(listener: Listener, run: str, generation: int) -> WorkerChannel:
    return WorkerChannel(listener.path, rank=1, run=run, generation=generation)


def _refused(worker: WorkerChannel) -> str:
    with pytest.raises(ChannelError) as info:
        worker.receive(timeout_s=5.0)
    return str(info.value)


def test_a_worker_that_connects_before_its_trainer_rank_asks_is_handed_on_when_it_asks(listener):
    """Rank 0 starts an update while this rank still offloads: its worker's hello comes first."""
    worker = _connect(listener, "run-a", 1)
    threading.Event().wait(0.2)  # the hello has been read and kept
    listener.expect("run-a", 1)
    conn = listener.accept(timeout_s=5.0)
    conn.send({"ping": 1})
    assert worker.receive(timeout_s=5.0) == {"ping": 1}
    worker.close()
    conn.close()


def test_the_same_worker_in_time_is_handed_on(listener):
    listener.expect("run-a", 2)
    worker = _connect(listener, "run-a", 2)
    conn = listener.accept(timeout_s=5.0)
    worker.send({"hello again": 2})
    assert conn.receive(timeout_s=5.0) == {"hello again": 2}
    worker.close()
    conn.close()


def test_a_late_worker_of_an_update_the_rank_gave_up_on_is_refused_at_once(listener):
    listener.expect("run-a", 3)
    with pytest.raises(ChannelError, match="did not connect"):
        listener.accept(timeout_s=0.2)
    listener.expect(None)  # the switch gave up on update 3
    message = _refused(_connect(listener, "run-a", 3))
    assert "update 3" in message and "gave up" in message, message


def test_a_worker_of_another_run_is_refused_naming_both(listener):
    message = _refused(_connect(listener, "run-b", 1))
    assert "run-b" in message, message


def test_an_early_hello_of_an_update_the_rank_skipped_is_refused_when_it_moves_past(listener):
    worker = _connect(listener, "run-a", 4)
    threading.Event().wait(0.2)
    listener.expect("run-a", 5)  # update 4 failed on rank 0 before this rank got there
    message = _refused(worker)
    assert "update 4" in message, message
