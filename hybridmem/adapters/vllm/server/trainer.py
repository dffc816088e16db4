"""The trainer side of hybridmem's weight-transfer backend through vLLM's own trainer API.

[Note: vllm trainer api]
vLLM builds a trainer-side engine per backend: ``WeightTransferTrainerFactory.trainer_init(init_info,
client=..., source=...)`` on every trainer rank, then ``send_weights()`` on every rank per sync
(``vllm/distributed/weight_transfer/base.py``, ``factory.py``). For the backend ``"hybridmem"``
(:class:`HybridmemTrainerInitInfo`, registered on import of this module and by the plugin,
:func:`hybridmem.adapters.vllm.plugin.register`) the engine is
:class:`HybridmemTrainerWeightTransferEngine`, and it moves the weights as
:class:`~hybridmem.adapters.vllm.server.VLLMServerEngine` does, through that engine's own pieces:

- ``trainer_init`` builds a ``VLLMServerEngine`` on the client, not released (nothing is paused or put to
  sleep): every rank's two buckets and channel, rank 0's ``init_weight_transfer_engine`` with all of them,
  and each worker's load-time layout read back; that layout is checked against the vLLM layout of
  ``hf_config`` for this rank (names and shapes) before anything is sent;
- ``send_weights`` takes the source's full HF-named tensors one at a time, cuts this rank's tensors of the
  vLLM layout from them (:func:`~hybridmem.reshard.iter_shard`: a fused tensor once all its parts arrived,
  each HF tensor dropped once everything cut from it was built) and streams them with
  ``VLLMServerEngine.load_layout_weights`` (rank 0's ``start_weight_update`` and ``update_weights`` beside
  the streams, each rank's own worker's share through its own buckets, the figures of
  :func:`~hybridmem.reshard.checksum.tensor_checksum` with each tensor, the ranks' agreement), then
  ``commit_weights`` (``finish_weight_update`` with the next version ``hybridmem-<n>``). A rank other
  than 0 never calls the client during an update.

So each worker receives exactly its own shards, as under a :class:`~hybridmem.ShardingManager`, whatever
the trainer's source is; the source is iterated in full on every rank (vLLM's ``WeightSource`` contract:
its gathers are collectives). A failed update raises on every rank and the next ``send_weights`` starts
over, closing first an update session the failed one left open in vLLM (a refused
``finish_weight_update`` among them; [Note: vllm engine failures] in
:mod:`hybridmem.adapters.vllm.server.engine`).

The client is hybridmem's own (:class:`~hybridmem.adapters.vllm.server.client.HTTPClient`,
:class:`~hybridmem.adapters.vllm.server.client.AsyncLLMClient`: deadlines, a dead engine told from a
refusal, the prefix cache reset after each update) or any other ``VLLMWeightSyncClient`` (vLLM's
``HTTPVLLMWeightSyncClient``, ``RayVLLMWeightSyncClient``), wrapped in :class:`ProtocolClient`: its four
calls under the deadline ``timeout_s``, an error of one a refusal (such a client cannot tell a dead engine
from one that answered with an error). Generation is the caller's, as in vLLM's own examples: pause it
before ``send_weights`` (vLLM's pause clears the prefix cache) and resume it after.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from hybridmem.adapters.vllm.plugin import BACKEND_NAME, register_trainer
from hybridmem.adapters.vllm.server.client import VLLMClient, error_text
from hybridmem.adapters.vllm.server.engine import VLLMServerEngine
from hybridmem.adapters.vllm.server.ranks import engine_ranks
from hybridmem.adapters.vllm.server.update import BackgroundCall
from hybridmem.config import ParallelLayout
from hybridmem.contract.generation import GenerationOutput
from hybridmem.errors import EngineFault
from hybridmem.reshard import ModelSpec, iter_shard, vllm_layout

try:
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine
except ImportError as exc:  # pragma: no cover - another vLLM
    raise ImportError(f"hybridmem's trainer engine needs vLLM's trainer API "
                      f"(vllm.distributed.weight_transfer.base.TrainerWeightTransferEngine): {exc}") from exc

__all__ = ["HybridmemTrainerInitInfo", "HybridmemTrainerWeightTransferEngine", "ProtocolClient"]

PROTOCOL_CALLS = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                  "finish_weight_update")
"""vLLM's ``VLLMWeightSyncClient``: every call a client of vLLM's own offers."""


@dataclass
class HybridmemTrainerInitInfo(TrainerInitInfo):
    """The trainer-side init info of the ``"hybridmem"`` backend (see [Note: vllm trainer api]).

    ``rank`` (keyword-only, vLLM's) is this process's rank among the trainer ranks serving the engine, one
    per vLLM worker rank in order: its rank in ``group``.
    """

    backend: ClassVar[str] = BACKEND_NAME

    hf_config: Any = None
    """The trained model's transformers config, or its directory: the vLLM layout the source is cut into."""
    group: Any = None
    """The ``torch.distributed`` group of the trainer ranks, one per vLLM worker rank (its tensor-parallel
    size); ``None``: this process alone, for an engine with one worker."""
    verify: bool = True
    """Send each tensor's figures; the worker refuses a tensor that reads otherwise."""
    staging_dir: str = "/dev/shm"
    """Where the shared directory goes (CPU buckets, the channels' sockets)."""
    bucket_nbytes: int | None = None
    """Bytes per bucket (two per rank); ``None``: 64 MiB on CPU, on CUDA a sixteenth of free memory, at most
    1 GiB."""
    timeout_s: float = 120.0
    """The ranks' agreement around an update, and a control call of a client other than hybridmem's."""
    accel: Any = None
    """Where this rank's buckets live (its worker's device); ``None``: the accelerator found."""


class HybridmemTrainerWeightTransferEngine(TrainerWeightTransferEngine[HybridmemTrainerInitInfo]):
    """vLLM's trainer engine of the ``"hybridmem"`` backend (see [Note: vllm trainer api]); build it with
    ``WeightTransferTrainerFactory.trainer_init`` on every trainer rank.

    Attributes:
        engine: The :class:`~hybridmem.adapters.vllm.server.VLLMServerEngine` whose transport it drives.
        last_update: What the last complete ``send_weights`` moved (``engine_update_nbytes``: this rank's
            bytes, what its worker took; ``weight_version``; ...), ``None`` before one.
    """

    init_info_cls = HybridmemTrainerInitInfo

    def __init__(self, engine: VLLMServerEngine, *, client: Any, source: Any, spec: ModelSpec):
        super().__init__(client=client, source=source, is_sender=engine.rank == 0)
        self.rank = engine.rank
        self.engine = engine
        self.layout = vllm_layout(spec, ParallelLayout(tp=engine.world_size), engine.world_size)
        self.last_update: dict[str, Any] | None = None

    @classmethod
    def trainer_init(cls, init_info: HybridmemTrainerInitInfo, *, client: Any,
                     source: Any = None) -> HybridmemTrainerWeightTransferEngine:
        """Set up this rank's transport and, on rank 0, the workers' backend; call it on every trainer rank.

        Raises:
            TypeError: ``init_info`` is not a :class:`HybridmemTrainerInitInfo`.
            ValueError: No ``source``, no ``hf_config``, ``init_info.rank`` not this process's rank in
                ``group``, or a worker's layout other than the vLLM layout of ``hf_config``.
            EngineProcessError: The engine refused or did not answer the init.
        """
        if not isinstance(init_info, HybridmemTrainerInitInfo):
            raise TypeError(f"init_info is {type(init_info).__name__}; the hybridmem backend takes "
                            f"HybridmemTrainerInitInfo")
        if source is None:
            raise ValueError("source=None: the hybridmem backend sends every weight each round; pass "
                             "source=ModuleSource(model)")
        hf_config = init_info.hf_config
        if hf_config is None:
            raise ValueError("HybridmemTrainerInitInfo: field 'hf_config' is None; pass the trained model's "
                             "config (model.config) or its directory")
        if isinstance(hf_config, str):
            from transformers import AutoConfig  # noqa: PLC0415

            hf_config = AutoConfig.from_pretrained(hf_config)
        rank, size = engine_ranks(init_info.group)
        if init_info.rank != rank:
            raise ValueError(f"HybridmemTrainerInitInfo: field 'rank' is {init_info.rank}, but this process "
                             f"is rank {rank} of the {size} ranks of 'group'")
        spec = ModelSpec.from_hf_config(hf_config)
        layout = vllm_layout(spec, ParallelLayout(tp=size), size)  # an engine the model cannot fit: here
        wrapped = client if isinstance(client, VLLMClient) else ProtocolClient(
            client, world_size=size, timeout_s=init_info.timeout_s)
        engine = VLLMServerEngine(wrapped, hf_config=hf_config, group=init_info.group,
                                  verify=init_info.verify, staging_dir=init_info.staging_dir,
                                  bucket_nbytes=init_info.bucket_nbytes, timeout_s=init_info.timeout_s,
                                  frees_memory=False, accel=init_info.accel, release_now=False)
        try:
            expected = {name: local.shape for name, local in layout.tensors(rank).items()}
            engine.check_weights(expected, what=f"the vLLM layout of {spec.family} at tp={size}, rank {rank}")
        except BaseException:
            engine.close(close_client=False)
            raise
        return cls(engine, client=client, source=source, spec=spec)

    def send_weights(self) -> None:
        """One complete update: this rank's share of the source into its worker, then the version; call it on
        every trainer rank (see [Note: vllm trainer api]).

        Raises:
            ValueError: The source gives a tensor the model does not have, another shape, or misses one.
            EngineProcessError: The update failed in the engine, on this rank or another.
        """
        dtypes = {name: dtype for name, (_, dtype) in self.engine.layout.items()}
        self.engine.load_layout_weights(iter_shard(_full_tensors(self.source), self.layout, self.rank,
                                                   dtypes=dtypes))
        self.last_update = self.engine.commit_weights()

    def shutdown(self) -> None:
        """Remove this rank's buckets, channel and shared directory; the client stays its owner's."""
        self.engine.close(close_client=False)


def _full_tensors(source: Any) -> Iterator[tuple[str, torch.Tensor | None]]:
    """The source's full tensors: ``iter_full()`` (vLLM 0.33's ``WeightSource``), else iteration (0.32's)."""
    implements = getattr(source, "implements_iter_full", None)
    if callable(implements) and implements():
        return iter(source.iter_full())
    return iter(source)


class ProtocolClient(VLLMClient):
    """Any ``VLLMWeightSyncClient`` as the control plane a ``VLLMServerEngine`` drives (see
    [Note: vllm trainer api]): the protocol's calls (:data:`PROTOCOL_CALLS`) and ``reset_prefix_cache``
    where the client has one, each within ``timeout_s`` but ``update_weights`` (bounded by the stream
    beside it).

    Args:
        client: The wrapped client.
        world_size: The engine's worker ranks (the protocol cannot ask).
        timeout_s: The deadline of a call.
    """

    def __init__(self, client: Any, *, world_size: int, timeout_s: float):
        self.client = client
        self.world_size_ = int(world_size)
        self.timeout_s = float(timeout_s)
        self.generate_timeout_s = float(timeout_s)
        url = getattr(client, "base_url", None)
        self.where = f"{type(client).__name__}" + (f" at {url}" if url else "")

    def _call(self, name: str, *args: Any, timeout_s: float | None = None) -> Any:
        if name == "world_size":
            return self.world_size_
        if name == "reset_prefix_cache" and not callable(getattr(self.client, name, None)):
            return None
        if name not in (*PROTOCOL_CALLS, "reset_prefix_cache"):
            raise TypeError(f"{self.where} is a VLLMWeightSyncClient: it has no call {name!r} (it offers "
                            f"{list(PROTOCOL_CALLS)}); use hybridmem's HTTPClient or AsyncLLMClient for more")
        fn = getattr(self.client, name)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        if math.isinf(timeout):  # update_weights: on the engine's own thread already
            return self._answer(name, fn, args, start, timeout)
        call = BackgroundCall(self._answer, name, fn, args, start, timeout, name=name)
        if not call.wait(timeout):
            raise self._failure(name, start=start, deadline_s=timeout, cause="no answer",
                                fault=EngineFault.STALLED)
        call.watch()
        return call.result

    def _answer(self, name: str, fn: Any, args: Sequence[Any], start: float, timeout: float) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            response = getattr(exc, "response", None)
            said = error_text(response) if response is not None else ""
            cause = f"{type(exc).__name__}: {exc}".splitlines()[0][:300] + (f" ({said})" if said else "")
            raise self._failure(name, start=start, deadline_s=timeout, cause=cause,
                                fault=EngineFault.REFUSED) from exc

    def _gone(self) -> bool:
        return False  # the protocol cannot tell

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: Any) -> list[GenerationOutput]:
        raise TypeError(f"{self.where} is a VLLMWeightSyncClient: it moves weights, it does not generate")

    async def agenerate(self, prompt_ids: Sequence[int], params: Any, *, index: int = 0) -> GenerationOutput:
        raise TypeError(f"{self.where} is a VLLMWeightSyncClient: it moves weights, it does not generate")


register_trainer()
