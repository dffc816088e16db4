"""Predict a switch's peak device memory before running it, and refuse one that cannot fit.

A switch is a sequence of steps; each step declares (through :class:`StepEstimate`) how many device
bytes it frees, how many it leaves allocated, and how many it needs only while it runs. Walking the
steps in order from the current allocation gives the memory curve of the switch; its maximum is the
predicted peak. A switch whose peak exceeds the budget is refused before its first step, with the whole
plan in the error, instead of running out of memory halfway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from hybridmem.phase import Direction

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

    def __post_init__(self) -> None:
        for name in ("alloc_nbytes", "free_nbytes", "transient_nbytes"):
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

    @property
    def peak_nbytes(self) -> int:
        """Predicted peak allocation over the whole switch."""
        return max([self.start_nbytes, *(s.peak_nbytes for s in self.steps)])

    @property
    def end_nbytes(self) -> int:
        """Predicted allocation after the switch."""
        return self.steps[-1].after_nbytes if self.steps else self.start_nbytes

    @property
    def fits(self) -> bool:
        """Whether the predicted peak stays within the budget."""
        return self.peak_nbytes <= self.budget_nbytes

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
            "fits": self.fits,
            "steps": [
                {"name": s.name, **asdict(s.estimate), "peak_nbytes": s.peak_nbytes, "after_nbytes": s.after_nbytes}
                for s in self.steps
            ],
        }

    def __str__(self) -> str:
        lines = [
            f"memory plan {self.direction.value}: start {format_nbytes(self.start_nbytes)}, "
            f"predicted peak {format_nbytes(self.peak_nbytes)} at {self.peak_step or 'start'}, "
            f"budget {format_nbytes(self.budget_nbytes)} ({self.budget_source})"
            + ("" if self.fits else "  <-- DOES NOT FIT"),
            f"  {'step':<28}{'+alloc':>14}{'-free':>14}{'+transient':>14}{'peak':>14}{'after':>14}",
        ]
        for s in self.steps:
            e = s.estimate
            over = "  <-- over budget" if s.peak_nbytes > self.budget_nbytes else ""
            lines.append(
                f"  {s.name:<28}{format_nbytes(e.alloc_nbytes):>14}{format_nbytes(e.free_nbytes):>14}"
                f"{format_nbytes(e.transient_nbytes):>14}{format_nbytes(s.peak_nbytes):>14}"
                f"{format_nbytes(s.after_nbytes):>14}{over}"
            )
        return "\n".join(lines)


def plan_switch(
    direction: Direction,
    start_nbytes: int,
    steps: Sequence[tuple[str, StepEstimate]],
    *,
    budget_nbytes: int,
    budget_source: str,
) -> MemoryPlan:
    """Walk ``steps`` in order from ``start_nbytes`` and return the predicted curve.

    A step's peak is ``current + alloc + transient`` (it allocates before it frees: an onload
    allocates its storages, a resume its pool, a sync its buckets, and the frees of an offload only
    follow its copies); after it, ``current + alloc - free``.
    """
    current = start_nbytes
    planned = []
    for name, est in steps:
        peak = current + est.alloc_nbytes + est.transient_nbytes
        current = max(0, current + est.alloc_nbytes - est.free_nbytes)
        planned.append(PlannedStep(name=name, estimate=est, peak_nbytes=peak, after_nbytes=current))
    return MemoryPlan(
        direction=direction,
        start_nbytes=start_nbytes,
        steps=tuple(planned),
        budget_nbytes=budget_nbytes,
        budget_source=budget_source,
    )
