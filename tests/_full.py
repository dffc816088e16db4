"""``HYBRIDMEM_TESTS_FULL=1``: the cases CI leaves out because a neighbouring test already proves what they
prove on the same path (docs/testing.md lists them). The fault harnesses' exhaustive runs are
``HYBRIDMEM_FAULTS_FULL=1`` (tests/_faults.py), hours rather than minutes."""

from __future__ import annotations

import os

import pytest

__all__ = ["TESTS_FULL", "full_only"]

TESTS_FULL = os.environ.get("HYBRIDMEM_TESTS_FULL") == "1"


def full_only(why: str) -> pytest.MarkDecorator:
    """Skip unless ``HYBRIDMEM_TESTS_FULL=1``; ``why`` names the neighbour that covers the case in CI."""
    return pytest.mark.skipif(not TESTS_FULL, reason=f"{why}; HYBRIDMEM_TESTS_FULL=1 runs it")
