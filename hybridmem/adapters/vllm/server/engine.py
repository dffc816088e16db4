"""VLLMServerEngine: a vLLM engine in its own process (``vllm serve``, or an AsyncLLM) as an InferenceEngine.

[Note: vllm server switch]
How a switch maps onto vLLM's RL API for an engine in another process (see [Note: vllm engine process]
in :mod:`hybridmem.adapters.vllm.server.client`):

- TRAIN->INFER: ``resume(["weights"])`` wakes the weights (a no-op on vLLM's CPU build, which has no
  sleep mode); the weight sync hands this rank's tensors of the vLLM layout, one complete tensor at a
  time, to :meth:`VLLMServerEngine.load_layout_weights`, which runs the update: rank 0 opens vLLM's update
  transaction (``start_weight_update``) and calls ``update_weights`` with every worker rank's info on a
  thread of its own, since it returns only once every worker has consumed its stream; meanwhile every
  rank packs its tensors into its two buckets for its own worker ([Note: vllm packing] in
  :mod:`hybridmem.adapters.vllm.server.packing`); the ranks then agree on the outcome. Then
  ``commit_weights()`` closes the transaction with the next version (``finish_weight_update``), resets the
  prefix cache, and the ranks agree again; ``resume(["kv_cache"])`` wakes the KV cache and resumes
  generation.
- INFER->TRAIN: ``release(["kv_cache"])`` pauses generation first, by the engine's policy for requests
  still running (:class:`InFlight`: let them finish, or abort them and count them), then sleeps;
  ``release(["weights"])`` sleeps the weights. Generation stays paused in TRAIN, so weights never change
  under a running request.

When several trainer ranks serve one engine (its tensor-parallel workers, one per device), each rank
streams its own worker's shards; rank 0 alone makes the control calls, and the ranks agree over
``group`` after the stream and after the commit, so all raise alike. A failed update leaves the engine
paused and its weights marked stale: it refuses to generate until a complete update succeeds, so it
never serves half-written weights. The buckets stay allocated in both phases ([Note: vllm buckets] in
:mod:`hybridmem.adapters.vllm.server.buckets`); the memory plan counts them (``buffer_nbytes()``).

[Note: vllm engine failures]
A call into the engine's process fails in one of three ways (:class:`~hybridmem.errors.EngineFault`, told
apart by the client, see [Note: vllm engine process] in :mod:`hybridmem.adapters.vllm.server.client`):
REFUSED, it answered with an error (alive, holding its memory); STALLED, no answer within the call's
deadline while its process is still there (holding its memory, and it may still act on the call later:
vLLM does not cancel a call its caller gave up on); DEAD, its process is gone and its memory with it.
Each is an :class:`~hybridmem.errors.EngineProcessError` naming the call, the engine and the fault,
raised inside a switch as ``SwitchEngineProcessError`` naming the step. No engine call touches the
trainer's params, grads or optimizer state. A stream that breaks is the ``update_weights`` call's
failure: a worker that closes its channel while it holds a bucket is DEAD when the engine's process is
gone, or found gone within ``DEATH_GRACE_S`` (vLLM answers the call with an error the moment a worker
dies, its engine core exits after): "vLLM worker rank r died while holding bucket i"; REFUSED otherwise;
its own error message (figures that read otherwise, a previous run's message) REFUSED; a worker that
does not connect or acknowledge within the deadline STALLED. Then:

- TRAIN->INFER failing at any call (``wake_up``, ``start_weight_update``, ``update_weights`` and its
  stream, ``finish_weight_update``, ``reset_prefix_cache``, ``resume``): the rollback undoes what the switch
  resumed (``release``: ``pause``, and ``sleep`` where vLLM can), each call under its deadline, and phase
  is TRAIN. The weights are marked stale from the moment the first update call may be sent, so the engine
  refuses to generate (:class:`~hybridmem.errors.PhaseError`) until a complete update succeeds; generation
  was paused when the engine last left INFER and is resumed only after one does. Where the undo's call
  fails too (a stalled engine does not answer the ``pause`` either), the rollback fails: FAILED, with a
  ``RollbackError`` whose cause is the step's error; ``recover()`` succeeds once the engine answers
  again or is killed. A dead engine's death found by the step is not raised again by the undo. A stream
  given up closes its channel, so the worker's ``update_weights`` fails at once; a worker that reaches a
  late ``update_weights`` of an update given up on finds its channel refusing it ([Note: vllm channel] in
  :mod:`hybridmem.adapters.vllm.server.channel`), so that call cannot hold the engine either.
- The next update first closes a transaction the failed one may have left open: vLLM refuses a start
  while one is open and a finish without one, and a stalled start or update may open or complete one
  after the trainer gave up. It sends ``finish_weight_update`` without a version and takes vLLM's refusal
  (nothing open) as done; the worker's finish never raises ([Note: vllm transfer backend] in
  :mod:`hybridmem.adapters.vllm.server.transfer`: vLLM keeps its session open when a backend's finish
  raises, and would refuse every later start), so this always closes an open session. Then a complete
  start / update / finish with the next version, and the prefix cache reset, rewrite every weight,
  whatever a late or partial update left. A ``finish_weight_update`` the engine refused is such a case.
- INFER->TRAIN: ``release`` pauses generation. A stalled engine fails it (phase FAILED): it still holds
  its memory and may still be generating; ``recover()`` pauses again and succeeds once the engine answers,
  or once it is killed. A dead engine's memory went with its process, so ``release`` counts its tags as
  released. It raises the death the first time it meets it (no call of the engine failed since the last
  one that succeeded): the switch fails into FAILED with ``fault`` DEAD, and ``recover()`` completes
  without the engine. Where an earlier call already failed (the rollback of a switch that failed on the
  engine, ``recover()`` after a stall, a ``generate`` that found it dead) it only logs a warning.

What the user does: REFUSED, the message carries the engine's error (its log has the rest); the next
switch tries again with a complete update. STALLED, resume the engine's process (``SIGCONT``) or kill it
(the engine core, or the server's process group), then ``recover()`` where the phase is FAILED, or switch
again from TRAIN. DEAD, ``recover()`` where the phase is FAILED; training goes on, and to generate again
close the manager, start an engine (:meth:`VLLMServerEngine.start_async`, ``launch``, ``connect``) and
build a manager on it. With several ranks, rank 0 makes every call; after the stream the ranks agree on
the lowest outcome (rank 0's calls and every rank's stream) and after the commit on rank 0's, so all
raise alike and the switch's vote rolls them back together; a failed ``release`` or ``resume`` call fails
rank 0 alone (in INFER->TRAIN the others reach TRAIN: ``recover()`` on rank 0).

[Note: vllm engine deadlines]
Every call has a deadline, sized by what the call waits for. A control call that moves no bulk data
(pause without running requests, sleep, wake-up, start, finish, reset, resume) gets the client's
``timeout_s`` (default 60 s; these take milliseconds on an idle 2-core machine with a small model, and the
default leaves room for a loaded one). ``update_weights`` runs while the trainer streams, so its waits are
the stream's: the worker's connection within ``timeout_s`` (another rank than 0 adds rank 0's calls before
the update, a close and a start); each acknowledgement within ``timeout_s`` plus a bucket and the largest
module's bytes at :data:`UPDATE_MIN_BPS` (the worker copies the bucket, and may process a module the
previous one completed); then the call's answer within ``timeout_s`` plus this rank's layout bytes at
:data:`UPDATE_MIN_BPS` (the tensor-parallel workers end their streams together). Producing the stream
(the weight sync's own collectives) has the sync's deadline. The call itself, on its thread, has none
of its own: the switch that gives up closes the channel, and the worker's update then fails at once.
``pause`` that lets requests of this engine's callers finish (:attr:`InFlight.WAIT` with some in flight)
adds their own deadline, the client's ``generate_timeout_s``. The ranks' agreements wait ``timeout_s`` of
the engine (how far apart the ranks may get) plus the sum of rank 0's call deadlines in between.

When the error comes: a refusal at once; a stall at the call's deadline (over HTTP plus the ``/health``
probe's :data:`~hybridmem.adapters.vllm.server.client.PROBE_S` that tells it from a death); an
AsyncLLM's engine core that dies while a call waits within
:data:`~hybridmem.adapters.vllm.server.client.POLL_S`, and a worker that dies while it holds a bucket at
once (its channel closes); a ``vllm serve`` engine core that dies under a waiting call at that call's
deadline (the server keeps the call open, ``/health`` then names the death). A switch whose rollback
calls a stalled engine again waits once more (``tests/adapters/test_vllm_server_faults.py`` measures each
case).

[Note: vllm fp8 server]
A served model whose config has FP8 with 128x128 blocks (``quantization_config``, read with
:func:`~hybridmem.reshard.fp8.block_from_hf_config`; an FP8 checkpoint as the Hub has them) makes the engine
declare ``reports_quantization`` and expose that config, so the resharding sync hands
:meth:`VLLMServerEngine.load_layout_weights` this rank's shard already quantized, scales included ([Note:
fp8 sync] in :mod:`hybridmem.weight_sync.fp8`); :attr:`VLLMServerEngine.dtype` is then the dtype of the
tensors vLLM does not quantize. The rest is the same stream: an e4m3 tensor travels as its bytes, one a
element, its dtype named ``float8_e4m3fn`` in the messages, its figures read as numbers
(:func:`~hybridmem.reshard.checksum.tensor_checksum`); the packer never casts to or from e4m3 (a cast there
would quantize without scales). The worker writes the shard into its FP8 modules' load-time tensors
(``weight`` in e4m3, ``weight_scale_inv`` in float32, the checkpoint's form vLLM records before its
post-load processing) and runs their ``quant_method.process_weights_after_loading`` again ([Note: vllm
transfer backend] in :mod:`hybridmem.adapters.vllm.server.transfer`), so a kernel that re-lays weights or
scales after loading (vLLM's CPU build, DeepGEMM's scale formats) re-lays each update's as it did the
checkpoint's. Refused by name: another quantization (another method, FP8 per tensor, another block) when the
engine is built, before it is asked anything; a worker whose load-time layout does not hold the FP8 block
form (no scales: the server was told another ``--quantization``; a scale or weight of another dtype) once
the workers report it (:func:`check_fp8_layout`); the rest when the sync is built, as [Note: fp8 sync] in
:mod:`hybridmem.weight_sync.fp8` says. vLLM builds FP8 linear layers on a CPU only with its AMX kernel, so a
``vllm serve`` of an FP8 model needs a GPU (or such a CPU); ``tests/adapters/test_vllm_server_fp8.py``
checks the transport, and vLLM's own FP8 classes with only their GEMM kernel stood in.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from typing import Any

import torch

from hybridmem.accel import Accelerator, get_accelerator
from hybridmem.adapters.vllm.busy_poll import default_busy_poll
from hybridmem.adapters.vllm.names import sync_rule
from hybridmem.adapters.vllm.outputs import GREEDY
from hybridmem.adapters.vllm.plugin import BACKEND_NAME
from hybridmem.adapters.vllm.quantization import quantization_config_of, served_fp8_block
from hybridmem.adapters.vllm.server.buckets import (
    Buckets,
    bucket_limit,
    check_bucket_nbytes,
    default_bucket_nbytes,
    dtype_of,
    one_thread,
)
from hybridmem.adapters.vllm.server.channel import POLL_S, ChannelError, Listener, channel_path, send_abort
from hybridmem.adapters.vllm.server.client import VLLMClient
from hybridmem.adapters.vllm.server.packing import BucketWriter, StreamStats
from hybridmem.adapters.vllm.server.ranks import EngineRanks, engine_ranks
from hybridmem.adapters.vllm.server.update import BackgroundCall, stream_error
from hybridmem.contract.engine import EngineCapabilities, check_tags
from hybridmem.contract.generation import GenerationOutput
from hybridmem.contract.kinds import ENGINE_TAGS, KV_CACHE, WEIGHTS
from hybridmem.errors import EngineFault, EngineProcessError, PhaseError, add_note
from hybridmem.reshard.fp8 import FP8_DTYPE, SCALE_SUFFIX

__all__ = ["VLLMServerEngine", "InFlight", "UPDATE_MIN_BPS"]

log = logging.getLogger(__name__)

UPDATE_MIN_BPS = 50e6
"""The slowest rate at which a worker is expected to take streamed bytes (see [Note: vllm engine
deadlines]): it copies them out of a bucket and its backend repacks them, several GB/s on a quiet
machine; measured 0.2 GB/s for a 1.4 MB model on a 2-core one, where per-call costs dominate."""

WORKER_WAIT_S = 1800.0
"""The longest a worker waits for its trainer rank's next message (a trainer that dies closes the
channel at once; this bounds one that hangs)."""

DEATH_GRACE_S = 5.0
"""How long a stream whose worker closed its channel while holding a bucket waits for the engine to be
found gone before it counts the close as a refusal: vLLM answers ``update_weights`` with an error
("collective_rpc ... cancelled") as soon as a worker dies, and its engine core exits a moment later."""
_OUTCOME = {None: 1.0, EngineFault.REFUSED: 0.0, EngineFault.STALLED: -1.0, EngineFault.DEAD: -2.0}
"""A rank's outcome of an update as the number the ranks agree on (any other error: -3)."""


class InFlight(Enum):
    """What leaving INFER does to requests still running (see [Note: vllm server switch])."""

    WAIT = "wait"
    """Let them finish with the weights they started with; the switch waits for them."""
    ABORT = "abort"
    """Abort them (their outputs end with finish reason ``abort``); :attr:`VLLMServerEngine.last_aborted`
    counts them."""


class VLLMServerEngine:
    """A vLLM engine in another process, driven through vLLM's RL API (see [Note: vllm server switch]).

    Build it with :meth:`connect` (a running ``vllm serve``) or :meth:`start_async` (an AsyncLLM made here,
    its engine core a separate process); either must have been started with hybridmem's weight-transfer
    backend (``--weight-transfer-config '{"backend": "hybridmem"}'``).

    Args:
        client: The control plane (:class:`~hybridmem.adapters.vllm.server.client.HTTPClient` or
            :class:`~hybridmem.adapters.vllm.server.client.AsyncLLMClient`).
        hf_config: The served model's transformers config (its family, vocab, dtype).
        group: The trainer ranks serving this engine, one per worker rank in order (``None``: this process
            alone, for an engine with one worker).
        in_flight: What leaving INFER does to running requests (:class:`InFlight`).
        sleep_level: vLLM's sleep level on release (2: weights discarded, rewritten by every sync; 1: kept
            in host memory). Ignored where vLLM has no sleep mode (its CPU build).
        verify: Send each tensor's figures with the bucket that completes it; the workers refuse a tensor
            that reads otherwise (see [Note: vllm packing] in :mod:`hybridmem.adapters.vllm.server.packing`).
        staging_dir: Where the engine's shared directory goes (``/dev/shm``: RAM, shared with the engine's
            processes): the CPU buckets, the channels' sockets.
        bucket_nbytes: Bytes per bucket (two per rank, [Note: vllm buckets] in
            :mod:`hybridmem.adapters.vllm.server.buckets`); ``None``: 64 MiB on CPU, on CUDA a sixteenth of
            the device's free memory, at most 1 GiB.
        timeout_s: Deadline of the ranks' agreement around an update.
        frees_memory: Whether sleeping frees device memory; ``None``: unless vLLM runs on its CPU build
            (its sleep frees nothing).
        accel: Where the trainer's buckets live (the trainer rank's device); measures what wake-ups take
            (co-located: the same device).
        release_now: Release both tags at construction, as :class:`~hybridmem.ShardingManager` expects.

    Raises:
        ValueError: ``bucket_nbytes`` below one page, a device without a bucket path (NPU), or ``group`` of
            another size than the engine's workers; checked before the engine is asked anything.
        MemoryError: Two buckets per rank do not fit the shared directory (CPU) or the device (CUDA).
        EngineProcessError: The engine does not answer, or was not started with the hybridmem backend.
    """

    def __init__(self, client: VLLMClient, *, hf_config: Any, group: Any = None,
                 in_flight: InFlight | str = InFlight.WAIT, sleep_level: int = 2, verify: bool = True,
                 staging_dir: str = "/dev/shm", bucket_nbytes: int | None = None, timeout_s: float = 120.0,
                 frees_memory: bool | None = None, accel: Accelerator | str | None = None,
                 release_now: bool = True):
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level={sleep_level}; expected 1 or 2")
        self.fp8_block = served_fp8_block(hf_config, f"at {client.where}")
        """The FP8 block the served model holds its weights in (``(128, 128)``), or ``None``: unquantized (see
        [Note: vllm fp8 server])."""
        self.client = client
        self.hf_config = hf_config
        self.group = group
        self.in_flight = InFlight(in_flight)
        self.sleep_level = int(sleep_level)
        self.verify = bool(verify)
        self.timeout_s = float(timeout_s)
        self.accel = get_accelerator("auto" if accel is None else accel)
        self.ranks = EngineRanks(group, accel=self.accel, timeout_s=self.timeout_s)
        self.rank, self.world_size = self.ranks.rank, self.ranks.size
        # Checked before the engine is asked anything: building an engine re-initialises the workers'
        # transfer backend, which a running engine on the same client would then find gone.
        self.bucket_nbytes = _bucket_nbytes(bucket_nbytes, self.accel.device, staging_dir, self.world_size)
        workers = client.world_size()
        if workers != self.world_size:
            raise ValueError(f"the engine at {client.where} runs {workers} workers but group has "
                             f"{self.world_size} ranks: one trainer rank per worker (pass the group of the "
                             f"ranks it serves)")
        self.frees_memory = (self.accel.name != "cpu") if frees_memory is None else bool(frees_memory)
        self.capabilities = EngineCapabilities(
            frees_memory=self.frees_memory, memory_note=self.memory_note, streams_layout=True,
            offers_layout_targets=True,
            reports_weight_coverage=True, reports_residency=True, stages_weights=True, checks_weights=True,
            describes_weights=True, reports_model_type=True, reports_layout=True, holds_buffers=True,
            reports_quantization=self.fp8_block is not None,
        )
        """See [Note: engine capabilities] in :mod:`hybridmem.contract.engine`."""
        self.directory = self.ranks.shared_directory(staging_dir)
        self.run = os.path.basename(self.directory)
        """This engine's run id: the workers refuse an update or bucket message of another."""
        self.buckets: Buckets | None = None
        self.listener: Listener | None = None
        self._writer: BucketWriter | None = None
        """The open stream's writer, while :meth:`load_layout_weights` reads its stream."""
        try:
            self.buckets = Buckets(self.directory, self.rank, bucket_nbytes=self.bucket_nbytes,
                                   device=self.accel.device)
            self.listener = Listener(channel_path(self.directory, self.rank), self.rank, run=self.run)
            self.layout = self._init_workers()
            if self.fp8_block is not None:
                check_fp8_layout(self.layout, f"the vLLM worker of rank {self.rank} at {client.where}")
        except BaseException:
            self._close_transport()
            raise
        self._max_module_nbytes = _max_module_nbytes(self.layout)
        self.version = 0
        """Updates committed so far; the engine's weight version is ``f"hybridmem-{version}"``."""
        self.control_log: collections.deque[tuple[str, float]] = collections.deque(maxlen=256)
        """``(call, seconds)`` of the latest control calls this rank made, the wait for ``update_weights``'s
        answer once the stream ended included (what a switch pays whatever the model's size)."""
        self.last_aborted = 0
        """Requests the last release aborted (policy :attr:`InFlight.ABORT`)."""
        self.last_stream: StreamStats | None = None
        """What this rank's last complete stream moved."""
        self._in_flight = 0
        self._state = {t: True for t in ENGINE_TAGS}  # resident
        self._current = True  # the served weights are the last committed ones
        self._loaded = False  # a complete stream since the weights were resumed, not committed yet
        self._written: set[str] = set()
        self._load_s = 0.0
        self._trouble = False  # the last control call failed ([Note: vllm engine failures])
        self._update_open = False  # a failed update may have left vLLM's update transaction open
        self._paused = False  # a pause was sent and no resume since: requests would wait for the next resume
        self._nbytes = {t: 0 for t in ENGINE_TAGS}
        if release_now:
            self.release(list(ENGINE_TAGS))

    # Construction -----------------------------------------------------------------------------------
    @classmethod
    def connect(cls, base_url: str, *, hf_config: Any = None, timeout_s: float = 60.0,
                server_log: str | None = None, **kwargs: Any) -> VLLMServerEngine:
        """The engine of a running ``vllm serve`` at ``base_url`` (started with ``VLLM_SERVER_DEV_MODE=1``
        and ``--weight-transfer-config '{"backend": "hybridmem"}'``; each is checked, [Note: vllm server
        contact] in :mod:`hybridmem.adapters.vllm.server.contact`).

        Args:
            base_url: E.g. ``http://127.0.0.1:8000``.
            hf_config: The served model's config (default: read from the model directory the server
                reports, relative to the server's working directory).
            timeout_s: Deadline of each control call.
            server_log: The server's log file, named in every error and switch report (:meth:`launch`
                passes its own).
            kwargs: The constructor's options (``in_flight``, ``verify``, ``group``, ...).

        Raises:
            EngineSetupError: Nobody listens at ``base_url``, or the server lacks what the engine needs
                (``VLLM_SERVER_DEV_MODE=1``, hybridmem's backend), or the model's config was not found
                (pass ``hf_config=``); one line naming it.
            EngineProcessError: The server does not answer, or its engine is dead.
        """
        from hybridmem.adapters.vllm.server.client import HTTPClient  # noqa: PLC0415
        from hybridmem.adapters.vllm.server.contact import backend_problem, check_server  # noqa: PLC0415

        client = HTTPClient(base_url, timeout_s=timeout_s, log_path=server_log)
        try:
            hf_config = check_server(client, hf_config=hf_config)
            try:
                return cls(client, hf_config=hf_config, timeout_s=max(timeout_s, 120.0), **kwargs)
            except EngineProcessError as exc:
                problem = (backend_problem(client) if exc.call == "init_weight_transfer_engine"
                           and exc.fault is EngineFault.REFUSED else None)
                if problem is None:
                    raise
                raise problem from exc
        except BaseException:
            client.close()
            raise

    @classmethod
    def start_async(cls, model: str, *, timeout_s: float = 60.0,
                    engine_kwargs: Mapping[str, Any] | None = None,
                    **async_engine_args: Any) -> VLLMServerEngine:
        """Start an ``AsyncLLM`` for ``model`` (a directory) here, its engine core in a process of its own,
        with hybridmem's weight-transfer backend; ``async_engine_args``: more ``AsyncEngineArgs``.

        Raises:
            ValueError: ``model`` is no directory (nor a hub model), or holds no tokenizer files without
                ``skip_tokenizer_init=True``; before vLLM starts ([Note: vllm model source] in
                :mod:`hybridmem.adapters.vllm.source`).
        """
        from hybridmem.adapters.vllm.source import check_model_source  # noqa: PLC0415

        check_model_source(str(model), dict(async_engine_args))
        from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415

        from hybridmem.adapters.vllm.server.client import AsyncLLMClient  # noqa: PLC0415

        args = AsyncEngineArgs(model=str(model), weight_transfer_config={"backend": BACKEND_NAME},
                               **async_engine_args)
        # vLLM's processes, spawned from this one, take its environment ([Note: vllm busy poll] in
        # :mod:`hybridmem.adapters.vllm.busy_poll`)
        default_busy_poll(os.environ, on_cpu=get_accelerator("auto").name == "cpu")
        client = AsyncLLMClient(args, timeout_s=timeout_s)
        return cls(client, hf_config=_config_of(str(model)), **dict(engine_kwargs or {}))

    server: Any = None
    """The ``vllm serve`` process :meth:`launch` started (on rank 0 of the engine's ranks; else ``None``)."""

    @classmethod
    def launch(cls, model_dir: str, *, tensor_parallel_size: int = 1, group: Any = None,
               port: int | None = None, server_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
               startup_timeout_s: float | None = None, **engine_kwargs: Any) -> VLLMServerEngine:
        """Start ``vllm serve`` for ``model_dir`` and connect to it (see [Note: vllm server process] in
        :mod:`hybridmem.adapters.vllm.server.process`); :meth:`close` stops it, and it never outlives this
        process.

        Call it on every rank of ``group`` (the trainer ranks serving the engine, one per tensor-parallel
        worker; ``None``: this process alone): rank 0 starts the server and the others get its URL.

        Args:
            model_dir: The model's directory (``save_pretrained``); without tokenizer files the server
                skips its tokenizer (generation takes token ids).
            tensor_parallel_size: The server's TP size: ``group``'s size.
            group: See above.
            port: The server's port on 127.0.0.1 (default: a free one).
            server_args: More ``vllm serve`` flags, e.g. ``["--dtype", "float32", "--max-model-len", "256"]``.
            env: More environment variables for the server.
            startup_timeout_s: How long rank 0 waits for the server to answer ``/health``.
            engine_kwargs: :meth:`connect`'s and the constructor's options (``in_flight``, ``verify``, ...).

        Raises:
            ValueError: ``model_dir`` is no directory (nor a hub model: one line with the nearest directory,
                before anything starts), ``group``'s size is not ``tensor_parallel_size``, or
                ``server_args`` sets a flag ``launch`` sets itself.
            EngineProcessError: The server exited or did not answer in time (its log's last lines shown).
        """
        from hybridmem.adapters.vllm.server.process import (  # noqa: PLC0415
            DEFAULT_STARTUP_TIMEOUT_S,
            launch_server,
        )

        _, size = engine_ranks(group)
        if size != tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} with a group of {size} ranks: one "
                             f"trainer rank per vLLM worker (pass the group of the {tensor_parallel_size} "
                             f"ranks it serves)")
        url, server = launch_server(str(model_dir), tensor_parallel_size=tensor_parallel_size, group=group,
                                    port=port, server_args=server_args, env=env,
                                    startup_timeout_s=startup_timeout_s or DEFAULT_STARTUP_TIMEOUT_S)
        log_path = None if server is None else server.log_path
        if size > 1:  # every rank's errors name the server's log
            import torch.distributed as dist  # noqa: PLC0415

            box = [log_path]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
            log_path = box[0]
        try:
            engine = cls.connect(url, group=group, server_log=log_path, **engine_kwargs)
        except BaseException:
            if server is not None:
                server.stop()
            raise
        engine.server = server
        return engine

    def _init_workers(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Initialise the workers' transfer backend (rank 0, with every rank's buckets and channel) and read
        this rank's worker's weights at their load-time shapes, as the worker reports them: its parameters
        but those no sync writes (a multimodal model's vision tower) and the persistent buffers the layout
        names (Gemma 4's ``layer_scalar``), the rule of [Note: vllm name check] in
        :mod:`hybridmem.adapters.vllm.names` applied by the worker."""
        assert self.buckets is not None and self.listener is not None, "the transport comes first"
        mine = {"channel": self.listener.path, "buckets": self.buckets.descriptor()}
        everyone = self.ranks.gather(mine, what="every rank's buckets")
        if self.rank == 0:
            weight_names, not_synced = sync_rule(self.hf_config, self.world_size)
            self.client.init_weight_transfer_engine({
                "run": self.run, "layout_dir": self.directory, "bucket_nbytes": self.bucket_nbytes,
                "ranks": everyone, "wait_s": WORKER_WAIT_S, "weight_names": weight_names,
                "not_synced": not_synced})
        self.ranks.barrier("the engine's layout")
        path = os.path.join(self.directory, f"layout-rank{self.rank}.json")
        with open(path) as f:
            report = json.load(f)
        os.unlink(path)  # the shared directory holds the buckets alone
        return {name: (tuple(shape), dtype_of(dtype)) for name, shape, dtype in report["params"]}

    # Capabilities -----------------------------------------------------------------------------------
    @property
    def memory_note(self) -> str:
        if self.frees_memory:
            return f"vLLM sleep mode (level {self.sleep_level}) in the engine's process"
        return "vLLM CPU backend has no sleep mode: release and resume free and take no memory"

    @property
    def model_type(self) -> str | None:
        value = getattr(self.hf_config, "model_type", None)
        return value if isinstance(value, str) else None

    @property
    def vocab_size(self) -> int | None:
        value = getattr(self.hf_config, "vocab_size", None)
        return value if isinstance(value, int) else None

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype holding most of the worker's elements; of an FP8 model, of those it does not quantize
        (the e4m3 weights and their scales aside)."""
        kept = {n: v for n, v in self.layout.items()
                if self.fp8_block is None or not (v[1] == FP8_DTYPE or n.endswith(SCALE_SUFFIX))}
        dtypes = {dtype for _, dtype in kept.values()}
        if not dtypes:
            return None
        return max(dtypes, key=lambda d: sum(math.prod(s) for s, t in kept.values() if t == d))

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        """The served model's ``quantization_config`` (FP8 with 128x128 blocks; ``None``: unquantized), as
        its config has it (see [Note: vllm fp8 server])."""
        return quantization_config_of(self.hf_config)

    @property
    def parallel_layout(self) -> dict[str, int]:
        return {"tp": self.world_size, "pp": 1}

    def check_weights(self, expected: Mapping[str, Any], *, what: str = "the weight sync's layout") -> None:
        """Compare what a weight sync will write with this rank's worker's load-time layout.

        Raises:
            ValueError: A name on one side only, or a differing shape; names both sides.
        """
        want = {n: tuple(int(s) for s in getattr(v, "shape", v)) for n, v in expected.items()}
        have = {n: shape for n, (shape, _) in self.layout.items()}
        if want != have:
            extra = sorted(set(want) - set(have))[:4]
            missing = sorted(set(have) - set(want))[:4]
            shapes = [f"{n}: worker {have[n]} vs {want[n]}" for n in want
                      if n in have and have[n] != want[n]][:4]
            raise ValueError(f"the vLLM worker of rank {self.rank} at {self.client.where} does not match "
                             f"{what}: not in the worker {extra}, never written {missing}, shapes {shapes}")

    # InferenceEngine --------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Not offered: the weights reach this engine in the vLLM layout (:meth:`load_layout_weights`).

        Raises:
            TypeError: Always.
        """
        del weights
        raise TypeError("VLLMServerEngine takes weights in the vLLM layout through the resharding weight "
                        "sync (ShardingManager builds one when the model's config is known); pass "
                        "model_spec= if it is not")

    def load_layout_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream this rank's tensors of the vLLM layout, complete ones, to its worker in one update (see
        [Note: vllm server switch]); call it on every rank of ``group``, then :meth:`commit_weights`.

        Raises:
            PhaseError: The weights are released.
            ValueError: A tensor the worker's layout does not have, or of another shape.
            EngineProcessError: The update failed in the engine, on this rank's stream or another's (the
                engine then refuses to generate until a complete update succeeds).
        """
        if self._state[WEIGHTS] is not True:
            raise PhaseError("load weights into vLLM", "released", "resume(['weights']) first")
        assert self.buckets is not None and self.listener is not None, "the engine is closed"
        start = time.perf_counter()
        generation = self.version + 1
        self._current = False
        self._loaded = False
        self._written = set()
        self.listener.expect(self.run, generation)
        stream = iter(weights)
        call: BackgroundCall | None = None
        error: BaseException | None = None
        writer: BucketWriter | None = None
        stats: StreamStats | None = None
        try:
            if self.rank == 0:
                if self._update_open:  # [Note: vllm engine failures]
                    self._close_update()
                self._update_open = True
                self._control("start_weight_update")
                info = {"run": self.run, "generation": generation, "verify": self.verify}
                call = BackgroundCall(self.client.update_weights,
                                      [info] * self.world_size if self.world_size > 1 else info,
                                      name="update_weights")
            watch = call.watch if call is not None else None
            conn = self.listener.accept(timeout_s=self._deadline_s("connect"), watch=watch)
            writer = BucketWriter(self.buckets, conn, self.layout, run=self.run,
                                  verify=self.verify,
                                  ack_timeout_s=self._deadline_s("acknowledge"), watch=watch)
            self._writer = writer
            with one_thread(self.buckets.device):
                for name, tensor in stream:
                    writer.put(name, tensor)
            stats = writer.finish()
            conn.close()
            if call is not None:
                answered = time.perf_counter()
                self._await(call, self._deadline_s("update_weights"), start)
                self.control_log.append(("update_weights", time.perf_counter() - answered))
        except BaseException as exc:  # the other ranks hear of it first, then it is raised
            holding = [] if writer is None else writer.holding()
            if writer is not None:
                writer.abandon()
            if isinstance(exc, Exception):  # the other ranks' streams need this one's part of the plan
                _drain(stream)
            error = self._update_error(exc, call, holding, connected=writer is not None, start=start)
            if self.rank == 0 and writer is None:  # the others may still wait for their workers
                for r in range(1, self.world_size):
                    send_abort(channel_path(self.directory, r), generation, str(error)[:500])
        finally:
            self._writer = None
            self.listener.expect(None)
        self._agree(error, start, what="every rank's stream", deadline_s=self.timeout_s + sum(
            self._deadline_s(c) for c in ("finish_weight_update", "start_weight_update", "connect",
                                          "update_weights")))
        self._written = set(writer.written) if writer is not None else set()
        self.last_stream = stats
        self._loaded = True
        self._load_s = time.perf_counter() - start

    def layout_target(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """While :meth:`load_layout_weights` reads its stream: the bucket bytes the stream's next tensor,
        ``name``, will be sent from, to build it in (``None``: build it elsewhere; see [Note: vllm packing]
        in :mod:`hybridmem.adapters.vllm.server.packing`)."""
        return None if self._writer is None else self._writer.reserve(name, shape, dtype)

    def commit_weights(self) -> dict[str, Any]:
        """Close the update :meth:`load_layout_weights` streamed with the next version, and reset the prefix
        cache (see [Note: vllm server switch]).

        Returns:
            What the switch report shows: ``engine_update_nbytes`` (this rank's streamed bytes, what its
            worker took), ``engine_update_s``, ``weight_version``, ``engine_buckets_handed``,
            ``engine_stream_s`` (packing until the worker took the last bucket), of which
            ``engine_checksum_s`` (the figures read apart from a copy, trainer side: tensors built in their
            bucket), and on the worker's own clock ``engine_worker_copy_s`` (its copies out of the buckets,
            the figures taken on the way) and ``engine_worker_checksum_s`` (figures read apart from them);
            ``engine_log``, the server's log file, where the engine knows it.

        Raises:
            RuntimeError: No complete stream since the weights were resumed.
            EngineProcessError: The engine refused or failed a call (the engine then refuses to generate
                until a complete update succeeds), on rank 0 or, as it reports, on another rank.
        """
        if not self._loaded or self.last_stream is None:
            raise RuntimeError(f"rank {self.rank}: commit_weights with no complete load_layout_weights since "
                               f"the weights were resumed")
        start = time.perf_counter()
        error: BaseException | None = None
        if self.rank == 0:
            try:
                self._control("finish_weight_update", f"hybridmem-{self.version + 1}")
                self._update_open = False
                self._control("reset_prefix_cache")
            except BaseException as exc:  # the other ranks hear of it first, then it is raised
                error = exc
        self._agree(error, start, what="the update's outcome", reduce=False, deadline_s=self.timeout_s + sum(
            self._deadline_s(c) for c in ("finish_weight_update", "reset_prefix_cache")))
        self._loaded = False
        self.version += 1
        self._current = True
        log_path = getattr(self.client, "log_path", None)
        return {**({"engine_log": log_path} if log_path else {}),
                "engine_update_nbytes": self.last_stream.nbytes,
                "engine_update_s": self._load_s + time.perf_counter() - start,
                "weight_version": f"hybridmem-{self.version}",
                "engine_buckets_handed": self.last_stream.num_handed,
                "engine_stream_s": self.last_stream.seconds,
                "engine_checksum_s": self.last_stream.checksum_s,
                "engine_worker_checksum_s": self.last_stream.worker_checksum_s,
                "engine_worker_copy_s": self.last_stream.worker_copy_s}

    def unwritten_weights(self) -> list[str]:
        """The tensors of this rank's layout the last :meth:`load_layout_weights` did not write ([Note: weight
        coverage] in :mod:`hybridmem.weight_sync`)."""
        return [n for n in self.layout if n not in self._written]

    def buffer_nbytes(self) -> int:
        """Bytes of this rank's buckets (on its device; host RAM on CPU), held in both phases."""
        return 0 if self.buckets is None else self.buckets.nbytes

    def release(self, tags: Sequence[str]) -> None:
        """Pause generation (by :attr:`in_flight`) when the KV cache goes, then sleep where vLLM can.

        Raises:
            EngineProcessError: A call failed; a dead engine's tags are released all the same (see [Note:
                vllm engine failures]), and its death is raised only where no earlier call had failed.
        """
        wanted = [t for t in check_tags(tags) if self._state[t]]
        if not wanted:
            return
        if KV_CACHE in wanted:
            self._paused = True
            if self.world_size > 1:  # every rank may send requests: pause once all of them have left INFER
                self.ranks.broadcast_flag(1.0, what="every rank's generation before the pause", reduce=True,
                                     deadline_s=self.client.generate_timeout_s + self.timeout_s)
        if self.rank == 0:
            news = not self._trouble and self.client.dead is None
            try:
                if KV_CACHE in wanted:
                    self.last_aborted = self._in_flight if self.in_flight is InFlight.ABORT else 0
                    self._control("pause", self.in_flight.value, timeout_s=self._deadline_s("pause"))
                if self.frees_memory:
                    self._control("sleep", self.sleep_level)
            except EngineProcessError as exc:
                if not exc.dead:
                    raise
                for tag in wanted:  # the memory went with the process
                    self._state[tag] = False
                self._current = False
                log.warning("hybridmem: the vLLM engine at %s is gone; its %s count as released",
                            self.client.where, wanted)
                if news:
                    raise
                return
        for tag in wanted:
            self._state[tag] = False
        if WEIGHTS in wanted and self.sleep_level == 2 and self.frees_memory:
            self._current = False

    def resume(self, tags: Sequence[str]) -> None:
        """Wake ``tags``, weights before KV cache; generation resumes with the KV cache."""
        order = [t for t in ENGINE_TAGS if t in check_tags(tags) and not self._state[t]]
        for tag in order:
            if self.rank == 0 and self.frees_memory:
                free_before = self.accel.memory_figures().free_nbytes
                self._control("wake_up", [tag])
                self._nbytes[tag] = max(0, free_before - self.accel.memory_figures().free_nbytes)
            self._state[tag] = True
        if KV_CACHE in order and self._current:
            if self.rank == 0:
                self._control("resume_generation")
            self._paused = False

    def resident_nbytes(self, tag: str) -> int:
        tag = check_tags([tag])[0]
        return self._nbytes[tag] if self._state[tag] else 0

    def planned_nbytes(self, tag: str) -> int:
        tag = check_tags([tag])[0]
        return 0 if self._state[tag] else self._nbytes[tag]

    # Inference --------------------------------------------------------------------------------------
    def _check_serving(self, what: str) -> None:
        if self.client.dead is not None:
            raise PhaseError(what, "dead", f"the engine's process is gone ({self.client.dead}); start "
                             f"another engine and build a manager on it")
        for tag in ENGINE_TAGS:
            if not self._state[tag]:
                raise PhaseError(what, "released", f"{tag!r} is not resident; use the engine inside "
                                 f"`with manager.inference()`")
        if self._paused:
            raise PhaseError(what, "paused", "generation was paused by a switch that did not finish; it "
                             "resumes with the next switch to INFER")
        if not self._current:
            raise PhaseError(what, "stale", "the engine's weights were not updated since a failed or "
                             "interrupted update; it refuses to serve until a complete update")

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: Any = None) -> list[GenerationOutput]:
        """Generate from token-id prompts, all at once in the engine.

        Raises:
            PhaseError: Outside INFER, or after a failed update.
        """
        self._check_serving("generate with the vLLM engine")
        params = GREEDY if params is None else params
        self._in_flight += len(prompt_ids)
        try:
            return self.client.generate(prompt_ids, params)
        finally:
            self._in_flight -= len(prompt_ids)

    async def agenerate(self, prompt_ids: Sequence[int], params: Any = None, *,
                        index: int = 0) -> GenerationOutput:
        """One request, awaitable: for agent loops running many trajectories at once inside
        ``manager.inference()``."""
        self._check_serving("generate with the vLLM engine")
        params = GREEDY if params is None else params
        self._in_flight += 1
        try:
            return await self.client.agenerate(prompt_ids, params, index=index)
        finally:
            self._in_flight -= 1

    def weight_version(self) -> str:
        """The version the engine serves now (it says so itself)."""
        return self.client.weight_version()

    # Internals --------------------------------------------------------------------------------------
    def _control(self, call: str, *args: Any, **kwargs: Any) -> Any:
        """Control call ``call`` of the client; remembers whether it failed ([Note: vllm engine failures])."""
        start = time.perf_counter()
        try:
            result = getattr(self.client, call)(*args, **kwargs)
        except BaseException:
            self._trouble = True
            raise
        finally:
            self.control_log.append((call, time.perf_counter() - start))
        self._trouble = False
        return result

    def _await(self, call: BackgroundCall, timeout_s: float, start: float) -> None:
        """The answer of ``update_weights`` running in the background: its error, or a stall past
        ``timeout_s``."""
        if not call.wait(timeout_s):
            self._trouble = True
            raise self.client.failure("update_weights", deadline_s=timeout_s,
                                      elapsed_s=time.perf_counter() - start,
                                      cause="no answer once every bucket was taken")
        self._trouble = call.error is not None
        call.watch()

    def _update_error(self, exc: BaseException, call: BackgroundCall | None, holding: list[int], *,
                      connected: bool, start: float) -> BaseException:
        """The error a failed :meth:`load_layout_weights` raises: on rank 0 the ``update_weights`` call's own
        where it failed (its cause is vLLM's account), else the broken stream as [Note: vllm engine failures]
        says (``holding``: the buckets the worker held)."""
        if isinstance(exc, ChannelError) and exc.kind == "abort":
            return exc  # rank 0's error is the one the ranks agree on
        if call is not None and isinstance(exc, ChannelError) and exc.kind in ("error", "closed"):
            call.wait(self.timeout_s)  # the worker failed: vLLM answers the call at once
        died = self._died(exc, call, holding)
        if call is not None and call.error is not None:
            self._trouble = True
            error = call.error
            if died:  # named with the buckets it held, whichever the stream saw first
                broken = exc if isinstance(exc, ChannelError) else ChannelError(
                    "closed", "its engine's process exited while the stream waited")
                named = stream_error(broken, rank=self.rank, holding=holding, where=self.client.where,
                                     deadline_s=error.deadline_s, start=start, gone=lambda: True)
                named.__cause__ = error
                return named
            return error
        if isinstance(exc, ChannelError):
            self._trouble = True
            deadline = self._deadline_s("acknowledge" if connected else "connect")
            return stream_error(exc, rank=self.rank, holding=holding, where=self.client.where,
                                deadline_s=deadline, start=start, gone=lambda: died or self.client.gone())
        return exc

    def _died(self, exc: BaseException, call: BackgroundCall | None, holding: list[int]) -> bool:
        """Whether the stream broke because its worker died while holding ``holding``: its channel closed
        without a word (or the call failed meanwhile) and the engine's process is gone, or found gone
        within :data:`DEATH_GRACE_S` (see [Note: vllm engine failures])."""
        if not holding:
            return False
        closed = isinstance(exc, ChannelError) and exc.kind == "closed"
        if not closed and not (call is not None and exc is call.error):
            return False
        if call is not None and isinstance(call.error, EngineProcessError) and call.error.dead:
            return True
        deadline = time.monotonic() + DEATH_GRACE_S
        while not self.client.gone():
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
        return True

    def _agree(self, error: BaseException | None, start: float, *, what: str, deadline_s: float,
               reduce: bool = True) -> None:
        """Every rank's outcome (``reduce``: the lowest of them; else rank 0's) on every rank; raise this
        rank's error, or the agreed one where another rank failed (see [Note: vllm engine failures])."""
        if error is None:
            code = 1.0
        else:
            code = _OUTCOME[error.fault] if isinstance(error, EngineProcessError) else -3.0
        try:
            code = self.ranks.broadcast_flag(code, what=what, reduce=reduce, deadline_s=deadline_s)
        except Exception as lost:
            if error is None:
                raise
            add_note(error, f"hybridmem: and telling the other ranks failed too: {lost}")
            raise error from lost
        if error is not None and not (isinstance(error, ChannelError) and error.kind == "abort"):
            raise error
        if code != 1.0:
            fault = next((f for f, c in _OUTCOME.items() if c == code and f is not None), EngineFault.REFUSED)
            raise EngineProcessError("update_weights", where=self.client.where, deadline_s=self.timeout_s,
                                     elapsed_s=time.perf_counter() - start, fault=fault,
                                     cause="another of the engine's ranks reported the update failed (its "
                                     "error names the call)")

    def _deadline_s(self, call: str) -> float:
        """The deadline of ``call`` (see [Note: vllm engine deadlines])."""
        deadline = self.client.timeout_s
        if call == "connect" and self.rank > 0:
            deadline += 2 * self.client.timeout_s  # rank 0's close and start come first
        if call == "acknowledge":
            deadline += (self.bucket_nbytes + self._max_module_nbytes) / UPDATE_MIN_BPS
        if call == "update_weights":
            deadline += sum(math.prod(s) * t.itemsize for s, t in self.layout.values()) / UPDATE_MIN_BPS
        if call == "pause" and self.in_flight is InFlight.WAIT and self._in_flight:
            deadline += self.client.generate_timeout_s
        return deadline

    def _close_update(self) -> None:
        """Close an update transaction a failed update may have left open in vLLM (see [Note: vllm engine
        failures])."""
        try:
            self._control("finish_weight_update", None)
        except EngineProcessError as exc:
            if exc.fault is not EngineFault.REFUSED:
                raise
            log.debug("hybridmem: no update transaction was open in the vLLM engine (%s)", exc)
        self._update_open = False

    def _close_transport(self) -> None:
        if self.listener is not None:
            self.listener.close()
        if self.buckets is not None:
            self.buckets.close()

    def close(self, *, close_client: bool = True) -> None:
        """Remove this rank's buckets, channel and other files in the shared directory (the directory too,
        by the last rank to close) and drop the connection (the engine process keeps running;
        :meth:`start_async`'s AsyncLLM is shut down, :meth:`launch`'s server stopped); ``close_client=False``
        leaves the client to its owner (vLLM's trainer API, :mod:`hybridmem.adapters.vllm.server.trainer`)."""
        self._close_transport()
        self.buckets = self.listener = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.directory, f"layout-rank{self.rank}.json"))
        with contextlib.suppress(OSError):  # another rank's files are still there: that rank removes it
            os.rmdir(self.directory)
        if close_client:
            self.client.close()
        if self.server is not None:
            self.server.stop()

    def __repr__(self) -> str:
        states = ", ".join(f"{t}={'resident' if s else 'released'}" for t, s in self._state.items())
        return (f"VLLMServerEngine({self.client.where}, rank {self.rank} of {self.world_size}, {states}, "
                f"v{self.version})")


def _drain(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Run a stream to its end unused: producing it is the weight sync's collectives, which the other ranks
    wait in until this one has run them all."""
    try:
        for _ in weights:
            pass
    except Exception as exc:
        log.warning("hybridmem: the rest of a failed update's stream failed too: %s", exc)


def _max_module_nbytes(layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """The bytes of the largest module of ``layout`` (what a worker may process at once)."""
    modules: dict[str, int] = {}
    for name, (shape, dtype) in layout.items():
        module = name.rpartition(".")[0]
        modules[module] = modules.get(module, 0) + math.prod(shape) * dtype.itemsize
    return max(modules.values(), default=0)


def _bucket_nbytes(bucket_nbytes: int | None, device: torch.device, staging_dir: str, ranks: int) -> int:
    """``bucket_nbytes`` checked against what the device (CUDA) or the shared directory (CPU, shared by the
    ``ranks`` of one host) can hold, or the default (see [Note: vllm buckets] in
    :mod:`hybridmem.adapters.vllm.server.buckets`)."""
    limit, where = bucket_limit(device, staging_dir)
    if device.type == "cpu" and ranks > 1:
        limit, where = limit // ranks, f"{where} (shared by {ranks} ranks: its share)"
    if bucket_nbytes is None:
        bucket_nbytes = default_bucket_nbytes(device.type, free_nbytes=limit)
    return check_bucket_nbytes(bucket_nbytes, limit_nbytes=limit, what=where)


def check_fp8_layout(layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]], who: str) -> None:
    """Refuse a worker layout that does not hold FP8 blocks as [Note: fp8 block layout] in
    :mod:`hybridmem.reshard.fp8` says: each ``X.weight_scale_inv`` float32 beside an e4m3 ``X.weight``, and
    no e4m3 weight without one (see [Note: vllm fp8 server]).

    Raises:
        ValueError: No scales at all, or a weight or scale of another dtype or without its partner; names
            the tensor and ``who``.
    """
    scales = [n for n in layout if n.endswith(SCALE_SUFFIX)]
    if not scales:
        raise ValueError(f"{who} holds no weight{SCALE_SUFFIX} although the model's config says FP8 with "
                         f"128x128 blocks: the server quantizes otherwise (a --quantization flag of another "
                         f"method?); serve the FP8 checkpoint as its config says")
    for scale in scales:
        weight = scale.removesuffix(SCALE_SUFFIX)
        if layout[scale][1] != torch.float32:
            raise ValueError(f"{who} holds {scale} in {layout[scale][1]}; FP8 block scales are float32")
        if weight not in layout or layout[weight][1] != FP8_DTYPE:
            has = "nothing" if weight not in layout else str(layout[weight][1])
            raise ValueError(f"{who} holds {scale} beside {has} as {weight}; expected {FP8_DTYPE}")
    for name, (_, dtype) in layout.items():
        if dtype == FP8_DTYPE and name + SCALE_SUFFIX not in layout:
            raise ValueError(f"{who} holds {name} in {FP8_DTYPE} without {name + SCALE_SUFFIX}: not FP8 "
                             f"with 128x128 blocks")


def _config_of(model: str) -> Any:
    from transformers import AutoConfig  # noqa: PLC0415

    return AutoConfig.from_pretrained(model)
