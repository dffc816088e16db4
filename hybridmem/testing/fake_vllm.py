"""A fake ``vllm.LLM`` for what vLLM's CPU build cannot show (a sleep mode that frees memory, in-place
writes into woken pools); the adapter is also tested against the real CPU build.

It mimics the signatures and the sleep-mode semantics read from vLLM's source (see [Note: vllm API
reference] in :mod:`hybridmem.adapters.vllm.compat`) and records every call, so tests can check the call
sequence. Memory is real CPU memory: a sleep really resizes the model's storages to 0 bytes (level 1
after a host backup), a wake-up re-allocates them (restored from the backup, or filled with NaN
garbage when discarded), and :class:`FakeDeviceAccelerator` reports the bytes the fake holds as used
device memory. The executor's quirks are reproduced: ``sleep`` while sleeping is ignored, and
``wake_up`` of a tag that is not sleeping is ignored. Passing these tests shows hybridmem's side of the
contract only; it proves nothing about vLLM itself.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridmem.accel import CpuAccelerator, MemoryFigures

__all__ = ["FakeDeviceAccelerator", "FakeLLM", "FakeSamplingParams", "make_fake_vllm_module"]

TAGS = ("weights", "kv_cache")


class FakeDeviceAccelerator(CpuAccelerator):
    """A CPU accelerator whose free-memory figure is ``capacity - used_nbytes`` (the fake LLM sets it)."""

    def __init__(self, capacity_nbytes: int = 1 << 30):
        super().__init__(capacity_nbytes=capacity_nbytes)
        self.used_nbytes = 0

    def memory_figures(self, tracked_nbytes: int = 0) -> MemoryFigures:
        return MemoryFigures(
            allocated_nbytes=tracked_nbytes,
            reserved_nbytes=tracked_nbytes,
            free_nbytes=self.capacity_nbytes - self.used_nbytes,
            total_nbytes=self.capacity_nbytes,
        )


@dataclass
class FakeSamplingParams:
    """``vllm.SamplingParams`` with the fields the adapter sets."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None
    stop_token_ids: list[int] | None = None


@dataclass(frozen=True)
class FakeLogprob:
    logprob: float


@dataclass(frozen=True)
class FakeCompletion:
    token_ids: list[int]
    logprobs: list[dict[int, FakeLogprob]] | None


@dataclass(frozen=True)
class FakeRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[FakeCompletion]


def _fake_load_weights(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """The fake model's ``load_weights``: copy full tensors by name; fails on unmapped storage."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    loaded = set()
    with torch.no_grad():
        for name, tensor in weights:
            dst = tensors[name]
            if dst.untyped_storage().nbytes() == 0:
                raise RuntimeError(f"fake vLLM: load_weights({name!r}) into unmapped memory (weights asleep)")
            dst.copy_(tensor)
            loaded.add(name)
    model.load_calls.append(sorted(loaded))
    return loaded


@dataclass
class _Worker:
    model: torch.nn.Module
    kv_cache: torch.Tensor
    backups: dict[int, torch.UntypedStorage] = field(default_factory=dict)
    saved_buffers: dict[str, torch.Tensor] = field(default_factory=dict)


class FakeLLM:
    """A fake ``vllm.LLM(enable_sleep_mode=True)`` with one in-process worker.

    Args:
        model: The worker's model; it gains a ``load_weights`` method and a ``load_calls`` list.
            Used for generation when it maps token ids ``[1, T]`` to logits ``[1, T, vocab]``.
        accel: Receives the bytes the fake maps and unmaps.
        kv_cache_nbytes: Size of the fake KV pool.
        kv_block_nbytes: Bytes of one KV block (``cache_config.num_gpu_blocks`` is the quotient).
        gpu_memory_utilization: Reported in ``cache_config``.
        backend: ``distributed_executor_backend`` reported in the config.
        enable_sleep_mode: Reported in the config.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        accel: FakeDeviceAccelerator,
        kv_cache_nbytes: int = 1 << 16,
        backend: str = "external_launcher",
        enable_sleep_mode: bool = True,
        kv_block_nbytes: int = 1024,
        gpu_memory_utilization: float = 0.5,
    ):
        model.load_weights = types.MethodType(_fake_load_weights, model)
        model.load_calls = []
        self.accel = accel
        self.worker = _Worker(model=model.eval(), kv_cache=torch.zeros(kv_cache_nbytes, dtype=torch.uint8))
        self.calls: list[tuple[Any, ...]] = []
        self.is_sleeping = False
        self.sleeping_tags: set[str] = set()
        self.prefix_cache: dict[tuple[int, ...], int] = {}  # prompt -> weights version it was computed with
        self.weights_version = 0
        self.stale_prefix_hits = 0
        self.llm_engine = types.SimpleNamespace(
            vllm_config=types.SimpleNamespace(
                model_config=types.SimpleNamespace(enable_sleep_mode=enable_sleep_mode),
                parallel_config=types.SimpleNamespace(distributed_executor_backend=backend),
                cache_config=types.SimpleNamespace(
                    num_gpu_blocks=kv_cache_nbytes // kv_block_nbytes,
                    gpu_memory_utilization=gpu_memory_utilization,
                ),
            )
        )
        self._sizes = {s._cdata: s.nbytes() for s in self._weight_storages()}
        self.accel.used_nbytes += self.pool_nbytes("weights") + self.pool_nbytes("kv_cache")

    # Memory pools ---------------------------------------------------------------------------------
    def _weight_storages(self) -> list[torch.UntypedStorage]:
        model = self.worker.model
        tensors = [*model.parameters(), *model.buffers()]
        storages = {t.untyped_storage()._cdata: t.untyped_storage() for t in tensors}
        return list(storages.values())

    def pool_nbytes(self, tag: str) -> int:
        """Bytes the pool of ``tag`` occupies when mapped."""
        if tag == "kv_cache":
            return self.worker.kv_cache.numel()
        model = self.worker.model
        tensors = {t.untyped_storage()._cdata: t for t in [*model.parameters(), *model.buffers()]}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def mapped(self, tag: str) -> bool:
        if tag == "kv_cache":
            return self.worker.kv_cache.untyped_storage().nbytes() > 0
        return all(s.nbytes() > 0 for s in self._weight_storages())

    # LLM API --------------------------------------------------------------------------------------
    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append(("reset_prefix_cache",))
        self.prefix_cache.clear()
        return True

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))
        self.reset_prefix_cache()
        if self.is_sleeping:  # the executor ignores it ("Executor is already sleeping.")
            return
        if level not in (1, 2):
            raise ValueError(f"fake vLLM: sleep level {level}")
        w = self.worker
        if level == 2:
            w.saved_buffers = {n: b.detach().clone() for n, b in w.model.named_buffers()}
        weights_nbytes = self.pool_nbytes("weights")
        for storage in self._weight_storages():
            if level == 1:
                w.backups[storage._cdata] = storage.clone()
            storage.resize_(0)
        w.kv_cache.untyped_storage().resize_(0)
        self.accel.used_nbytes -= weights_nbytes + w.kv_cache.numel()
        self.is_sleeping = True
        self.sleeping_tags = set(TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", None if tags is None else list(tags)))
        if not self.is_sleeping:  # "Executor is not sleeping."
            return
        tags = list(TAGS) if tags is None else list(tags)
        for tag in tags:
            if tag not in TAGS:
                raise ValueError(f"fake vLLM: unknown tag {tag!r}")
            if tag not in self.sleeping_tags:  # "Tag %s is not in sleeping tags"
                return
        w = self.worker
        for tag in tags:
            if tag == "kv_cache":
                w.kv_cache.untyped_storage().resize_(w.kv_cache.numel())
                self.accel.used_nbytes += w.kv_cache.numel()
                continue
            with torch.no_grad():
                for storage in self._weight_storages():
                    storage.resize_(self._sizes[storage._cdata])
                model = w.model
                for t in [*model.parameters(), *model.buffers()]:
                    backup = w.backups.get(t.untyped_storage()._cdata)
                    if backup is None and t.is_floating_point():
                        t.fill_(float("nan"))  # discarded: garbage until loaded
                for cdata, backup in w.backups.items():
                    dst = next(s for s in self._weight_storages() if s._cdata == cdata)
                    dst.copy_(backup)
                for name, b in model.named_buffers():
                    if name in w.saved_buffers:
                        b.copy_(w.saved_buffers[name])
                w.backups.clear()
                w.saved_buffers = {}
            self.accel.used_nbytes += self.pool_nbytes("weights")
            self.weights_version += 1
        self.sleeping_tags -= set(tags)
        self.is_sleeping = bool(self.sleeping_tags)

    def collective_rpc(
        self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> list:
        self.calls.append(("collective_rpc", getattr(method, "__name__", method)))
        kwargs = kwargs or {}
        if callable(method):
            return [method(self.worker, *args, **kwargs)]
        return [getattr(self.worker, method)(*args, **kwargs)]

    def apply_model(self, func: Any) -> list:
        self.calls.append(("apply_model", getattr(getattr(func, "func", func), "__name__", repr(func))))
        if not self.mapped("weights"):
            raise RuntimeError("fake vLLM: apply_model while the weights are asleep")
        result = func(self.worker.model)
        self.weights_version += 1
        return [result]

    @torch.no_grad()
    def generate(
        self,
        prompts: list[dict],
        sampling_params: FakeSamplingParams | list[FakeSamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[FakeRequestOutput]:
        self.calls.append(("generate", len(prompts)))
        if self.is_sleeping or not (self.mapped("weights") and self.mapped("kv_cache")):
            raise RuntimeError(f"fake vLLM: generate while sleeping (tags {sorted(self.sleeping_tags)})")
        if isinstance(sampling_params, list):  # vLLM: one per prompt, lengths must match
            if len(sampling_params) != len(prompts):
                raise ValueError("The lengths of prompts and sampling_params must be the same.")
            per_prompt = sampling_params
        else:
            per_prompt = [sampling_params or FakeSamplingParams()] * len(prompts)
        outputs = []
        for i, prompt in enumerate(prompts):
            ids = list(prompt["prompt_token_ids"])
            key = tuple(ids)
            if key in self.prefix_cache and self.prefix_cache[key] != self.weights_version:
                self.stale_prefix_hits += 1
            self.prefix_cache[key] = self.weights_version
            outputs.append(self._decode(str(i), ids, per_prompt[i]))
        return outputs

    def _decode(self, request_id: str, ids: list[int], sp: FakeSamplingParams) -> FakeRequestOutput:
        gen = torch.Generator().manual_seed(sp.seed if sp.seed is not None else 0)
        tokens, logprobs = list(ids), []
        for _ in range(sp.max_tokens):
            logits = self.worker.model(torch.tensor([tokens]))[0, -1].double()
            if torch.isnan(logits).any():
                raise RuntimeError("fake vLLM: NaN logits (weights were discarded and never loaded)")
            lp = torch.log_softmax(logits, -1)  # vLLM's default logprobs_mode="raw_logprobs"
            if sp.temperature == 0:
                token = int(logits.argmax())
            else:
                probs = torch.softmax(logits / sp.temperature, -1)
                token = int(torch.multinomial(probs, 1, generator=gen))
            tokens.append(token)
            logprobs.append({token: FakeLogprob(float(lp[token]))})
            if token in (sp.stop_token_ids or ()):
                break  # vLLM keeps a (non-special) stop token in the output
        new = tokens[len(ids):]
        completion = FakeCompletion(new, logprobs if sp.logprobs is not None else None)
        return FakeRequestOutput(request_id, ids, [completion])


def make_fake_vllm_module(build_llm: Any) -> types.ModuleType:
    """A stand-in ``vllm`` module: ``SamplingParams`` is :class:`FakeSamplingParams`, and
    ``LLM(**kwargs)`` records ``kwargs`` in ``module.llm_kwargs`` and the environment it was built in in
    ``module.llm_environ``, re-seeds torch's global generator as vLLM's ``seed`` does, and returns
    ``build_llm(**kwargs)``."""
    module = types.ModuleType("vllm")
    module.SamplingParams = FakeSamplingParams
    module.llm_kwargs = []
    module.llm_environ = []

    def LLM(**kwargs: Any) -> Any:  # noqa: N802 - mimics the class name
        module.llm_kwargs.append(kwargs)
        module.llm_environ.append(dict(os.environ))
        torch.manual_seed(int(kwargs.get("seed", 0)))
        return build_llm(**kwargs)

    module.LLM = LLM
    return module
