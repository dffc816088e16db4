"""Predict a switch's peak device and host memory before running it, and refuse one that cannot fit.

A switch is a sequence of steps; each step declares (through :class:`StepEstimate`) how many device
bytes it frees, how many it leaves allocated, and how many it needs only while it runs. Walking the
steps in order from the current allocation gives the memory curve of the switch; its maximum is the
predicted peak. A switch whose peak exceeds the budget is refused before its first step, with the whole
plan in the error, instead of running out of memory halfway.

[Note: host memory plan]
The host side of a switch is the buffer pool's arenas (:mod:`hybridmem.offload.host_pool`): an offload grows
its owner's arenas to what it copies (:meth:`~hybridmem.offload.Offloader.arena_growth_nbytes`, given
the arenas the pool holds or is prewarming now), nothing else a switch does takes pool memory, and an
arena never shrinks, so the host curve only rises: each step's ``host_alloc_nbytes`` is added to the
pool's bytes at the start (held and being prewarmed). A grown arena replaces the old one, which is
dropped first, so a step's host peak is what the pool holds after it. The curve is checked against
``host_memory_budget_bytes`` (the pool's budget) as the device curve is against the device budget, so
a switch whose offloads would not fit the host budget is refused before its first step (a
:class:`~hybridmem.errors.HostMemoryPlanError`) instead of failing at the offload that overflows and
undoing the ones before it. Counted as every live storage copied: with ``skip_zero_grads`` an all-zero
gradient needs no arena, so the figure is an upper bound then. Memory outside the pool (an engine's
own host copies, e.g. vLLM's level-1 sleep) is not in the budget and not in this curve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from hybridmem.switch.phase import Direction

__all__ = ["StepEstimate", "PlannedStep", "MemoryPlan", "plan_switch", "format_nbytes"]


def format_nbytes(nbytes: int | float | None) -> str:
    """``1536`` -> ``"1.50 KiB"``; ``None`` -> ``"-"``."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """A step's effect on device memory, declared before it runs."""

    alloc_nbytes: int = 0
    """Device bytes the step allocates and leaves allocated."""
    free_nbytes: int = 0
    """Device bytes the step frees."""
    transient_nbytes: int = 0
    """Device bytes the step needs only while it runs (e.g. transfer buckets)."""
    host_alloc_nbytes: int = 0
    """Host bytes the step adds to the buffer pool (arenas it grows; see [Note: host memory plan])."""

    def __post_init__(self) -> None:
        for name in ("alloc_nbytes", "free_nbytes", "transient_nbytes", "host_alloc_nbytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"StepEstimate.{name}={getattr(self, name)} must be >= 0")


@dataclass(frozen=True, slots=True)
class PlannedStep:
    """One step in a :class:`MemoryPlan`."""

    name: str
    estimate: StepEstimate
    peak_nbytes: int
    """Predicted allocation while the step runs."""
    after_nbytes: int
    """Predicted allocation once it has run."""
    host_nbytes: int = 0
    """Predicted host bytes of the buffer pool once it has run, also its host peak while it runs
    (see [Note: host memory plan])."""


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The predicted memory curve of one switch."""

    direction: Direction
    start_nbytes: int
    """Device bytes allocated before the switch."""
    steps: tuple[PlannedStep, ...]
    budget_nbytes: int
    """The most the switch may reach."""
    budget_source: str
    """Where the budget came from (``device_memory_budget_bytes``, ``device free + cached``, ...)."""
    host_start_nbytes: int = 0
    """Host bytes the buffer pool holds (or is prewarming) before the switch."""
    host_budget_nbytes: int | None = None
    """The most the pool may hold (``host_memory_budget_bytes``); ``None``: no bound."""

    @property
    def peak_nbytes(self) -> int:
        """Predicted peak allocation over the whole switch."""
        return max([self.start_nbytes, *(s.peak_nbytes for s in self.steps)])

    @property
    def end_nbytes(self) -> int:
        """Predicted allocation after the switch."""
        return self.steps[-1].after_nbytes if self.steps else self.start_nbytes

    @property
    def device_fits(self) -> bool:
        """Whether the predicted device peak stays within the device budget."""
        return self.peak_nbytes <= self.budget_nbytes

    @property
    def host_peak_nbytes(self) -> int:
        """Predicted host bytes of the buffer pool at the end of the switch, its host peak (arenas only
        grow)."""
        return max([self.host_start_nbytes, *(s.host_nbytes for s in self.steps)])

    @property
    def host_fits(self) -> bool:
        """Whether the predicted host peak stays within the host budget (always, without one)."""
        return self.host_budget_nbytes is None or self.host_peak_nbytes <= self.host_budget_nbytes

    @property
    def fits(self) -> bool:
        """Whether the predicted device and host peaks stay within their budgets."""
        return self.device_fits and self.host_fits

    @property
    def peak_step(self) -> str | None:
        """The step at which the peak is reached (``None`` if the switch only frees)."""
        peak = self.peak_nbytes
        return next((s.name for s in self.steps if s.peak_nbytes == peak), None)

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {
            "direction": self.direction.value,
            "start_nbytes": self.start_nbytes,
            "peak_nbytes": self.peak_nbytes,
            "end_nbytes": self.end_nbytes,
            "budget_nbytes": self.budget_nbytes,
            "budget_source": self.budget_source,
            "host_start_nbytes": self.host_start_nbytes,
            "host_peak_nbytes": self.host_peak_nbytes,
            "host_budget_nbytes": self.host_budget_nbytes,
            "device_fits": self.device_fits,
            "host_fits": self.host_fits,
            "fits": self.fits,
            "steps": [
                {"name": s.name, **asdict(s.estimate), "peak_nbytes": s.peak_nbytes,
                 "after_nbytes": s.after_nbytes, "host_nbytes": s.host_nbytes}
                for s in self.steps
            ],
        }

    def __str__(self) -> str:
        host = self.host_budget_nbytes is not None or self.host_peak_nbytes > self.host_start_nbytes
        lines = [
            f"memory plan {self.direction.value}: start {format_nbytes(self.start_nbytes)}, "
            f"predicted peak {format_nbytes(self.peak_nbytes)} at {self.peak_step or 'start'}, "
            f"budget {format_nbytes(self.budget_nbytes)} ({self.budget_source})"
            + ("" if self.device_fits else "  <-- DOES NOT FIT"),
        ]
        if host:
            budget = ("no budget" if self.host_budget_nbytes is None
                      else f"budget {format_nbytes(self.host_budget_nbytes)} (host_memory_budget_bytes)")
            lines.append(f"host arenas: start {format_nbytes(self.host_start_nbytes)}, predicted peak "
                         f"{format_nbytes(self.host_peak_nbytes)}, {budget}"
                         + ("" if self.host_fits else "  <-- DOES NOT FIT"))
        lines.append(f"  {'step':<28}{'+alloc':>14}{'-free':>14}{'+transient':>14}{'peak':>14}{'after':>14}"
                     + (f"{'+host':>14}{'host':>14}" if host else ""))
        for s in self.steps:
            e = s.estimate
            over = s.peak_nbytes > self.budget_nbytes or (
                self.host_budget_nbytes is not None and s.host_nbytes > self.host_budget_nbytes)
            lines.append(
                f"  {s.name:<28}{format_nbytes(e.alloc_nbytes):>14}{format_nbytes(e.free_nbytes):>14}"
                f"{format_nbytes(e.transient_nbytes):>14}{format_nbytes(s.peak_nbytes):>14}"
                f"{format_nbytes(s.after_nbytes):>14}"
                + (f"{format_nbytes(e.host_alloc_nbytes):>14}{format_nbytes(s.host_nbytes):>14}"
                   if host else "")
                + ("  <-- over budget" if over else "")
            )
        return "\n".join(lines)


def plan_switch(
    direction: Direction,
    start_nbytes: int,
    steps: Sequence[tuple[str, StepEstimate]],
    *,
    budget_nbytes: int,
    budget_source: str,
    host_start_nbytes: int = 0,
    host_budget_nbytes: int | None = None,
) -> MemoryPlan:
    """Walk ``steps`` in order from ``start_nbytes`` (device) and ``host_start_nbytes`` (the buffer
    pool) and return the predicted curves.

    A step's peak is ``current + alloc + transient`` (it allocates before it frees: an onload
    allocates its storages, a resume its pool, a sync its buckets, and the frees of an offload only
    follow its copies); after it, ``current + alloc - free``. On the host, each step adds its
    ``host_alloc_nbytes`` (see [Note: host memory plan]).
    """
    current, host = start_nbytes, host_start_nbytes
    planned = []
    for name, est in steps:
        peak = current + est.alloc_nbytes + est.transient_nbytes
        current = max(0, current + est.alloc_nbytes - est.free_nbytes)
        host += est.host_alloc_nbytes
        planned.append(PlannedStep(name=name, estimate=est, peak_nbytes=peak, after_nbytes=current,
                                   host_nbytes=host))
    return MemoryPlan(
        direction=direction,
        start_nbytes=start_nbytes,
        steps=tuple(planned),
        budget_nbytes=budget_nbytes,
        budget_source=budget_source,
        host_start_nbytes=host_start_nbytes,
        host_budget_nbytes=host_budget_nbytes,
    )
