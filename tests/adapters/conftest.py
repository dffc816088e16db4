"""Fixtures of the adapter tests."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


@pytest.fixture
def shm_directory():
    """A fresh directory in ``/dev/shm`` (RAM, where the engine's shared directory lives by default; the
    system's temporary directory where there is none), removed with what it holds after the test."""
    path = tempfile.mkdtemp(prefix="hybridmem-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield path
    shutil.rmtree(path, ignore_errors=True)
