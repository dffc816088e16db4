"""LoRA adapters in an in-process vLLM: one version at a time, installed from tensors in memory.

In the engine's process, :class:`LoraVersions`; in the worker (through ``collective_rpc``), what its LoRA
serves (:func:`probe_lora`) and one adapter version installed (:func:`install_lora`), read back from the
slots the forward pass uses.

[Note: vllm lora from memory]
vLLM loads an adapter named by a ``LoRARequest`` from a directory, once per ``lora_int_id``: a request
whose id the worker holds reuses the loaded adapter whatever its path says. In process (see [Note: vllm
co-location] in :mod:`hybridmem.adapters.vllm.inprocess.engine`) the adapter goes in without a file:
the worker's own ``LoRAModel.from_lora_tensors`` builds it from the trainer's tensors (copies) and the
worker's LoRA model manager registers and activates it, exactly as its ``add_adapter`` does after
reading a directory.
Every version gets a new ``lora_int_id`` and every older version is removed first, so no older version
can be served; the id also keys vLLM's prefix cache, so cached blocks of an older version are never
reused. A request naming an older id would make vLLM read its path, :data:`IN_MEMORY_PATH`, which does
not exist, and vLLM 0.32's in-process engine core does not survive that failed load (the next generate
hangs), so :class:`~hybridmem.adapters.vllm.VLLMEngine` refuses such a request before vLLM sees it and
gives a request naming no adapter the latest version (:class:`LoraVersions` wraps its ``llm.generate``).
After activation the worker sums what each LoRA module holds in its slot (``lora_a_stacked``/
``lora_b_stacked``, what the punica kernels read), so the sync can check them against the trainer's
tensors.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridmem.adapters.vllm.compat import attr_path, import_vllm

__all__ = ["IN_MEMORY_PATH", "LoraInfo", "LoraInstall", "LoraVersions", "install_lora", "lora_worker_manager",
           "probe_lora", "remove_loras"]

NO_LORA = "the vllm.LLM was built without LoRA: build it with enable_lora=True, max_lora_rank>=r"

IN_MEMORY_PATH = "/nonexistent/hybridmem-lora-from-memory"
"""The ``lora_path`` of an adapter installed from memory: no directory, so vLLM can never load it from there
(see [Note: vllm lora from memory])."""


@dataclass(frozen=True, slots=True)
class LoraInfo:
    """What the worker's LoRA serves."""

    max_lora_rank: int
    max_loras: int
    lora_dtype: str
    """The element type of the adapter slots (``torch.float32`` ...), as a string."""
    modules: tuple[str, ...]
    """vLLM's module names that take an adapter, each packed module by the names of its parts (a fused
    ``qkv_proj`` as ``q_proj``, ``k_proj``, ``v_proj``), as an adapter checkpoint names them."""
    max_position_embeddings: int | None = None


@dataclass(frozen=True, slots=True)
class LoraInstall:
    """What :func:`install_lora` left in the worker."""

    lora_id: int
    slot_sums: dict[str, tuple[tuple[float, float], ...]]
    """Per LoRA module of vLLM holding weights: per slice (a packed module's parts, in order), the float64
    sums of its ``lora_a`` and ``lora_b`` slot (``lora_b`` as vLLM keeps it: times the adapter's scaling)."""
    packed: dict[str, tuple[str, ...]]
    """vLLM's packed modules, each with the names of its parts, in slice order."""
    loaded: tuple[int, ...]
    """The adapter ids the worker holds afterwards."""


def lora_worker_manager(worker: Any) -> Any:
    """The worker's ``WorkerLoRAManager``.

    Raises:
        ValueError: vLLM was built without ``enable_lora=True``.
    """
    manager = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    if manager is None:
        raise ValueError(NO_LORA)
    return manager


def probe_lora(worker: Any) -> LoraInfo:
    """Run in the worker through ``collective_rpc``: what its LoRA serves."""
    manager = lora_worker_manager(worker)
    adapters = manager._adapter_manager
    modules: list[str] = []
    for name in adapters.modules:
        parts = adapters.packed_modules.get(name)
        modules.extend(parts if parts else [name])
    config = manager.lora_config
    return LoraInfo(max_lora_rank=int(config.max_lora_rank), max_loras=int(config.max_loras),
                    lora_dtype=str(config.lora_dtype), modules=tuple(modules),
                    max_position_embeddings=manager.max_position_embeddings)


def install_lora(worker: Any, *, lora_id: int, tensors: Mapping[str, torch.Tensor],
                 config: Mapping[str, Any]) -> LoraInstall:
    """Run in the worker through ``collective_rpc``: build the adapter from ``tensors`` (PEFT's
    ``adapter_model.safetensors`` names) and ``config`` (its ``adapter_config.json``), remove every adapter
    the worker holds, register and activate this one as ``lora_id``, and sum its slots (see [Note: vllm
    lora from memory]).

    Raises:
        ValueError: vLLM refuses the configuration (``PEFTHelper.validate_legal``: a rank above
            ``max_lora_rank``, DoRA, ...).
    """
    from vllm.lora.lora_model import LoRAModel  # noqa: PLC0415 - vLLM, imported in the worker only
    from vllm.lora.peft_helper import PEFTHelper  # noqa: PLC0415 - vLLM, imported in the worker only

    manager = lora_worker_manager(worker)
    adapters = manager._adapter_manager
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id, tensors=dict(tensors), peft_helper=helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    for old in list(adapters.list_adapters()):
        adapters.remove_adapter(old)
    adapters.add_adapter(lora)
    adapters.activate_adapter(lora_id)
    slot = adapters.lora_index_to_id.index(lora_id)
    sums: dict[str, tuple[tuple[float, float], ...]] = {}
    with torch.no_grad():
        for name, module in adapters.modules.items():
            if adapters._get_lora_layer_weights(lora, name) is None:
                continue
            sums[name] = tuple((float(a[slot].double().sum()), float(b[slot].double().sum()))
                               for a, b in zip(module.lora_a_stacked, module.lora_b_stacked, strict=False))
    return LoraInstall(lora_id=lora_id, slot_sums=sums,
                       packed={k: tuple(v) for k, v in adapters.packed_modules.items()},
                       loaded=tuple(sorted(adapters.list_adapters())))


def remove_loras(worker: Any) -> None:
    """Run in the worker through ``collective_rpc``: remove every adapter it holds."""
    lora_worker_manager(worker).remove_all_adapters()


class LoraVersions:
    """The adapter a ``vllm.LLM`` serves, one version at a time (see [Note: vllm lora from memory]).

    Every ``llm.generate`` call, the caller's own included (TRL's), runs with the latest version: a call
    without ``lora_request`` gets it, and one naming another adapter is refused by name before vLLM sees it
    (vLLM's in-process engine core fails for good on an adapter it cannot load).
    """

    def __init__(self, llm: Any):
        self.llm = llm
        self.request: Any = None
        """The ``LoRARequest`` of the version installed last (``None`` before any, and after :meth:`drop`)."""
        self._versions = itertools.count(1)
        if self.enabled:
            self._guard_requests()

    @property
    def enabled(self) -> bool:
        return self._lora_config is not None

    @property
    def _lora_config(self) -> Any:
        return attr_path(self.llm, "llm_engine.vllm_config.lora_config")

    @functools.cached_property
    def info(self) -> LoraInfo:
        (info,) = self.llm.collective_rpc(probe_lora)
        return info

    def refusals(self, config: Mapping[str, Any]) -> list[str]:
        """vLLM's own check of a PEFT configuration (``PEFTHelper.validate_legal``); empty if it takes it."""
        lora_config = self._lora_config
        if lora_config is None:
            raise ValueError(NO_LORA)
        helper = import_vllm("vllm.lora.peft_helper").PEFTHelper
        try:
            helper.from_dict({**config, "vllm_max_position_embeddings": self.info.max_position_embeddings}
                             ).validate_legal(lora_config)
        except (ValueError, TypeError) as exc:
            return [str(exc)]
        return []

    def install(self, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], *,
                name: str) -> LoraInstall:
        """Install copies of ``tensors`` as the next version, removing the older ones."""
        if not self.enabled:
            raise ValueError(NO_LORA)
        request_cls = import_vllm("vllm.lora.request").LoRARequest
        version = next(self._versions)
        self.request = None  # until the new version is in, no request names an adapter
        # [Note: loaders write what they are given] in :mod:`hybridmem.weight_sync.streamed`
        copies = {k: t.detach().clone() for k, t in tensors.items()}
        (installed,) = self.llm.collective_rpc(
            functools.partial(install_lora, lora_id=version, tensors=copies, config=dict(config)))
        self.request = request_cls(lora_name=f"{name}-v{version}", lora_int_id=version,
                                   lora_path=IN_MEMORY_PATH)
        return installed

    def drop(self) -> None:
        """Remove every adapter from the worker: generation serves the base weights again."""
        self.request = None
        if self.enabled:
            self.llm.collective_rpc(remove_loras)

    def _guard_requests(self) -> None:
        """Wrap ``llm.generate`` so that every call runs with the latest version (see the class docstring)."""
        generate = self.llm.generate
        versions = weakref.ref(self)

        def generate_with_latest_adapter(*args: Any, **kwargs: Any) -> Any:
            current = getattr(versions(), "request", None)
            asked = kwargs.get("lora_request")
            for request in asked if isinstance(asked, (list, tuple)) else [asked]:
                if request is not None and (current is None or request.lora_int_id != current.lora_int_id):
                    raise ValueError(
                        f"lora_request {getattr(request, 'lora_name', request)!r} (id {request.lora_int_id}) "
                        f"is not the adapter this engine serves now "
                        f"({None if current is None else current.lora_name!r}): a weight sync replaced it; "
                        f"pass engine.lora_request, or none"
                    )
            if asked is None and current is not None:
                kwargs["lora_request"] = current
            return generate(*args, **kwargs)

        self.llm.generate = generate_with_latest_adapter
