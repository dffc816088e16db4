"""The engine-in-its-own-process transport in one process, without vLLM: the trainer rank's :class:`Listener`
and :class:`Buckets`, and on a thread the worker's :class:`WorkerChannel`, :func:`open_buckets`,
:class:`StreamUpdate` and :func:`receive_stream` (the code vLLM's workers run, see [Note: vllm receive] in
:mod:`hybridmem.adapters.vllm.server.receive`). Used by the tests of the transport's pieces."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from hybridmem.adapters.vllm.server.buckets import Buckets, open_buckets
from hybridmem.adapters.vllm.server.channel import Listener, WorkerChannel, channel_path
from hybridmem.adapters.vllm.server.client import VLLMClient
from hybridmem.adapters.vllm.server.receive import StreamUpdate, receive_stream
from hybridmem.errors import EngineFault


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


class LocalWorker(VLLMClient):
    """A :class:`VLLMClient` whose one vLLM worker is in this process: each call runs the subclass's
    ``_<name>`` method at once (a raise is the engine's refusal, ``EngineFault.REFUSED``), recorded in
    :attr:`calls`; one rank, never gone, no generation. Subclasses give the weight-transfer calls."""

    where = "an in-process vLLM worker"
    timeout_s = 60.0
    generate_timeout_s = 60.0

    def __init__(self) -> None:
        self.version = "initial"
        self.calls: list[str] = []

    def _call(self, name: str, *args: Any, timeout_s: float | None = None) -> Any:
        start = time.monotonic()
        self.calls.append(name)
        try:
            return getattr(self, f"_{name}")(*args)
        except Exception as exc:
            raise self._failure(name, start=start, deadline_s=self.timeout_s, cause=str(exc),
                                fault=EngineFault.REFUSED) from exc

    def _world_size(self) -> int:
        return 1

    def _reset_prefix_cache(self) -> None:
        pass

    def _weight_version(self) -> str:
        return self.version

    def _gone(self) -> bool:
        return False

    def generate(self, prompt_ids: Any, params: Any) -> Any:
        raise NotImplementedError(f"{self.where} does not generate")

    async def agenerate(self, prompt_ids: Any, params: Any, *, index: int = 0) -> Any:
        raise NotImplementedError(f"{self.where} does not generate")
