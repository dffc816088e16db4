"""Hugging Face TRL's ``GRPOTrainer`` on hybridmem: one changed import.

>>> from hybridmem.integrations.trl import HybridGRPOTrainer                          # doctest: +SKIP
>>> trainer = HybridGRPOTrainer(model=model, reward_funcs=reward, train_dataset=ds, processing_class=tok,
...                             args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...))  # doctest: +SKIP
>>> trainer.train()                                                                     # doctest: +SKIP

[Note: TRL colocate through hybridmem]
TRL's colocate mode keeps a ``vllm.LLM`` in every training process (``trainer.vllm_generation.llm``,
built with ``external_launcher``) and offloads nothing of the trainer: optimizer state, grads and weights
stay on the device while vLLM generates, and the weights reach vLLM one tensor at a time through the
model's ``load_weights``. :class:`HybridGRPOTrainer` keeps TRL's loop, data, rewards, loss and its
``LLM``, and replaces what happens around generation:

- TRL builds its ``LLM`` as usual, with three differences: sleep mode where the backend has one (off on
  vLLM's CPU build), the trainer model's dtype (TRL passes none, and vLLM's ``"auto"`` may serve an fp32
  model in bf16: the importance ratio would then see that rounding, see [Note: no silent dtype change] in
  :mod:`hybridmem.weight_sync.base`; ``vllm_dtype=`` chooses another), and on vLLM's CPU build the KV cache
  sized as ``VLLMEngine.create`` sizes it ([Note: vllm cpu kv default] in
  :mod:`hybridmem.adapters.vllm.cpu_kv`);
- the ``LLM`` is wrapped in :class:`~hybridmem.adapters.vllm.VLLMEngine`, and TRL's own sleep/wake and
  weight sync are switched off;
- once the optimizer exists (``create_optimizer``), a :class:`~hybridmem.ShardingManager` over the
  trainer's model, its optimizer and that engine is built (``trainer.hybrid_manager``); TRL's reference
  model, when ``beta > 0`` gives it one, becomes a co-resident model, on the device only while TRL
  scores with it;
- every generation runs inside ``hybrid_manager.inference()``: optimizer state, grads and weights go to
  host memory, the weights are synced into vLLM by the manager's weight sync (resharded where TP differs),
  the KV cache is taken and given back, and a failed switch rolls back. A switch that failed and rolled
  back (phase TRAIN, nothing lost) is tried once more; a second failure is raised;
- a PEFT LoRA model (``peft_config``, or a PEFT model given as ``model``) is synced by
  :class:`~hybridmem.weight_sync.LoraSync` by default (``lora_sync="adapters"``): TRL's ``LLM`` is built
  with ``enable_lora=True``, ``max_lora_rank`` the adapter's rank (rounded up to one vLLM offers) and
  ``max_loras=1``; the base goes to vLLM once, then only the adapters move, and TRL's ``llm.generate``
  calls run with the adapter's latest version (the engine gives it to every call naming no adapter, see
  [Note: vllm lora from memory] in :mod:`hybridmem.adapters.vllm.inprocess.lora`). ``lora_sync="merged"``
  streams the base weights plus each LoRA layer's delta, computed out of place (:func:`merged_lora_weights`),
  every switch, as a model without LoRA; so does the adapter sync where vLLM cannot serve the adapter,
  saying why in the reports.

Each generation's two switch reports are kept in ``trainer.hybrid_reports`` and summarised in TRL's
logged metrics (``hybridmem/...``).

The TRL internals this relies on, read from TRL 1.16.0, are checked when this module is imported, and a
TRL outside the tested range is refused ([Note: TRL hooks] in :mod:`hybridmem.integrations.trl_compat`).
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from hybridmem.config import HybridConfig
from hybridmem.integrations.trl_compat import import_trl
from hybridmem.switch.phase import Direction
from hybridmem.switch.report import SwitchReport
from hybridmem.weight_sync.lora import LoraRoute, merged_lora_weights

__all__ = ["HybridGRPOTrainer", "GenerationSwitches", "REFERENCE_OWNER", "LoraRoute", "merged_lora_weights"]

log = logging.getLogger(__name__)

_TRL = import_trl()  # refuses a TRL outside the tested range or without a hook
GRPOTrainer = _TRL["trl.trainer.grpo_trainer"].GRPOTrainer
_TRL_INIT = inspect.Signature(list(inspect.signature(GRPOTrainer.__init__).parameters.values())[1:])
"""``trl.GRPOTrainer.__init__``'s parameters but ``self``: its arguments are read by name, however passed."""

REFERENCE_OWNER = "reference"
"""The co-resident name of TRL's reference model."""


@dataclass(frozen=True, slots=True)
class GenerationSwitches:
    """The two switches around one generation."""

    global_step: int
    """TRL's optimizer step when the generation ran."""
    to_infer: SwitchReport
    to_train: SwitchReport
    retried: bool = False
    """Whether the first TRAIN->INFER failed, rolled back, and was tried again."""

    @property
    def offloaded_nbytes(self) -> dict[str, int]:
        """Bytes each offload step of the TRAIN->INFER switch moved or released, by step name."""
        return {s.name: s.copied_nbytes + s.zero_nbytes for s in self.to_infer.steps
                if s.name.startswith("offload")}

    @property
    def synced_nbytes(self) -> int:
        """Bytes the weight sync of the TRAIN->INFER switch wrote into vLLM: the whole model's weights (a
        LoRA model's adapters only, once the engine holds the base), whether they came from this rank
        or others (the step's ``engine_nbytes``, not its ``copied_nbytes``: bytes received from other
        ranks, none on one rank)."""
        return sum(int(s.extra.get("engine_nbytes", s.copied_nbytes)) for s in self.to_infer.steps
                   if s.name == "weight sync")

    @property
    def sync_route(self) -> str:
        """How the weights went, where the sync says (a LoRA sync: adapters only, or merged and why)."""
        return next((s.extra.get("route", "") for s in self.to_infer.steps if s.name == "weight sync"), "")


def _bind_trl_arguments(args: tuple, kwargs: dict[str, Any]) -> inspect.BoundArguments:
    """``trl.GRPOTrainer``'s arguments by name, however they were passed.

    Raises:
        TypeError: Arguments ``trl.GRPOTrainer`` does not take.
    """
    try:
        return _TRL_INIT.bind_partial(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"HybridGRPOTrainer takes trl.GRPOTrainer's arguments: {exc}") from None


def _check_args(args: Any) -> None:
    if args is None or not getattr(args, "use_vllm", False) or getattr(args, "vllm_mode", None) != "colocate":
        got = (getattr(args, "use_vllm", None), getattr(args, "vllm_mode", None))
        raise ValueError(
            f"HybridGRPOTrainer drives TRL's co-located vLLM: set GRPOConfig(use_vllm=True, "
            f"vllm_mode='colocate') (got use_vllm={got[0]!r}, vllm_mode={got[1]!r})"
        )


def _vllm_has_sleep_mode() -> bool:
    from hybridmem.adapters.vllm.compat import import_vllm, platform_is_cpu  # noqa: PLC0415

    return not platform_is_cpu(import_vllm("vllm"))


class HybridGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` whose co-located vLLM generation runs inside hybridmem's switches (see
    [Note: TRL colocate through hybridmem]).

    Args:
        *args, **kwargs: Those of ``trl.GRPOTrainer``, by position or keyword; ``args`` must have
            ``use_vllm=True`` and ``vllm_mode="colocate"``. ``vllm_enable_sleep_mode`` is decided here (on
            where vLLM has a sleep mode, off on its CPU build): hybridmem sleeps and wakes the engine itself.
        hybrid_config: The manager's :class:`~hybridmem.HybridConfig` (``None``: defaults).
        vllm_dtype: The dtype vLLM holds the weights in (``None``: the trainer model's).
        lora_sync: How a PEFT LoRA model reaches vLLM: ``"adapters"`` (default; :class:`~hybridmem.
            weight_sync.LoraSync`, vLLM built with LoRA) or ``"merged"`` (the whole model, each adapter
            merged in out of place); ignored without LoRA.

    Raises:
        ValueError: ``args`` without co-located vLLM; an unknown ``lora_sync``.
        TypeError: An argument ``trl.GRPOTrainer`` does not take.

    Attributes:
        hybrid_manager: The :class:`~hybridmem.ShardingManager` (``None`` until the optimizer exists).
        hybrid_engine: The :class:`~hybridmem.adapters.vllm.VLLMEngine` around TRL's ``LLM``.
        hybrid_reports: One :class:`GenerationSwitches` per generation.
    """

    def __init__(self, *args: Any, hybrid_config: HybridConfig | None = None, vllm_dtype: Any = None,
                 lora_sync: LoraRoute | str = LoraRoute.ADAPTERS, **kwargs: Any):
        bound = _bind_trl_arguments(args, kwargs)
        grpo_args = bound.arguments.get("args")
        _check_args(grpo_args)
        try:
            self.hybrid_lora_sync = LoraRoute(lora_sync)
        except ValueError:
            raise ValueError(f"lora_sync={lora_sync!r}: use one of {[r.value for r in LoraRoute]}") from None
        grpo_args = copy.copy(grpo_args)  # the caller's config object is left as it was
        grpo_args.vllm_enable_sleep_mode = _vllm_has_sleep_mode()
        bound.arguments["args"] = grpo_args
        self.hybrid_config = HybridConfig() if hybrid_config is None else hybrid_config
        self.hybrid_manager: Any = None
        self.hybrid_reports: list[GenerationSwitches] = []
        model = bound.arguments.get("model")
        if vllm_dtype is None and isinstance(model, torch.nn.Module):
            vllm_dtype = next(model.parameters()).dtype
        rank = _lora_rank(bound.arguments.get("peft_config"), model)
        lora_rank = rank if rank and self.hybrid_lora_sync is LoraRoute.ADAPTERS else None
        with _building_llm(vllm_dtype, lora_rank):
            super().__init__(*bound.args, **bound.kwargs)
        self.hybrid_engine = self._wrap_engine()

    # Building the parts -----------------------------------------------------------------------------
    def _wrap_engine(self) -> Any:
        """TRL's ``LLM`` as a VLLMEngine; TRL's own sleep/wake and weight sync switched off."""
        from hybridmem.adapters.vllm import VLLMEngine  # noqa: PLC0415

        generation = self.vllm_generation
        engine = VLLMEngine(generation.llm)  # released (asleep) until the first switch
        generation.enable_sleep_mode = False  # TRL must not sleep or wake the engine: the manager does
        generation._llm_weights_sleeping = False
        generation.sync_weights = _no_sync  # the TRAIN->INFER switch syncs the weights
        original = generation.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            with self.hybrid_inference():
                return original(*args, **kwargs)

        generation.generate = generate
        return engine

    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        """TRL's optimizer; then the manager over the model, that optimizer and the engine."""
        optimizer = super().create_optimizer(*args, **kwargs)
        if self.hybrid_manager is None:
            self.hybrid_manager = self._build_manager(optimizer)
        return optimizer

    def _build_manager(self, optimizer: Any) -> Any:
        from accelerate.utils import is_peft_model  # noqa: PLC0415

        from hybridmem.manager import ShardingManager  # noqa: PLC0415
        from hybridmem.weight_sync import LoadWeightsSync, LoraSync  # noqa: PLC0415

        model = self.accelerator.unwrap_model(self.model)
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds the torch optimizer
        weight_sync = None
        if is_peft_model(model) and self.hybrid_engine.lora_enabled:
            weight_sync = LoraSync(model, self.hybrid_engine)
        elif is_peft_model(model):
            weight_sync = LoadWeightsSync(lambda: merged_lora_weights(model), self.hybrid_engine)
        manager = ShardingManager(model, self.hybrid_engine, optimizer=inner, config=self.hybrid_config,
                                  weight_sync=weight_sync)
        if getattr(self, "ref_model", None) is not None:
            manager.add_coresident(REFERENCE_OWNER, self.accelerator.unwrap_model(self.ref_model))
        return manager

    # Generation inside a switch ---------------------------------------------------------------------
    @contextmanager
    def hybrid_inference(self) -> Iterator[Any]:
        """``hybrid_manager.inference(retries=1)``: a TRAIN->INFER switch that rolled back is tried again."""
        manager = self.hybrid_manager
        if manager is None:
            raise RuntimeError("HybridGRPOTrainer generated before its optimizer existed (create_optimizer "
                               "builds the manager); call trainer.train()")
        with manager.inference(retries=1) as engine:
            to_infer = manager.last_reports[Direction.TO_INFER]
            yield engine
        record = GenerationSwitches(int(self.state.global_step), to_infer,
                                    manager.last_reports[Direction.TO_TRAIN], manager.last_rollbacks > 0)
        self.hybrid_reports.append(record)
        self._log_switches(record)

    def _log_switches(self, record: GenerationSwitches) -> None:
        metrics = getattr(self, "_metrics", None)
        if metrics is None:
            return
        mode = "train" if self.model.training else "eval"
        metrics[mode]["hybridmem/to_infer_s"].append(record.to_infer.seconds)
        metrics[mode]["hybridmem/to_train_s"].append(record.to_train.seconds)
        metrics[mode]["hybridmem/offloaded_bytes"].append(float(sum(record.offloaded_nbytes.values())))
        metrics[mode]["hybridmem/host_bytes"].append(float(record.to_infer.host_nbytes))
        metrics[mode]["hybridmem/synced_bytes"].append(float(record.synced_nbytes))

    # The reference model, on the device only while it scores ---------------------------------------
    def _get_per_token_logps_and_entropies(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        manager = self.hybrid_manager
        reference = getattr(self, "ref_model", None)
        if manager is not None and REFERENCE_OWNER in manager.coresidents and model is reference:
            with manager.onloaded(REFERENCE_OWNER):
                return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)


def _lora_rank(peft_config: Any, model: Any) -> int | None:
    """The largest LoRA rank of ``peft_config`` (TRL's argument), else of a PEFT ``model``'s active
    adapter; ``None`` without LoRA."""
    if peft_config is None:
        configs = getattr(model, "peft_config", None)
        if not isinstance(configs, dict) or not configs:
            return None
        peft_config = configs.get(getattr(model, "active_adapter", None)) or next(iter(configs.values()))
    rank = getattr(peft_config, "r", None)
    if not isinstance(rank, int):
        return None
    return max([rank, *dict(getattr(peft_config, "rank_pattern", None) or {}).values()])


def _vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM offers at or above ``rank`` (its ``MaxLoRARanks``)."""
    import typing  # noqa: PLC0415

    from hybridmem.adapters.vllm.compat import import_vllm  # noqa: PLC0415

    offered = typing.get_args(getattr(import_vllm("vllm.config.lora"), "MaxLoRARanks", None))
    return min((r for r in offered if isinstance(r, int) and r >= rank), default=rank)


@contextmanager
def _building_llm(dtype: Any, lora_rank: int | None = None) -> Iterator[None]:
    """While TRL builds its ``LLM``: in ``dtype`` (unless TRL passes one), with the CPU build's KV cache
    sized as ``VLLMEngine.create`` sizes it, and with LoRA for adapters up to ``lora_rank`` (see [Note: TRL
    colocate through hybridmem])."""
    from trl.generation import vllm_generation  # noqa: PLC0415

    from hybridmem.adapters.vllm.compat import import_vllm, platform_is_cpu  # noqa: PLC0415
    from hybridmem.adapters.vllm.cpu_kv import cpu_kv_default  # noqa: PLC0415

    build = getattr(vllm_generation, "LLM", None)
    if build is None:  # TRL without vLLM: its own check raises the error
        yield
        return
    on_cpu = platform_is_cpu(import_vllm("vllm"))

    def llm(**kwargs: Any) -> Any:
        if dtype is not None:
            kwargs.setdefault("dtype", str(dtype).removeprefix("torch."))
        if on_cpu:
            utilization = float(kwargs.get("gpu_memory_utilization", 0.9))
            kwargs.update(cpu_kv_default(kwargs["model"], kwargs, utilization))
        if lora_rank:
            kwargs.update(enable_lora=True, max_lora_rank=_vllm_lora_rank(lora_rank), max_loras=1)
        return build(**kwargs)

    vllm_generation.LLM = llm
    try:
        yield
    finally:
        vllm_generation.LLM = build


def _no_sync() -> None:
    """TRL's ``sync_weights``, replaced: the TRAIN->INFER switch writes the weights (see [Note: TRL colocate
    through hybridmem])."""

