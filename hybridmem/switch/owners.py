"""Who holds device memory: bytes by owner, the residency report, and the budget a memory plan is held to.

Owners are the training state's offloaders (params, grads, optimizer state), the engine's tags (weights,
KV cache) and what it holds in the trainer's process in both phases (an engine in its own process: its
transfer buckets), co-resident models and owners registered by adapters (FSDP2's unsharded buffers). The
manager asks :class:`DeviceOwners` before and after every switch step; the figures feed the reports, the
residency check (what should be empty in a phase) and the memory plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hybridmem.accel import Accelerator, CpuAccelerator, MemoryFigures
from hybridmem.contract.engine import InferenceEngine, capabilities_of
from hybridmem.contract.kinds import ENGINE_TAGS, KV_CACHE, WEIGHTS, StateKind
from hybridmem.offload import Offloader
from hybridmem.offload.host_pool import HostBufferPool
from hybridmem.switch.colocate import CoResident, CoResidentState
from hybridmem.switch.memplan import MemoryPlan, StepEstimate, plan_switch
from hybridmem.switch.phase import Direction, Phase
from hybridmem.switch.residency import ResidencyReport

__all__ = ["DeviceOwners", "OFFLOADER_OWNERS", "ENGINE_OWNERS", "ENGINE_BUFFERS_OWNER"]

OFFLOADER_OWNERS = {
    StateKind.PARAM: "train param",
    StateKind.GRAD: "train grad",
    StateKind.OPTIMIZER: "optimizer",
}
"""Owner names of the training state's offloaders."""
ENGINE_OWNERS = {WEIGHTS: "engine weights", KV_CACHE: "kv cache"}
"""Owner names of the engine's memory tags."""
ENGINE_BUFFERS_OWNER = "engine buckets"
"""Owner name of what an engine holds in the trainer's process in both phases (``holds_buffers``)."""
assert set(ENGINE_OWNERS) == set(ENGINE_TAGS), "every engine tag needs an owner name"


class DeviceOwners:
    """Device bytes by owner for one manager.

    Args:
        accel: The accelerator (memory figures, budget).
        offloaders: The training state's offloaders by kind.
        enabled: Which kinds the config offloads (those should be empty in INFER).
        engine: The inference engine or ``None``; its ``resident_nbytes(tag)`` is read when it has one.
        coresidents: The manager's co-resident models by name (the same dict, read live).
        device_budget_nbytes: ``HybridConfig.device_memory_budget_bytes``.
        engine_tags_stay: The engine's tags that stay resident through TRAIN ([Note: lora base] in
            :mod:`hybridmem.switch.lora_base`): they are not a leftover there.
    """

    def __init__(self, accel: Accelerator, offloaders: Mapping[StateKind, Offloader],
                 enabled: Mapping[StateKind, bool],
                 engine: InferenceEngine | None, coresidents: Mapping[str, CoResident],
                 device_budget_nbytes: int | None,
                 engine_tags_stay: frozenset[str] = frozenset()):
        self.accel = accel
        self.offloaders = offloaders
        self.enabled = enabled
        self.engine = engine
        self.coresidents = coresidents
        self.device_budget_nbytes = device_budget_nbytes
        self.engine_tags_stay = engine_tags_stay
        self._extra: dict[str, tuple[Callable[[], int], tuple[Phase, ...]]] = {}

    def register(self, name: str, resident_nbytes: Callable[[], int], *,
                 empty_in: tuple[Phase, ...] = ()) -> None:
        """Count ``resident_nbytes()`` as owner ``name``; a leftover in the phases ``empty_in``.

        Raises:
            ValueError: ``name`` is already an owner.
        """
        if name in self.nbytes():
            raise ValueError(f"owner {name!r} is already registered")
        self._extra[name] = (resident_nbytes, tuple(empty_in))

    def nbytes(self) -> dict[str, int]:
        """Device bytes held now, by owner."""
        owners = {OFFLOADER_OWNERS.get(k, str(k)): off.resident_nbytes()
                  for k, off in self.offloaders.items()}
        if self.engine is not None:
            reports = capabilities_of(self.engine).reports_residency
            for tag, name in ENGINE_OWNERS.items():
                owners[name] = int(self.engine.resident_nbytes(tag)) if reports else 0
            if capabilities_of(self.engine).holds_buffers:  # held in both phases: never a leftover
                owners[ENGINE_BUFFERS_OWNER] = int(self.engine.buffer_nbytes())
        for name, (fn, _) in self._extra.items():
            owners[name] = int(fn())
        for name, co in self.coresidents.items():
            owners[name] = co.resident_nbytes()
        return owners

    def memory(self) -> MemoryFigures:
        """Device memory figures now (on CPU, "allocated" is the sum over the owners)."""
        return self.accel.memory_figures(sum(self.nbytes().values()))

    def residency(self, phase: Phase) -> ResidencyReport:
        """Device bytes by owner now; owners that should be empty in ``phase`` are flagged."""
        owners = self.nbytes()
        figures = self.accel.memory_figures(sum(owners.values()))
        expected_empty: list[str] = []
        if phase is Phase.INFER:
            expected_empty += [OFFLOADER_OWNERS[k] for k in self.offloaders
                               if self.enabled.get(k) and k in OFFLOADER_OWNERS]
        if phase is Phase.TRAIN:
            expected_empty += [name for tag, name in ENGINE_OWNERS.items()
                               if tag not in self.engine_tags_stay]
        expected_empty += [n for n, (_, phases) in self._extra.items() if phase in phases]
        expected_empty += [n for n, co in self.coresidents.items() if co.state is CoResidentState.OFFLOADED]
        return ResidencyReport(
            phase=phase,
            by_owner=owners,
            allocated_nbytes=figures.allocated_nbytes,
            reserved_nbytes=figures.reserved_nbytes,
            expected_empty=tuple(expected_empty),
            device_used_nbytes=(figures.total_nbytes - figures.free_nbytes
                                if self.accel.measures_device_memory else None),
        )

    def plan(self, direction: Direction, estimates: list[tuple[str, StepEstimate]]) -> MemoryPlan:
        """The predicted memory curve of ``estimates`` from now, against the device budget: the config's,
        else the CPU's capacity, else what is allocated plus what the device and its allocator have free;
        and the host buffer pool's curve against its budget (``host_memory_budget_bytes``, see [Note:
        host memory plan] in :mod:`hybridmem.switch.memplan`)."""
        figures = self.memory()
        if self.device_budget_nbytes is not None:
            budget, source = self.device_budget_nbytes, "device_memory_budget_bytes"
        elif isinstance(self.accel, CpuAccelerator):
            budget, source = figures.total_nbytes, "cpu capacity_nbytes"
        else:
            budget = figures.allocated_nbytes + figures.free_nbytes + figures.cached_nbytes
            source = "allocated + device free + allocator cache"
        pool = self._pool()
        return plan_switch(direction, figures.allocated_nbytes, estimates, budget_nbytes=budget,
                           budget_source=source,
                           host_start_nbytes=0 if pool is None else pool.reserved_nbytes(),
                           host_budget_nbytes=None if pool is None else pool.budget_nbytes)

    def _pool(self) -> HostBufferPool | None:
        """The host buffer pool the offloaders share (the manager builds them all on its own); ``None``
        without offloaders."""
        pools = {id(off.pool): off.pool for off in self.offloaders.values()}
        if len(pools) > 1:
            raise RuntimeError(f"the offloaders {sorted(off.owner for off in self.offloaders.values())} use "
                               f"{len(pools)} host buffer pools; a manager's offloaders share its one pool "
                               f"(internal error: build_offloaders must use the pool it is given)")
        return next(iter(pools.values()), None)
