"""VLLMEngine: a ``vllm.LLM`` (built with ``enable_sleep_mode=True``) behind hybridmem's InferenceEngine.

**Not run against a real vLLM in this project's CI.** vLLM cannot be installed where hybridmem is
developed and tested, so this adapter was written against vLLM's public API as read from its source
(see [Note: vllm API reference] in :mod:`hybridmem.adapters.vllm.compat`) and is tested only against a
fake ``LLM`` (:mod:`hybridmem.testing.fake_vllm`) that mimics those signatures and semantics. The
tests check hybridmem's side of the contract (which calls, in which order, with which tags); whether
vLLM behaves as read is unverified until it runs on a machine with vLLM.

[Note: vllm sleep granularity]
vLLM's allocator cannot release one pool alone: a sleep unmaps both the ``"weights"`` and the
``"kv_cache"`` pools (level 1 backs the weights up to pinned host memory, level 2 discards them), while
``wake_up(tags=[...])`` re-maps one pool at a time; and the executor ignores a second ``sleep`` until
every tag is awake again. hybridmem's switch releases one tag per step (KV cache, then weights) and
resumes weights, syncs, then resumes the KV cache. The adapter maps this onto vLLM as follows:

- release of both tags, or of the weights: ``sleep(level=2)``; if the KV cache was to stay, it is woken
  again right away (its contents are dead anyway, see [Note: engine memory tags]);
- release of the KV cache alone while the weights are resident: by default ``sleep(level=2)`` too
  (:attr:`KVOnlyRelease.DISCARD_WEIGHTS`): the weights are derived state that every TRAIN->INFER switch
  rewrites, and level 2 is what verl and slime use; the weights are then marked stale, and generating
  before new weights are loaded raises. :attr:`KVOnlyRelease.OFFLOAD_WEIGHTS` uses ``sleep(level=1)``
  instead: the weights wait in host memory (state ``ON_HOST``) and ``resume(["weights"])`` restores them;
- a release while some other tag is still asleep (e.g. undoing ``resume(["weights"])`` before the KV
  cache was resumed) must first wake the sleeping tags, so that the executor accepts the sleep; this
  briefly maps their memory again and is logged. If that wake fails (say the KV cache does not fit),
  the release fails and the woken weights stay resident: the all-or-nothing promise of ``resume`` then
  cannot be kept through vLLM's public API, and the error says so.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from hybridmem.accel import Accelerator, get_accelerator
from hybridmem.adapters.vllm.compat import IN_PROCESS_BACKENDS, import_vllm
from hybridmem.adapters.vllm.outputs import (
    GREEDY,
    from_request_output,
    to_vllm_sampling_kwargs,
)
from hybridmem.engines.protocol import ENGINE_TAGS, KV_CACHE, WEIGHTS
from hybridmem.engines.reference.sampling import GenerationOutput
from hybridmem.engines.torch_copy import check_tags
from hybridmem.errors import PhaseError

__all__ = ["VLLMEngine", "TagState", "KVOnlyRelease", "LoadStats", "bucket_weights"]

log = logging.getLogger(__name__)

DEFAULT_BUCKET_NBYTES = 512 << 20


class TagState(Enum):
    """Where one tag's memory is."""

    RESIDENT = "resident"
    """Mapped on the device (vLLM awake for this tag)."""
    ON_HOST = "on_host"
    """Weights only: unmapped, contents kept in vLLM's pinned host backup (a level-1 sleep)."""
    RELEASED = "released"
    """Unmapped, contents discarded."""


class KVOnlyRelease(Enum):
    """What ``release(["kv_cache"])`` does to the resident weights (see [Note: vllm sleep granularity])."""

    DISCARD_WEIGHTS = "discard_weights"
    """``sleep(level=2)``: weights discarded, to be rewritten by the next weight sync (fast, no host copy)."""
    OFFLOAD_WEIGHTS = "offload_weights"
    """``sleep(level=1)``: weights copied to pinned host memory and restored by ``resume(["weights"])``."""


@dataclass(frozen=True, slots=True)
class LoadStats:
    """What the last :meth:`VLLMEngine.load_weights` did."""

    num_tensors: int
    nbytes: int
    num_buckets: int
    seconds: float


def bucket_weights(
    weights: Iterable[tuple[str, torch.Tensor]], bucket_nbytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs, in order, into lists of at most ``bucket_nbytes`` bytes.

    A tensor larger than ``bucket_nbytes`` forms a bucket of its own; no bucket is empty.

    Raises:
        ValueError: ``bucket_nbytes`` is not positive.
    """
    if bucket_nbytes < 1:
        raise ValueError(f"bucket_nbytes={bucket_nbytes} must be positive")
    bucket: list[tuple[str, torch.Tensor]] = []
    held = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and held + nbytes > bucket_nbytes:
            yield bucket
            bucket, held = [], 0
        bucket.append((name, tensor))
        held += nbytes
    if bucket:
        yield bucket


def _load_bucket(model: torch.nn.Module, *, bucket: list[tuple[str, torch.Tensor]]) -> Any:
    """Run in each vLLM worker through ``LLM.apply_model`` (module-level so that it pickles)."""
    return model.load_weights(bucket)


def _reprocess_weights(worker: Any) -> None:
    """Run in each vLLM worker through ``LLM.collective_rpc`` (module-level so that it pickles): vLLM's
    post-load processing again, so that what it derives from the weights at load time follows an
    update (MLA backends build ``W_UK_T``/``W_UV`` from ``kv_b_proj`` there).

    Written against vLLM's ``process_weights_after_loading(model, model_config, target_device)`` as
    read from its source (``vllm/model_executor/model_loader/utils.py``); not run in this project.
    """
    from vllm.model_executor.model_loader.utils import process_weights_after_loading  # noqa: PLC0415

    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    model = getattr(model, "runnable", model)  # a CUDA-graph wrapper keeps the module as .runnable
    process_weights_after_loading(model, runner.model_config, worker.device)


def _add_note(exc: BaseException, note: str) -> None:
    add = getattr(exc, "add_note", None)  # Python >= 3.11
    if add is not None:
        add(note)


def _identity(model: torch.nn.Module) -> torch.nn.Module:
    return model


def _attr_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class VLLMEngine:
    """A ``vllm.LLM`` as a hybridmem :class:`~hybridmem.engines.protocol.InferenceEngine`.

    Args:
        llm: A ``vllm.LLM`` built with ``enable_sleep_mode=True`` (see :meth:`create`).
        accel: The accelerator whose free-memory figure measures what sleeps and wakes free and take;
            defaults to ``"auto"`` (npu, cuda, cpu).
        bucket_nbytes: :meth:`load_weights` hands tensors to the workers in buckets of this many bytes.
        kv_only_release: What releasing the KV cache alone does to the weights (see
            [Note: vllm sleep granularity]).
        in_process: Whether the worker and its model live in this process (``named_parameters`` and
            device tensors in ``load_weights`` need it); defaults to whether the LLM's
            ``distributed_executor_backend`` is ``"external_launcher"``.
        nbytes_hint: Device bytes of each tag, used by :meth:`planned_nbytes` and
            :meth:`resident_nbytes` until a wake-up has measured them.
        release_now: Release both tags on construction, as :class:`~hybridmem.ShardingManager` expects
            (it is built in TRAIN with the engine's memory released).
        reprocess_after_update: Run vLLM's post-load weight processing in every worker after each weight
            update (after :meth:`load_weights`; before the next :meth:`generate` after writes through
            :meth:`named_parameters`). Needed where vLLM derives tensors from the weights at load time,
            as its MLA backends (DeepSeek) do from ``kv_b_proj``; ``None``: on when the model config's
            ``use_mla`` is true. Do not turn it on for quantized models whose processing is not
            idempotent.

    Call order: ``resume(["weights"])``, ``load_weights(...)`` (or write into :meth:`named_parameters`),
    ``resume(["kv_cache"])``, ``generate(...)``, then ``release(["kv_cache"])``, ``release(["weights"])``;
    ShardingManager does exactly this.

    Raises:
        ValueError: The LLM was built without ``enable_sleep_mode=True``, or an option is out of range.
    """

    def __init__(
        self,
        llm: Any,
        *,
        accel: Accelerator | str | None = None,
        bucket_nbytes: int = DEFAULT_BUCKET_NBYTES,
        kv_only_release: KVOnlyRelease | str = KVOnlyRelease.DISCARD_WEIGHTS,
        in_process: bool | None = None,
        nbytes_hint: Mapping[str, int] | None = None,
        release_now: bool = True,
        reprocess_after_update: bool | None = None,
    ):
        if bucket_nbytes < 1:
            raise ValueError(f"bucket_nbytes={bucket_nbytes} must be positive")
        sleep_enabled = _attr_path(llm, "llm_engine.vllm_config.model_config.enable_sleep_mode")
        if sleep_enabled is False:
            raise ValueError(
                "the vllm.LLM was built with enable_sleep_mode=False; VLLMEngine needs enable_sleep_mode=True"
            )
        self.llm = llm
        self.accel = get_accelerator("auto" if accel is None else accel)
        self.bucket_nbytes = int(bucket_nbytes)
        self.kv_only_release = KVOnlyRelease(kv_only_release)
        self.backend = _attr_path(llm, "llm_engine.vllm_config.parallel_config.distributed_executor_backend")
        self.in_process = (self.backend in IN_PROCESS_BACKENDS) if in_process is None else bool(in_process)
        if reprocess_after_update is None:
            reprocess_after_update = _attr_path(llm, "llm_engine.vllm_config.model_config.use_mla") is True
        self.reprocess_after_update = bool(reprocess_after_update)
        self._reprocess_pending = False
        hint = dict(nbytes_hint or {})
        check_tags(list(hint))
        self._nbytes: dict[str, int] = {t: int(hint.get(t, 0)) for t in ENGINE_TAGS}
        self._state = {t: TagState.RESIDENT for t in ENGINE_TAGS}
        self._asleep: set[str] = set()  # mirrors the executor's sleeping tags
        self._weights_valid = True
        self._prefix_stale = False
        self.last_freed_nbytes = 0
        """Device bytes the last sleep freed (free-memory figure after minus before)."""
        self.last_load: LoadStats | None = None
        if release_now:
            self.release(list(ENGINE_TAGS))

    @classmethod
    def create(
        cls,
        model_path_or_config: Any,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        distributed_executor_backend: str | None = "external_launcher",
        accel: Accelerator | str | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        **llm_kwargs: Any,
    ) -> VLLMEngine:
        """Build a ``vllm.LLM`` with sleep mode and wrap it.

        Args:
            model_path_or_config: A model name or path, or a transformers config (an object with
                ``save_pretrained``): the config is written to a temporary directory and the LLM is
                built with ``load_format="dummy"`` and no tokenizer, its weights coming from the first
                weight sync.
            tensor_parallel_size: vLLM's inference TP size.
            gpu_memory_utilization: Share of device memory vLLM may use for weights, activations and KV
                cache, measured when the LLM is built; with co-located training, leave room for it.
            distributed_executor_backend: ``"external_launcher"`` (default) runs one vLLM worker inside
                each torchrun rank (SPMD co-location, as verl does), sets
                ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless already set, and makes
                :meth:`named_parameters` available; ``None``/``"mp"``/``"ray"`` run workers elsewhere.
            accel: See :class:`VLLMEngine`; on Ascend NPUs (``"npu"``) the same call builds a
                vllm-ascend LLM (vllm-ascend registers itself as vLLM's platform plugin) and sets
                ``VLLM_ASCEND_ENABLE_NZ=0`` unless already set.
            engine_kwargs: Keyword arguments for :class:`VLLMEngine` (``bucket_nbytes``...).
            **llm_kwargs: More ``vllm.LLM`` arguments (``dtype``, ``max_model_len``, ``seed``...).

        Raises:
            ImportError: vLLM is not installed; the message names ``pip install hybridmem[vllm]``.
        """
        vllm = import_vllm("vllm")
        accel = get_accelerator("auto" if accel is None else accel)
        if distributed_executor_backend == "external_launcher":
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if accel.name == "npu":
            # vllm-ascend's NPUWorker.wake_up refuses weights kept in FRACTAL_NZ layout, which an RL
            # weight update would corrupt; turn it off unless the user chose.
            os.environ.setdefault("VLLM_ASCEND_ENABLE_NZ", "0")
        model = model_path_or_config
        if hasattr(model_path_or_config, "save_pretrained"):
            model = tempfile.mkdtemp(prefix="hybridmem-vllm-config-")
            model_path_or_config.save_pretrained(model)
            llm_kwargs.setdefault("load_format", "dummy")
            llm_kwargs.setdefault("skip_tokenizer_init", True)
        if llm_kwargs.pop("enable_sleep_mode", True) is not True:
            raise ValueError("VLLMEngine.create needs enable_sleep_mode=True")
        if distributed_executor_backend is not None:
            llm_kwargs["distributed_executor_backend"] = distributed_executor_backend
        llm = vllm.LLM(
            model=str(model),
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=True,
            **llm_kwargs,
        )
        return cls(llm, accel=accel, **dict(engine_kwargs or {}))

    @property
    def gpu_memory_utilization(self) -> float | None:
        """vLLM's ``cache_config.gpu_memory_utilization`` (what its KV pool was sized for), if known."""
        value = _attr_path(self.llm, "llm_engine.vllm_config.cache_config.gpu_memory_utilization")
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    # InferenceEngine ------------------------------------------------------------------------------
    def release(self, tags: Sequence[str]) -> None:
        """Give back the device memory of ``tags`` (see [Note: vllm sleep granularity]).

        Raises:
            ValueError, TypeError: An unknown tag, or a string instead of a list.
        """
        wanted = check_tags(tags)
        for tag in wanted:  # already off the device: only the bookkeeping changes
            if self._state[tag] is TagState.ON_HOST:
                self._state[tag] = TagState.RELEASED
                self._weights_valid = False
        to_free = {t for t in wanted if self._state[t] is TagState.RESIDENT}
        if not to_free:
            return
        # Weights whose contents must survive: resident ones not asked for, and ones parked on host.
        weights_kept = WEIGHTS not in to_free and self._state[WEIGHTS] is not TagState.RELEASED
        level = 1 if (weights_kept and self.kv_only_release is KVOnlyRelease.OFFLOAD_WEIGHTS) else 2
        kv_kept = KV_CACHE not in to_free and self._state[KV_CACHE] is TagState.RESIDENT
        self._sleep(level, rewake=[KV_CACHE] if kv_kept else [])

    def _sleep(self, level: int, *, rewake: list[str]) -> None:
        """``LLM.sleep(level)`` (both pools), waking any sleeping tag first, then waking ``rewake``."""
        if self._asleep:
            # vLLM's executor ignores sleep() while any tag sleeps: wake them all first.
            log.warning(
                "hybridmem vLLM adapter: a level-%d sleep while %s sleep; waking them first (their memory is "
                "mapped again briefly, about %d bytes)",
                level, sorted(self._asleep), sum(self._nbytes[t] for t in self._asleep),
            )
            self._wake(sorted(self._asleep, key=ENGINE_TAGS.index))
        free_before = self._free_nbytes()
        self.llm.sleep(level=level)
        self.last_freed_nbytes = self._free_nbytes() - free_before
        self._asleep = set(ENGINE_TAGS)
        self._prefix_stale = False  # LLM.sleep resets the prefix cache
        self._state[KV_CACHE] = TagState.RELEASED
        if level == 1:
            self._state[WEIGHTS] = TagState.ON_HOST
        else:
            self._state[WEIGHTS] = TagState.RELEASED
            self._weights_valid = False
        self._wake(rewake)

    def resume(self, tags: Sequence[str]) -> None:
        """Map the memory of ``tags`` again, weights before KV cache; all-or-nothing.

        Weights restored from a level-1 sleep keep their values; discarded ones are stale until
        :meth:`load_weights`. A KV cache resumed after a weight update resets the prefix cache.

        Raises:
            ValueError, TypeError: An unknown tag, or a string instead of a list.
        """
        order = [t for t in ENGINE_TAGS if t in check_tags(tags) and self._state[t] is not TagState.RESIDENT]
        prior = dict(self._state)
        done: list[str] = []
        try:
            for tag in order:
                self._wake([tag])
                done.append(tag)
        except BaseException as exc:
            if done:
                # Undo: put what this call woke back where it was (weights from a level-1 sleep go
                # back to host, at level 1; a KV cache that was resident before stays resident).
                level = 1 if prior[WEIGHTS] is TagState.ON_HOST else 2
                try:
                    self._sleep(level, rewake=[t for t in ENGINE_TAGS if prior[t] is TagState.RESIDENT])
                except Exception as undo_exc:  # noqa: BLE001 - reported on the original error
                    _add_note(
                        exc,
                        f"hybridmem vLLM adapter: could not release {done} again ({undo_exc!r}): vLLM "
                        f"cannot put one tag back to sleep while another sleeps, so it had to wake "
                        f"{sorted(self._asleep)} first; {done} stay resident (see [Note: vllm sleep "
                        f"granularity])"
                    )
            raise
        if KV_CACHE in done and self._prefix_stale:
            self.llm.reset_prefix_cache()
            self._prefix_stale = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream full HF-named tensors into every worker's ``model.load_weights``, in buckets.

        Out of process (``in_process=False``) the tensors are copied to host memory first, since
        they are pickled to the workers. The prefix cache is reset afterwards.

        Raises:
            PhaseError: The weights are not resident (call ``resume(["weights"])`` first).
        """
        if self._state[WEIGHTS] is not TagState.RESIDENT:
            raise PhaseError("load weights into vLLM", self._state[WEIGHTS], "resume(['weights']) first")
        start = time.perf_counter()
        count = nbytes = num_buckets = 0
        with torch.no_grad():
            for bucket in bucket_weights(weights, self.bucket_nbytes):
                if not self.in_process:
                    bucket = [(name, t.detach().to("cpu")) for name, t in bucket]
                self.llm.apply_model(functools.partial(_load_bucket, bucket=bucket))
                count += len(bucket)
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                num_buckets += 1
        self._reprocess_pending = True
        self._reprocess()
        self.llm.reset_prefix_cache()
        self._prefix_stale = False
        self._weights_valid = True
        self.last_load = LoadStats(count, nbytes, num_buckets, time.perf_counter() - start)

    # Optional protocol methods --------------------------------------------------------------------
    @property
    def named_parameters(self) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
        """``named_parameters()``: the in-process model's own (per-rank, vLLM-layout) parameters, for
        in-place weight sync (the resharding engine writes into them).

        Present only when the worker is in this process (``external_launcher``): out of process the
        attribute raises ``AttributeError`` with the reason, so callers that probe for it (``getattr(
        engine, "named_parameters", None)``, as ``ReshardSync`` does) fall back to :meth:`load_weights`.

        CuMemAllocator re-maps a woken pool at the same addresses, so these tensors stay valid across
        sleep/wake; write them only while the weights are resident. Calling it marks the weights as
        updated (valid, and the prefix cache to be reset on the next KV resume or generate).
        """
        if not self.in_process:
            raise AttributeError(
                f"named_parameters() needs the vLLM worker in this process "
                f"(distributed_executor_backend='external_launcher'); this LLM uses {self.backend!r}, "
                f"whose workers are other processes: use load_weights() instead"
            )
        return self._named_parameters

    def _named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        models = self.llm.apply_model(_identity)
        if len(models) != 1:
            raise RuntimeError(f"expected one in-process vLLM worker per rank, got {len(models)}")
        self._weights_valid = True
        self._prefix_stale = True
        self._reprocess_pending = True
        return iter(models[0].named_parameters())

    def resident_nbytes(self, tag: str) -> int:
        """Device bytes held under ``tag`` now: the bytes its last wake-up took (free-memory figure),
        or the ``nbytes_hint`` before any wake-up; 0 when not resident."""
        tag = check_tags([tag])[0]
        return self._nbytes[tag] if self._state[tag] is TagState.RESIDENT else 0

    def planned_nbytes(self, tag: str) -> int:
        """Device bytes ``resume([tag])`` will take (0 when resident, or unknown before a measurement)."""
        tag = check_tags([tag])[0]
        return 0 if self._state[tag] is TagState.RESIDENT else self._nbytes[tag]

    def state(self, tag: str) -> TagState:
        """Where ``tag``'s memory is."""
        return self._state[check_tags([tag])[0]]

    # Inference ------------------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[Sequence[int]], params: Any = None) -> list[GenerationOutput]:
        """Generate from token-id prompts.

        Args:
            prompt_ids: One list of token ids per prompt.
            params: A :class:`~hybridmem.engines.SamplingParams` or any object with its fields;
                defaults to :data:`~hybridmem.adapters.vllm.outputs.GREEDY` (16 tokens, log-probs).

        Raises:
            PhaseError: A tag is not resident, or the weights were discarded and not loaded since.
        """
        for tag in ENGINE_TAGS:
            if self._state[tag] is not TagState.RESIDENT:
                raise PhaseError(
                    "generate with vLLM", self._state[tag], f"{tag!r} is not resident; resume it first"
                )
        if not self._weights_valid:
            raise PhaseError(
                "generate with vLLM", "STALE_WEIGHTS", "the weights were discarded by a sleep, not reloaded"
            )
        params = GREEDY if params is None else params
        vllm_params = import_vllm("vllm").SamplingParams
        sampling_params = [vllm_params(**to_vllm_sampling_kwargs(params, i)) for i in range(len(prompt_ids))]
        self._reprocess()
        if self._prefix_stale:
            self.llm.reset_prefix_cache()
            self._prefix_stale = False
        prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids in prompt_ids]
        outputs = self.llm.generate(prompts, sampling_params, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        want = bool(params.logprobs)
        return [from_request_output(p, o, want_logprobs=want) for p, o in zip(prompt_ids, outputs)]

    # Internals ------------------------------------------------------------------------------------
    def _reprocess(self) -> None:
        """vLLM's post-load processing in every worker once per weight update, when enabled."""
        if self.reprocess_after_update and self._reprocess_pending:
            self.llm.collective_rpc(_reprocess_weights)
        self._reprocess_pending = False

    def _free_nbytes(self) -> int:
        return self.accel.memory_figures().free_nbytes

    def _wake(self, tags: list[str]) -> None:
        """``LLM.wake_up`` for sleeping ``tags``, one at a time, measuring what each takes."""
        for tag in tags:
            free_before = self._free_nbytes()
            self.llm.wake_up(tags=[tag])
            taken = free_before - self._free_nbytes()
            if taken > 0:
                self._nbytes[tag] = taken
            self._asleep.discard(tag)
            self._state[tag] = TagState.RESIDENT

    def __repr__(self) -> str:
        states = ", ".join(f"{t}={s.value}" for t, s in self._state.items())
        return f"VLLMEngine({states}, backend={self.backend!r}, accel={self.accel})"
