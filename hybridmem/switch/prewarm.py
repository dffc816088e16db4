"""When the host arenas are prewarmed: when the manager is built, and after the optimizer's first steps.

The pool does the work (see [Note: prewarmed arenas] in :mod:`hybridmem.offload.host_pool`); this module
decides when, from what the offloaders would copy now. Grads and optimizer state usually appear only with the
first training step (AdamW creates ``exp_avg``/``exp_avg_sq`` there), so a torch optimizer gets a step
post-hook that asks again after each step, and removes itself once a step's arenas are all in place.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from hybridmem.contract.kinds import StateKind
from hybridmem.offload import Offloader
from hybridmem.offload.host_pool import HostBufferPool
from hybridmem.switch.steps import ToInferOrder

__all__ = ["ArenaPrewarmer"]


class ArenaPrewarmer:
    """Schedules the pool's background allocation of what the enabled offloaders would copy.

    Args:
        pool: The host buffer pool.
        offloaders: The training state's offloaders by kind.
        enabled: Which kinds the config offloads.
        optimizers: The training optimizers; each ``torch.optim.Optimizer`` gets a step post-hook.
    """

    def __init__(self, pool: HostBufferPool, offloaders: Mapping[StateKind, Offloader],
                 enabled: Mapping[StateKind, bool], optimizers: Iterable[Any]):
        self.pool = pool
        # In the order TRAIN->INFER offloads them, so a host budget admits the arenas the switch would.
        self.offloaders = [off for kind, off in sorted(offloaders.items(),
                                                       key=lambda kv: ToInferOrder[kv[0].name])
                           if enabled.get(kind)]
        self.scheduled_nbytes = 0
        """Bytes handed to the pool's background thread so far."""
        self._handles = []
        ref = weakref.ref(self)  # the optimizer must not keep the manager alive

        def after_step(*_: Any) -> None:
            me = ref()
            if me is not None and me.schedule() == 0:
                me._remove_hooks()

        self._handles = [o.register_step_post_hook(after_step) for o in optimizers
                         if isinstance(o, torch.optim.Optimizer)]
        self.schedule()

    def schedule(self) -> int:
        """Prewarm what is missing now; returns the bytes scheduled (0: every arena is in place)."""
        needs = [(off.owner, dtype, numel) for off in self.offloaders
                 for dtype, numel in off.arena_needs().items()]
        nbytes = self.pool.prewarm(needs)
        self.scheduled_nbytes += nbytes
        return nbytes

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def close(self) -> None:
        """Remove the hooks and wait for the arenas being prewarmed."""
        self._remove_hooks()
        self.pool.wait_prewarmed()
