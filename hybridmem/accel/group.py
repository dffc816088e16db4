"""Where this process stands in a process group: the one reading of rank and size."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["rank_and_size"]


def rank_and_size(group: Any = None) -> tuple[int, int]:
    """This process's rank in ``group`` (``None``: the default group) and the group's size; ``(0, 1)`` when
    torch.distributed is not initialised, i.e. a single process."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)
