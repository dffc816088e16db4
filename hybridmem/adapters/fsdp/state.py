"""FSDP2 (``torch.distributed.fsdp.fully_shard``) training state for ShardingManager.

>>> for layer in model.model.layers:                                          # doctest: +SKIP
...     fully_shard(layer)
>>> fully_shard(model)                                                        # doctest: +SKIP
>>> manager = ShardingManager(model, engine, optimizer=opt, model_spec=model.config,
...                           config=HybridConfig(infer_tensor_parallel_size=2))   # doctest: +SKIP

The manager recognises a model with ``fully_shard`` applied and wraps it in :class:`FSDPTrainingState`
itself; it attaches the state (:meth:`FSDPTrainingState.attach`), so every TRAIN->INFER switch first
drops FSDP2's unsharded parameters and communication buffers ([Note: FSDP2 buffers in INFER]), then
offloads the local shards of optimizer state and grads, reshards the local parameter shards straight
into the engine's TP layout (:mod:`hybridmem.reshard.hf_source`), and offloads them. Switch between
optimizer steps (after ``optimizer.step()``, before the next forward).

[Note: FSDP2 buffers in INFER]
Besides the sharded parameters, FSDP2 keeps device memory across steps that training does not need
while the engine runs: the unsharded parameters of modules not resharded after forward (the root's
after a forward without backward, or any module with ``reshard_after_forward=False``), and in its
communication context the last all-gather result (``all_gather_state``) and the last reduce-scatter
inputs (``reduce_scatter_states``), kept only so another stream does not reuse them too early. The
release step calls ``FSDPModule.reshard()`` on every FSDP module (FSDP2 frees the unsharded storages
itself) and, once each kept buffer's event has completed, drops the references, as FSDP2 does at its
next collective. None of them is state: FSDP2 all-gathers again at the next forward, so there is
nothing to undo. :meth:`FSDPTrainingState.unsharded_nbytes` counts what is left (0 in INFER).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from hybridmem.accel import Accelerator
from hybridmem.adapters.fsdp.offload import (
    FSDPGradOffloader,
    FSDPOptimizerOffloader,
    FSDPParamOffloader,
    local_tensor,
)
from hybridmem.adapters.torch import check_optimizer_owns
from hybridmem.config import HybridConfig
from hybridmem.contract.kinds import StateKind
from hybridmem.contract.training import TrainingCapabilities
from hybridmem.offload import Offloader
from hybridmem.offload.host_pool import HostBufferPool
from hybridmem.reshard.hf_source import (
    HFSourceLayout,
    hf_module_tensors,
    hf_source_layout,
)
from hybridmem.reshard.spec import ModelSpec
from hybridmem.switch.phase import Direction, Phase
from hybridmem.switch.steps import FSDP_BUFFERS, ReleaseBuffersStep

__all__ = ["FSDPTrainingState", "is_fsdp_model", "UNSHARDED_OWNER"]

UNSHARDED_OWNER = "fsdp unsharded"
"""Residency owner of FSDP2's unsharded parameters and communication buffers (empty in INFER)."""


def is_fsdp_model(model: Any) -> bool:
    """Whether ``model`` (a module or a list of them) has ``fully_shard`` applied to it or inside it."""
    if isinstance(model, torch.nn.Module):
        modules = [model]
    else:
        modules = list(model) if isinstance(model, (list, tuple)) else []
    return any(isinstance(m, FSDPModule) for root in modules if isinstance(root, torch.nn.Module)
               for m in root.modules())


def _wait(event: Any) -> None:
    if event is not None:
        event.synchronize()


class _FSDPBuffers:
    """FSDP2's per-module states and shared communication contexts of some modules."""

    def __init__(self, modules: list[torch.nn.Module]):
        self.fsdp_modules = [m for root in modules for m in root.modules() if isinstance(m, FSDPModule)]

    def _states(self) -> list[Any]:
        return [m._get_fsdp_state() for m in self.fsdp_modules]  # FSDP2's state object

    def _comm_contexts(self) -> list[Any]:
        seen: dict[int, Any] = {}
        for state in self._states():
            ctx = getattr(state, "_comm_ctx", None)
            if ctx is not None:
                seen.setdefault(id(ctx), ctx)
        return list(seen.values())

    def sharded_params(self) -> list[torch.nn.Parameter]:
        """The sharded parameters FSDP2 registers between forward and backward (a module left unsharded
        after a forward shows its unsharded ones instead); an optimizer holds these."""
        return [fsdp_param.sharded_param for state in self._states()
                for group in getattr(state, "_fsdp_param_groups", ()) for fsdp_param in group.fsdp_params]

    def nbytes(self) -> int:
        """Bytes of unsharded parameters and kept communication buffers."""
        seen: set[int] = set()
        total = 0

        def add(t: Any) -> None:
            nonlocal total
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
                storage = t.untyped_storage()
                if storage._cdata not in seen:  # storage identity, as the offloaders use
                    seen.add(storage._cdata)
                    total += storage.nbytes()

        for state in self._states():
            for group in getattr(state, "_fsdp_param_groups", ()):
                for fsdp_param in group.fsdp_params:
                    for t in getattr(fsdp_param, "all_gather_outputs", ()):
                        add(t)
                result = getattr(group, "_all_gather_result", None)
                if result is not None:
                    add(result.all_gather_output)
        for ctx in self._comm_contexts():
            if getattr(ctx, "all_gather_state", None) is not None:
                add(ctx.all_gather_state.all_gather_result.all_gather_output)
            for rs in getattr(ctx, "reduce_scatter_states", ()):
                add(rs.reduce_scatter_input)
        return total

    def release(self) -> int:
        """Reshard every FSDP module and drop the kept communication buffers; returns bytes freed."""
        before = self.nbytes()
        for m in self.fsdp_modules:
            m.reshard()
        for ctx in self._comm_contexts():
            state = getattr(ctx, "all_gather_state", None)
            if state is not None:
                _wait(state.event)
                ctx.all_gather_state = None
            states = getattr(ctx, "reduce_scatter_states", None)
            if states:
                for rs in states:
                    _wait(rs.event)
                states.clear()
        return before - self.nbytes()


class FSDPTrainingState:
    """An FSDP2 model (``fully_shard`` applied) and its optimizer(s), as a
    :class:`~hybridmem.contract.training.TrainingState`.

    Weights keep transformers' names; each rank holds the ``Shard(0)`` local part of every DTensor
    parameter. Parameters no ``fully_shard`` reached, and buffers, are held whole on every rank.

    Args:
        model: The module (or a list of module chunks) with ``fully_shard`` applied.
        optimizer: A ``torch.optim.Optimizer`` over its parameters (or several, or ``None``).

    Raises:
        TypeError: ``model`` has no ``fully_shard`` module.
    """

    capabilities = TrainingCapabilities(guards_misuse=True, attaches_itself=True, describes_model=True,
                                        shards_weights=True, reports_layout=True)
    """Misuse guards; :meth:`attach` (the manager calls it); the model's HF config; local shards, which
    cannot be streamed into an engine as they are (see ``default_weight_sync``)."""

    def __init__(self, model: torch.nn.Module | Iterable[torch.nn.Module], optimizer: Any = None):
        self.modules = [model] if isinstance(model, torch.nn.Module) else list(model)
        if not is_fsdp_model(self.modules):
            raise TypeError(f"model {type(model).__name__} has no fully_shard module; "
                            f"use it without FSDPTrainingState")
        self.buffers = _FSDPBuffers(self.modules)
        check_optimizer_owns(self.modules, optimizer, also=self.buffers.sharded_params())
        self.optimizer = optimizer
        self._attached: set[int] = set()

    def _named(self, with_buffers: bool) -> Iterator[tuple[str, Any]]:
        for i, m in enumerate(self.modules):
            prefix = "" if len(self.modules) == 1 else f"{i}."
            items = [*m.named_parameters(), *(m.named_buffers() if with_buffers else ())]
            for name, t in items:
                yield prefix + name, t

    def build_offloaders(self, accel: Accelerator, pool: HostBufferPool,
                         config: HybridConfig) -> dict[StateKind, Offloader]:
        offloaders: dict[StateKind, Offloader] = {
            StateKind.PARAM: FSDPParamOffloader(self.modules, accel, pool),
            StateKind.GRAD: FSDPGradOffloader(self.modules, accel, pool, skip_zero=config.skip_zero_grads),
        }
        if self.optimizer is not None:
            offloaders[StateKind.OPTIMIZER] = FSDPOptimizerOffloader(self.optimizer, accel, pool)
        return offloaders

    def attach(self, manager: Any) -> None:
        """Register the buffer release step (first in TRAIN->INFER) and the ``fsdp unsharded`` residency
        owner (expected empty in INFER) with ``manager``; a second call for the same manager is a no-op.
        ``ShardingManager`` calls it for a state it builds or is given."""
        if id(manager) in self._attached:
            return
        manager.register_step(Direction.TO_INFER,
                              ReleaseBuffersStep(self.buffers, FSDP_BUFFERS), FSDP_BUFFERS.order)
        manager.register_owner(UNSHARDED_OWNER, self.buffers.nbytes, empty_in=(Phase.INFER,))
        self._attached.add(id(manager))

    def guard_targets(self) -> tuple[list[torch.nn.Module], list[Any]]:
        """The modules and optimizers that refuse work outside TRAIN (see [Note: misuse guards] in
        :mod:`hybridmem.switch.guards`); the forward guard runs before FSDP2's own pre-forward, so a refused
        forward starts no all-gather."""
        opts = self.optimizer if isinstance(self.optimizer, (list, tuple)) else [self.optimizer]
        return list(self.modules), [o for o in opts if o is not None]

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """This rank's local shards of the parameters, and the buffers, by transformers' names."""
        for name, t in self._named(with_buffers=True):
            yield name, local_tensor(t).detach()

    def unsharded_nbytes(self) -> int:
        """Bytes FSDP2 holds beside the sharded parameters (see [Note: FSDP2 buffers in INFER])."""
        return self.buffers.nbytes()

    parallel_layout = {"tp": 1, "pp": 1, "ep": 1}
    """Transformers' names, unsharded by TP/PP/EP (FSDP2 shards are read by :meth:`hf_source_layout`)."""

    def model_spec_dict(self) -> dict[str, Any]:
        """The HF config of the model (``model.config.to_dict()``), for the weight sync's spec.

        Raises:
            ValueError: The model has no transformers ``config``.
        """
        cfg = getattr(self.modules[0], "config", None)
        if cfg is None or not callable(getattr(cfg, "to_dict", None)):
            raise ValueError(f"{type(self.modules[0]).__name__} has no transformers config; pass model_spec=")
        return cfg.to_dict()

    def hf_source_layout(self, spec: ModelSpec, world_size: int, group: Any = None) -> HFSourceLayout:
        """Where every rank's tensors come from (see [Note: FSDP2 shards] in
        :mod:`hybridmem.reshard.hf_source`), read off the parameters' placements and meshes. Every FSDP
        module is resharded first (``FSDPModule.reshard()``), so that a module left unsharded by a
        forward is read as FSDP2 holds it between steps.

        Raises:
            ValueError: A parameter is placed other than ``Shard(0)`` (after an optional ``Replicate()``
                dimension, HSDP), parameters use meshes of different sizes, or the mesh ranks are not
                the resharding group's ranks in order.
        """
        for m in self.buffers.fsdp_modules:
            m.reshard()
        fused = any(n.endswith("mlp.experts.gate_up_proj") for n, _ in self._named(False)) or not spec.is_moe
        names = hf_module_tensors(spec, fused)
        shard_sizes: set[int] = set()
        replicated = []
        for name, t in self._named(with_buffers=True):
            if name not in names:
                continue
            if not isinstance(t, DTensor):
                replicated.append(name)
                continue
            placements = tuple(t.placements)
            if placements[-1] != Shard(0) or any(p != Replicate() for p in placements[:-1]):
                raise ValueError(f"{name} is placed {placements} on its mesh; expected (Shard(0),) or "
                                 f"(Replicate(), Shard(0)) as fully_shard places parameters")
            mesh = t.device_mesh
            ranks = mesh.mesh.flatten().tolist()
            expected = [dist.get_global_rank(group, r) if group is not None else r for r in range(world_size)]
            if ranks != expected:
                raise ValueError(f"{name} lives on mesh ranks {ranks}; expected the resharding group's ranks "
                                 f"{expected} in order (shard dimension innermost)")
            shard_sizes.add(mesh.size(mesh.ndim - 1))
        if len(shard_sizes) > 1:
            raise ValueError(f"parameters are sharded over meshes of different sizes {sorted(shard_sizes)}")
        return hf_source_layout(spec, world_size, shard_size=shard_sizes.pop() if shard_sizes else 1,
                                replicated=replicated, fused_experts=fused)
