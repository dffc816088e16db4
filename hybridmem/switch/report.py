"""Switch reports: per-step times, bytes moved by kind, memory before/after/peak, bandwidth.

Reports print as a table (``str(report)`` or :meth:`SwitchReport.to_table` for a ``rich`` table) and
serialise to JSON (:meth:`SwitchReport.to_json`).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field

from hybridmem.contract.kinds import StateKind
from hybridmem.switch.memplan import MemoryPlan, format_nbytes
from hybridmem.switch.phase import Direction
from hybridmem.switch.residency import ResidencyReport

__all__ = ["StepReport", "SwitchReport"]


@dataclass(frozen=True, slots=True)
class StepReport:
    """One step of a switch as it ran."""

    name: str
    kind: StateKind | None
    seconds: float
    copied_nbytes: int
    """Bytes copied (host<->device, or received, for a weight sync)."""
    zero_nbytes: int
    """Bytes released or re-created without a copy."""
    allocated_after_nbytes: int
    """Device bytes allocated once the step finished."""
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        """Copy bandwidth of the step in GB/s (1e9 B/s)."""
        return self.copied_nbytes / self.seconds / 1e9 if self.seconds > 0 and self.copied_nbytes else 0.0

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {
            "name": self.name,
            "kind": None if self.kind is None else self.kind.value,
            "seconds": self.seconds,
            "copied_nbytes": self.copied_nbytes,
            "zero_nbytes": self.zero_nbytes,
            "gbps": self.gbps,
            "allocated_after_nbytes": self.allocated_after_nbytes,
            **({"extra": self.extra} if self.extra else {}),
        }


@dataclass(frozen=True, slots=True)
class SwitchReport:
    """Everything one switch did."""

    direction: Direction
    steps: tuple[StepReport, ...]
    seconds: float
    """Wall time of the whole switch."""
    device_before_nbytes: int
    device_after_nbytes: int
    device_peak_nbytes: int
    peak_source: str
    """``"allocator"`` (the backend's peak counter) or ``"tracked"`` (max over steps of the tracked sum)."""
    host_nbytes: int
    """Host bytes the buffer pool holds after the switch."""
    device_backend: str
    plan: MemoryPlan | None = None
    """The memory plan checked before the switch."""
    residency: ResidencyReport | None = None
    """Device residency after the switch (TRAIN->INFER only)."""

    @property
    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes copied per kind (``param``, ``grad``, ``optimizer``, ``engine_weights``, ...)."""
        out: dict[str, int] = {}
        for s in self.steps:
            if s.kind is not None:
                out[s.kind.value] = out.get(s.kind.value, 0) + s.copied_nbytes
        return out

    @property
    def copied_nbytes(self) -> int:
        """Bytes copied by all host<->device steps (weight sync excluded)."""
        return sum(s.copied_nbytes for s in self.steps if s.kind is not StateKind.ENGINE_WEIGHTS)

    @property
    def copy_seconds(self) -> float:
        """Time spent in host<->device steps."""
        return sum(s.seconds for s in self.steps
                   if s.kind is not StateKind.ENGINE_WEIGHTS and s.copied_nbytes)

    @property
    def gbps(self) -> float:
        """Achieved host<->device bandwidth over the copy steps, in GB/s."""
        return self.copied_nbytes / self.copy_seconds / 1e9 if self.copy_seconds > 0 else 0.0

    @property
    def freed_nbytes(self) -> int:
        """Device bytes the switch gave back (negative if it took more than it gave)."""
        return self.device_before_nbytes - self.device_after_nbytes

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {
            "direction": self.direction.value,
            "seconds": self.seconds,
            "device_backend": self.device_backend,
            "device_before_nbytes": self.device_before_nbytes,
            "device_after_nbytes": self.device_after_nbytes,
            "device_peak_nbytes": self.device_peak_nbytes,
            "peak_source": self.peak_source,
            "host_nbytes": self.host_nbytes,
            "copied_nbytes": self.copied_nbytes,
            "gbps": self.gbps,
            "bytes_by_kind": self.bytes_by_kind,
            "steps": [s.to_dict() for s in self.steps],
            "plan": None if self.plan is None else self.plan.to_dict(),
            "residency": None if self.residency is None else self.residency.to_dict(),
        }

    def to_json(self, **kwargs) -> str:
        """The report as JSON (``kwargs`` go to ``json.dumps``)."""
        kwargs.setdefault("indent", 2)
        return json.dumps(self.to_dict(), **kwargs)

    def to_table(self, *, ascii_only: bool = False):
        """A ``rich.table.Table`` of the steps with a summary caption (ASCII borders if ``ascii_only``)."""
        from rich import box  # noqa: PLC0415 - keeps `import hybridmem` light
        from rich.table import Table  # noqa: PLC0415 - keeps `import hybridmem` light

        arrow = "TRAIN -> INFER" if self.direction is Direction.TO_INFER else "INFER -> TRAIN"
        table = Table(
            title=f"{arrow}: {self.seconds * 1e3:.1f} ms",
            title_justify="left",
            box=box.ASCII2 if ascii_only else box.HEAVY_HEAD,
        )
        for col, justify in (("step", "left"), ("kind", "left"), ("ms", "right"), ("copied", "right"),
                             ("no-copy", "right"), ("GB/s", "right"), ("device after", "right")):
            table.add_column(col, justify=justify)
        for s in self.steps:
            table.add_row(
                s.name,
                "" if s.kind is None else s.kind.value,
                f"{s.seconds * 1e3:.2f}",
                format_nbytes(s.copied_nbytes),
                format_nbytes(s.zero_nbytes),
                f"{s.gbps:.2f}" if s.gbps else "",
                format_nbytes(s.allocated_after_nbytes),
            )
        table.caption = (
            f"device {self.device_backend}: before {format_nbytes(self.device_before_nbytes)}, "
            f"after {format_nbytes(self.device_after_nbytes)}, peak {format_nbytes(self.device_peak_nbytes)} "
            f"({self.peak_source}); host arenas {format_nbytes(self.host_nbytes)}; "
            f"copied {format_nbytes(self.copied_nbytes)} at {self.gbps:.2f} GB/s"
        )
        notes = sorted({s.extra["note"] for s in self.steps if s.extra.get("note")})
        notes += sorted({f"engine log {s.extra['engine_log']}" for s in self.steps
                         if s.extra.get("engine_log")})  # an engine in its own process names its log
        if notes:
            table.caption += "; " + "; ".join(notes)
        table.caption_justify = "left"
        return table

    def __rich__(self):
        """What ``rich.console.Console.print(report)`` shows: the table, then the residency."""
        from rich.console import Group  # noqa: PLC0415 - keeps `import hybridmem` light
        from rich.text import Text  # noqa: PLC0415 - keeps `import hybridmem` light

        parts = [self.to_table()]
        if self.residency is not None:
            parts.append(Text(str(self.residency)))
        return Group(*parts)

    def __str__(self) -> str:
        from rich.console import Console  # noqa: PLC0415 - keeps `import hybridmem` light

        buf = io.StringIO()
        Console(file=buf, width=120, color_system=None, force_terminal=False).print(
            self.to_table(ascii_only=True))
        text = buf.getvalue().rstrip()
        if self.residency is not None:
            text += "\n" + str(self.residency)
        return text
