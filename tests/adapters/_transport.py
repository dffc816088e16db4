"""The engine-in-its-own-process transport in one process, without vLLM: the trainer rank's :class:`Listener`
and :class:`Buckets`, and on a thread the worker's :class:`WorkerChannel`, :func:`open_buckets`,
:class:`StreamUpdate` and :func:`receive_stream` (the code vLLM's workers run, see [Note: vllm receive] in
:mod:`hybridmem.adapters.vllm.server.receive`). Used by the tests of the transport's pieces."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from hybridmem.adapters.vllm.server.buckets import Buckets, open_buckets
from hybridmem.adapters.vllm.server.channel import Listener, WorkerChannel, channel_path
from hybridmem.adapters.vllm.server.receive import StreamUpdate, receive_stream


@dataclass
class Transport:
    """One rank's transport, its worker receiving on :attr:`thread` (errors in :attr:`raised`)."""

    buckets: Buckets
    listener: Listener
    update: StreamUpdate
    thread: threading.Thread
    raised: list[BaseException]

    def close(self) -> None:
        self.listener.close()
        self.buckets.close()


def start_transport(directory: str, layout: dict, dest: dict[str, torch.Tensor], *, run: str,
                    bucket_nbytes: int, wait_s: float) -> Transport:
    """Buckets and a listener in ``directory`` for run ``run``, and a worker thread receiving one update of
    ``layout`` into ``dest`` (with figures checked)."""
    buckets = Buckets(directory, 0, bucket_nbytes=bucket_nbytes, device=torch.device("cpu"))
    listener = Listener(channel_path(directory, 0), 0, run=run)
    update = StreamUpdate(layout, run=run, verify=True, who="vLLM worker rank 0", tensors=dest)
    raised: list[BaseException] = []

    def worker() -> None:
        views = open_buckets(buckets.descriptor(), bucket_nbytes=bucket_nbytes, device=torch.device("cpu"))
        channel = WorkerChannel(listener.path, rank=0, run=run, generation=1)
        try:
            receive_stream(channel, views, update, wait_s=wait_s)
        except BaseException as exc:  # the tests check it
            raised.append(exc)

    transport = Transport(buckets, listener, update, threading.Thread(target=worker, daemon=True), raised)
    listener.expect(run, 1)
    transport.thread.start()
    return transport
