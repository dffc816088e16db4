"""A bucket of another run of the engine, refused by the worker's own receiving code before it writes a byte.

The real pieces of the engine-in-its-own-process transport in one process, without vLLM: the trainer rank's
:class:`Listener`, :class:`Buckets` and :class:`BucketWriter`, and on a thread the worker's
:class:`WorkerChannel`, :func:`open_buckets`, :class:`StreamUpdate` and :func:`receive_stream` (the code
vLLM's workers run, see [Note: vllm receive] in :mod:`hybridmem.adapters.vllm.server.receive`). The trainer
streams under a run id the worker was not initialised for, as a trainer of a previous run whose buckets and
channel are still there would.
"""

from __future__ import annotations

import pytest
import torch

from hybridmem.adapters.vllm.server.channel import ChannelError
from hybridmem.adapters.vllm.server.packing import BucketWriter
from tests.adapters._transport import start_transport

RUN = "hybridmem-run-now"
STALE = "hybridmem-run-before"
LAYOUT = {"layers.0.w": ((64, 32), torch.float32), "layers.0.b": ((32,), torch.float32)}
"""The first tensor (8 KiB) spans both buckets."""
BUCKET_NBYTES = 4096
WAIT_S = 10.0


def test_a_bucket_message_of_a_previous_run_is_refused_naming_both_runs_and_nothing_is_written(shm_directory):
    # The worker's tensors before the update: 7.0 everywhere, written out here, not read back from anything.
    dest = {name: torch.full(shape, 7.0, dtype=dtype) for name, (shape, dtype) in LAYOUT.items()}
    transport = start_transport(shm_directory, LAYOUT, dest, run=RUN, bucket_nbytes=BUCKET_NBYTES,
                                wait_s=WAIT_S)
    update, thread, raised = transport.update, transport.thread, transport.raised
    try:
        conn = transport.listener.accept(timeout_s=WAIT_S)
        writer = BucketWriter(transport.buckets, conn, LAYOUT, run=STALE, verify=True,
                              ack_timeout_s=WAIT_S)
        with pytest.raises(ChannelError) as trainer_side:
            for name, (shape, dtype) in LAYOUT.items():
                writer.put(name, torch.ones(shape, dtype=dtype))
            writer.finish()
        writer.abandon()
        thread.join(WAIT_S)
        assert not thread.is_alive(), "the worker did not end its update"
    finally:
        transport.close()

    # The worker raised one error naming the message's run and its own.
    assert len(raised) == 1 and isinstance(raised[0], ValueError), raised
    message = str(raised[0])
    assert STALE in message and RUN in message and "'run'" in message, message
    # The trainer's stream broke: the worker's own error, or its closed channel where the trainer's next send
    # came before it read that error.
    assert trainer_side.value.kind in ("error", "closed"), trainer_side.value
    if trainer_side.value.kind == "error":
        assert STALE in str(trainer_side.value) and RUN in str(trainer_side.value), trainer_side.value
    # Nothing was written: the worker's tensors are still 7.0 everywhere.
    assert update.touched is False and update.received == {} and update.complete == []
    for name, (shape, dtype) in LAYOUT.items():
        assert torch.equal(dest[name], torch.full(shape, 7.0, dtype=dtype)), name
