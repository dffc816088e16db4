"""Fault injection at every call a switch makes into torch, the host pool, the accelerator and the engine.

:class:`FaultInjector` patches a list of seams (class attributes) with wrappers that count calls. A dry
run of a switch records the sequence of calls (the injection points); an injected run raises a given
exception at the k-th call, once. Running the switch once per point with each exception kind covers
every point at which a switch can be interrupted by a synchronous error.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hybridmem.accel import cpu as cpu_accel
from hybridmem.offload.host_pool import HostBufferPool

__all__ = ["FaultInjector", "Injected", "sample_points", "FULL"]

FULL = os.environ.get("HYBRIDMEM_FAULTS_FULL") == "1"
"""Inject at every enumerated point (else at the deterministic CI sample of :func:`sample_points`)."""

# (owner, attribute, label): every call a switch makes that can fail or be interrupted.
TORCH_SEAMS: list[tuple[Any, str, str]] = [
    (torch.UntypedStorage, "resize_", "storage resize"),
    (torch.Tensor, "copy_", "copy"),
    (torch.Tensor, "zero_", "zero"),
    (torch.Tensor, "any", "zero check"),
    (torch.Tensor, "tolist", "device sync"),
    (torch.Tensor, "set_", "storage view"),
    (torch.Tensor, "narrow", "arena slice"),
    (cpu_accel._NullEvent, "record", "event record"),
    (cpu_accel._NullEvent, "synchronize", "event wait"),
    (cpu_accel._NullStream, "wait_event", "stream wait"),
    (HostBufferPool, "arena", "host arena"),
    (cpu_accel.CpuAccelerator, "alloc_host", "host alloc"),
    (cpu_accel.CpuAccelerator, "empty_cache", "empty cache"),
]


def engine_seams(engine: Any) -> list[tuple[Any, str, str]]:
    """The engine calls of a switch: resume, release, load_weights."""
    cls = type(engine)
    return [(cls, name, f"engine {name}") for name in ("resume", "release", "load_weights")]


class Injected(Exception):  # noqa: N818 - imported by the fault-injection tests under this name
    """The synchronous exception injected (a stand-in for any error a torch call can raise)."""


class FaultInjector:
    """Counts calls through ``seams`` and raises at one of them.

    Args:
        seams: ``(owner, attribute, label)`` triples to patch while :meth:`active`.
    """

    def __init__(self, seams: list[tuple[Any, str, str]]):
        self.seams = seams
        self.count = 0
        self.labels: list[str] = []
        self.targets: frozenset[int] = frozenset()
        self.exc_factory: Callable[[], BaseException] | None = None
        self.fired: str | None = None
        """The label of the first call a fault was raised at."""
        self.fired_at: list[int] = []
        """Every call a fault was raised at."""

    def _tick(self, label: str) -> None:
        self.count += 1
        self.labels.append(label)
        if self.count in self.targets:
            self.fired = label if self.fired is None else self.fired
            self.fired_at.append(self.count)
            assert self.exc_factory is not None
            raise self.exc_factory()

    def _wrap(self, original: Callable[..., Any], label: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._tick(label)
            return original(*args, **kwargs)

        return wrapper

    @contextlib.contextmanager
    def active(self, *, target: int | tuple[int, ...] | None = None,
               exc: Callable[[], BaseException] | None = None) -> Iterator[FaultInjector]:
        """Patch the seams; with ``target``, raise ``exc()`` at that call (1-based), or at each of several."""
        self.count, self.labels, self.fired, self.fired_at = 0, [], None, []
        self.targets = frozenset((target,) if isinstance(target, int) else target or ())
        self.exc_factory = exc
        saved = []
        for owner, attr, label in self.seams:
            own = attr in owner.__dict__
            original = getattr(owner, attr)
            saved.append((owner, attr, own, owner.__dict__.get(attr)))
            setattr(owner, attr, self._wrap(original, label))
        try:
            yield self
        finally:
            for owner, attr, own, previous in reversed(saved):
                if own:
                    setattr(owner, attr, previous)
                else:
                    delattr(owner, attr)
            self.targets = frozenset()

    def count_calls(self, fn: Callable[[], Any]) -> list[str]:
        """Run ``fn`` with counting only; returns the label of every call, in order."""
        with self.active():
            fn()
        return list(self.labels)


def sample_points(labels: list[str], *, num_strided: int = 16) -> list[int]:
    """A deterministic subset of the 1-based points of a dry run: the first and last call of every kind
    (every label), plus ``num_strided`` points evenly spaced over the run. All points when :data:`FULL`."""
    if FULL:
        return list(range(1, len(labels) + 1))
    stride = max(1, len(labels) // num_strided)
    points = set(range(1, len(labels) + 1, stride))
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, label in enumerate(labels, start=1):
        first.setdefault(label, i)
        last[label] = i
    return sorted(points | set(first.values()) | set(last.values()))


def inject(injector: FaultInjector, point: int, exc: Callable[[], BaseException],
           switch: Callable[[], Any]) -> tuple[str | None, BaseException | None]:
    """Run ``switch`` with a fault ``exc()`` at call ``point``: ``(label of the call it fired at, or None
    when the switch made fewer calls; what the switch raised, or None when it swallowed the fault)``."""
    raised: BaseException | None = None
    with injector.active(target=point, exc=exc) as inj:
        try:
            switch()
        except (Exception, KeyboardInterrupt) as e:  # every kind is checked by the caller
            raised = e
    return inj.fired, raised


def leftovers(manager: Any, engine: Any) -> str | None:
    """What a switch that was undone left behind, or None: offloaders not on the device, host arenas
    still held, engine memory still resident."""
    from hybridmem.offload import OffloadState

    if set(manager.offload_states().values()) != {OffloadState.ON_DEVICE}:
        return f"offloaders {manager.offload_states()}"
    held = [o for o in manager.offloaders.values() if manager.pool.is_held(o.owner)]
    if held:
        return f"host arenas still held by {held}"
    if engine.resident_nbytes("weights") or engine.resident_nbytes("kv_cache"):
        return "the engine still holds device memory"
    return None
