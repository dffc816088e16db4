"""One manager per model: which live manager holds a parameter, an optimizer or an engine.

[Note: one manager per model]
A manager frees its model's storages on TRAIN->INFER and keeps the only copy of their bytes in its own
host arenas. A second manager on the same parameters would read those freed storages on its own switch
(a segmentation fault in the resharding copy), offload them a second time, or restore stale bytes over
the first's. So every manager claims, at construction, the objects it moves or drives: each parameter of
the training model (found through its modules, so a wrapper and the module it wraps count as one), each
optimizer, the training state object and the engine. A claim held by another live manager refuses the
construction, naming the first manager, its phase and how to let go (:meth:`ShardingManager.close`).

A claim is let go by ``close()`` or when its manager is garbage: the registry holds managers weakly. A
manager in TRAIN sits in no reference cycle of its own (its guard reads the phase through a weak
reference), so a manager the user dropped is freed at once, by reference counting. The cycle collector
cannot be relied on for it: on CPython 3.11 ``gc.collect()`` does nothing while another thread's
collection runs finalizers (the eval loop hands the GIL over mid-collection; a data loader's, a logger's
or an engine's output thread is enough). A manager left outside TRAIN is held by its misuse guard
(``TrainingGuard(owner=...)``), which the model's hooks hold while armed, so it is never garbage while it
holds the only copy of the model's bytes. Parts that do make cycles (an adapter the manager attached
itself to) are waited for: before refusing, the registry collects, yielding between tries, for up to
:data:`_COLLECT_PATIENCE_S` seconds.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterable
from typing import Any

__all__ = ["Claims"]

_COLLECT_PATIENCE_S = 1.0
"""How long a construction that finds a claim keeps collecting garbage before it refuses."""

_HOLDERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
"""id(claimed object) -> (weak ref to the object, weak ref to the manager holding it)."""


def _live(entry: tuple[weakref.ref, weakref.ref] | None, obj: Any) -> Any:
    """The manager of ``entry`` if the entry is about ``obj`` and both are alive, else ``None``."""
    if entry is None:
        return None
    obj_ref, manager_ref = entry
    if obj_ref() is not obj:  # the id was reused by a new object
        return None
    return manager_ref()


class Claims:
    """The objects one manager claimed; :meth:`release` lets them go.

    Args:
        manager: The manager claiming (held weakly).
        named: ``(what, object)`` pairs to claim; ``what`` names the object in an error
            (``"parameter 'lm_head.weight'"``, ``"optimizer AdamW"``, ``"engine ReferenceEngine"``).

    Raises:
        ValueError: Another live manager holds one of the objects (see [Note: one manager per model]);
            nothing is claimed.
    """

    def __init__(self, manager: Any, named: Iterable[tuple[str, Any]]):
        named = [(what, obj) for what, obj in named if obj is not None]
        conflict = self._conflict(named, manager)
        deadline, pause = time.monotonic() + _COLLECT_PATIENCE_S, 0.001
        while conflict is not None and time.monotonic() < deadline:
            del conflict  # [Note: one manager per model]: a dropped manager may wait for the cycle collector
            gc.collect()
            conflict = self._conflict(named, manager)
            if conflict is not None:
                time.sleep(pause)  # another thread may be collecting: let it finish
                pause = min(pause * 2, 0.1)
        if conflict is not None:
            what, holder = conflict
            where = getattr(holder, "created_at", None)
            raise ValueError(
                f"{what} is already managed by {holder!r}{f' (built at {where})' if where else ''}: "
                f"one manager per model. Use that manager, or let "
                f"it go first: bring it to TRAIN (to_train(), or recover() from FAILED) and call its close()"
            )
        manager_ref = weakref.ref(manager)
        self._ids: list[int] = []
        for _, obj in named:
            try:
                obj_ref = weakref.ref(obj)
            except TypeError:  # an object that takes no weak references cannot be told from a reused id
                continue
            _HOLDERS[id(obj)] = (obj_ref, manager_ref)
            self._ids.append(id(obj))
        self._manager_ref = manager_ref
        weakref.finalize(manager, _drop, list(self._ids), manager_ref)

    @staticmethod
    def _conflict(named: list[tuple[str, Any]], manager: Any) -> tuple[str, Any] | None:
        for what, obj in named:
            holder = _live(_HOLDERS.get(id(obj)), obj)
            if holder is not None and holder is not manager:
                return what, holder
        return None

    def release(self) -> None:
        """Let every claimed object go (no-op the second time)."""
        _drop(self._ids, self._manager_ref)
        self._ids = []


def _drop(ids: list[int], manager_ref: weakref.ref) -> None:
    for key in ids:
        entry = _HOLDERS.get(key)
        if entry is not None and entry[1] is manager_ref:
            del _HOLDERS[key]
