"""Co-resident models: a second set of weights (the reference policy) sharing the actor's devices.

In full co-location (MindSpeed-RL's ``use_integrated_worker``) the actor's training state, its inference
engine and the reference policy time-share the same devices. The reference is needed only to score
rollouts, so it lives in host arenas and is onloaded just for that:

>>> ref = manager.add_coresident("reference", ref_model)     # doctest: +SKIP
>>> with manager.onloaded("reference") as model:              # doctest: +SKIP
...     ref_logprobs = model.token_logprobs(sequences)

[Note: co-resident phases]
A co-resident set moves only inside :meth:`ShardingManager.onloaded`, which the manager allows in TRAIN
or INFER and never during a switch; a switch refuses to start while a set is onloaded. So the
manager's memory plans, which assume co-resident sets are on the host, stay true, and the residency
report flags a set's bytes as a leftover whenever it is not onloaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

import torch

from hybridmem.accel import Accelerator
from hybridmem.offload import ParamOffloader
from hybridmem.offload.base import TransferStats
from hybridmem.offload.host_pool import HostBufferPool

__all__ = ["CoResidentState", "CoResident"]


class CoResidentState(Enum):
    """Where a co-resident set's weights are."""

    OFFLOADED = "offloaded"
    """Storages are 0 bytes; the weights are in host arenas."""
    ONLOADED = "onloaded"
    """The weights are on the device, inside :meth:`ShardingManager.onloaded`."""


class CoResident:
    """One co-resident model: its weights, offloaded through a :class:`ParamOffloader`.

    Args:
        name: Owner name in reports and host arenas (e.g. ``"reference"``).
        modules: The model or its chunks (frozen: gradients and optimizer state are not handled).
        accel, pool: The manager's accelerator and host pool.
    """

    def __init__(self, name: str, modules: torch.nn.Module | Iterable[torch.nn.Module], accel: Accelerator,
                 pool: HostBufferPool):
        self.name = name
        self.modules = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
        if not self.modules or not all(isinstance(m, torch.nn.Module) for m in self.modules):
            raise TypeError(f"co-resident {name!r} must be a torch.nn.Module or a list of them, "
                            f"got {type(modules).__name__}")
        for m in self.modules:
            m.requires_grad_(False)
        self.offloader = ParamOffloader(self.modules, accel, pool, owner=name)
        self.state = CoResidentState.ONLOADED
        self.last_transfers: dict[str, TransferStats] = {}
        """The latest ``"offload"`` and ``"onload"`` figures."""

    @property
    def module(self) -> torch.nn.Module:
        """The model (its first chunk when there are several)."""
        return self.modules[0]

    def live_nbytes(self) -> int:
        """Device bytes the weights take when onloaded."""
        return self.offloader.live_nbytes()

    def resident_nbytes(self) -> int:
        """Device bytes held now."""
        return self.offloader.resident_nbytes()

    def offload(self) -> TransferStats:
        """Move the weights to host arenas (no-op when already offloaded)."""
        if self.state is CoResidentState.OFFLOADED:
            return TransferStats(kind=self.offloader.kind, owner=self.name, direction="offload")
        stats = self.offloader.offload()
        self.state = CoResidentState.OFFLOADED
        self.last_transfers["offload"] = stats
        return stats

    def onload(self) -> TransferStats:
        """Bring the weights back (no-op when onloaded); all-or-nothing as every onload is."""
        if self.state is CoResidentState.ONLOADED:
            return TransferStats(kind=self.offloader.kind, owner=self.name, direction="onload")
        stats = self.offloader.onload()
        self.state = CoResidentState.ONLOADED
        self.last_transfers["onload"] = stats
        return stats

    def __repr__(self) -> str:
        return f"CoResident({self.name!r}, state={self.state.name}, live={self.live_nbytes()} B)"
