"""What is still on the device, and who owns it.

After entering INFER the device should hold the engine's weights and KV cache and little else. The
residency report counts device bytes by owner (training params, grads, optimizer state, engine weights,
KV cache, and any extra part registered with the manager) and compares their sum with what the
allocator says is allocated and reserved. Bytes allocated that no part owns (activations kept alive by
a reference, a leaked tensor, a framework's workspace) and bytes the caching allocator keeps without a
tensor are shown as their own lines, so leftovers are visible instead of silent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from hybridmem.switch.memplan import format_nbytes
from hybridmem.switch.phase import Phase

__all__ = ["ResidencyReport"]


@dataclass(frozen=True, slots=True)
class ResidencyReport:
    """Device bytes by owner at one moment."""

    phase: Phase
    """The phase the report was taken in."""
    by_owner: dict[str, int]
    """Device bytes each known owner holds (``"train param"``, ``"train grad"``, ``"optimizer"``,
    ``"engine weights"``, ``"kv cache"``, ...)."""
    allocated_nbytes: int
    """What the allocator reports as allocated (on CPU: the sum of owners)."""
    reserved_nbytes: int
    """What the allocator holds, allocated or cached."""
    expected_empty: tuple[str, ...] = field(default=())
    """Owners that should hold nothing in this phase (e.g. offloaded training state in INFER)."""
    device_used_nbytes: int | None = None
    """Bytes in use on the whole device (``total - free`` from ``mem_get_info``), or ``None`` where the
    accelerator cannot read the device (CPU)."""

    @property
    def owned_nbytes(self) -> int:
        """Sum over owners."""
        return sum(self.by_owner.values())

    @property
    def unowned_nbytes(self) -> int:
        """Allocated bytes no known part owns."""
        return max(0, self.allocated_nbytes - self.owned_nbytes)

    @property
    def cached_nbytes(self) -> int:
        """Bytes the caching allocator holds without a tensor (``reserved - allocated``)."""
        return max(0, self.reserved_nbytes - self.allocated_nbytes)

    @property
    def unexplained_nbytes(self) -> int | None:
        """Device bytes in use that neither an owner nor this process's caching allocator accounts for
        (``device_used - reserved``): the CUDA context, communicator buffers, other allocators, other
        processes. ``None`` where the device cannot be read."""
        if self.device_used_nbytes is None:
            return None
        return self.device_used_nbytes - self.reserved_nbytes

    @property
    def leftovers(self) -> dict[str, int]:
        """Owners in :attr:`expected_empty` that still hold bytes."""
        return {o: n for o, n in self.by_owner.items() if o in self.expected_empty and n > 0}

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {
            "phase": self.phase.name,
            "by_owner": dict(self.by_owner),
            "owned_nbytes": self.owned_nbytes,
            "allocated_nbytes": self.allocated_nbytes,
            "unowned_nbytes": self.unowned_nbytes,
            "reserved_nbytes": self.reserved_nbytes,
            "cached_nbytes": self.cached_nbytes,
            "leftovers": self.leftovers,
            "device_used_nbytes": self.device_used_nbytes,
            "unexplained_nbytes": self.unexplained_nbytes,
        }

    def to_json(self) -> str:
        """The report as JSON."""
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        lines = [f"device residency in {self.phase.name}:"]
        for owner, nbytes in self.by_owner.items():
            flag = "  <-- should be offloaded" if owner in self.leftovers else ""
            lines.append(f"  {owner:<24}{format_nbytes(nbytes):>14}{flag}")
        lines.append(f"  {'(allocated, no owner)':<24}{format_nbytes(self.unowned_nbytes):>14}")
        lines.append(f"  {'(cached by allocator)':<24}{format_nbytes(self.cached_nbytes):>14}")
        lines.append(f"  {'total reserved':<24}{format_nbytes(self.reserved_nbytes):>14}")
        if self.unexplained_nbytes is not None:
            lines.append(f"  {'(device, outside it)':<24}{format_nbytes(self.unexplained_nbytes):>14}"
                         f"  of {format_nbytes(self.device_used_nbytes)} used on the device")
        return "\n".join(lines)
