"""Module-level tasks run in WorkerPool processes by test_workers.py (must be importable by spawn)."""

from __future__ import annotations

import os
import time


def pids(ctx) -> tuple[int, int]:
    """This worker's pid and its parent's."""
    return os.getpid(), os.getppid()


def sleep(ctx, seconds: float) -> None:
    time.sleep(seconds)
