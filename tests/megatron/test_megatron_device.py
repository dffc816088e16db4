"""megatron_device(): docs/megatron.md's program on a torch without CUDA ends in one line naming the torch
build and the CPU harness, instead of megatron-core's ``Torch not compiled with CUDA enabled``."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridmem.adapters.megatron import MEGATRON_CPU_HARNESS, megatron_device

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[2]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@NO_CUDA
def test_the_docs_program_without_cuda_ends_in_one_line_naming_the_harness(tmp_path):
    pytest.importorskip("megatron.core")
    (program,) = re.findall(r"```python torchrun 2 megatron\n(.*?)```",
                            (ROOT / "docs" / "megatron.md").read_text(), re.DOTALL)
    (tmp_path / "train.py").write_text(program)
    # One rank as torchrun starts it (the check comes before anything needs a second rank).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port())}
    proc = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = re.sub(r"^\[rank0\]: ", "", proc.stderr.strip().splitlines()[-1])  # torch.distributed's prefix
    assert last.startswith("RuntimeError: megatron-core needs CUDA"), proc.stderr[-3000:]
    assert "torch.cuda.is_available() is False" in last and torch.__version__ in last
    assert MEGATRON_CPU_HARNESS in last
    assert "Torch not compiled with CUDA enabled" not in proc.stderr  # megatron-core's own call never ran


@NO_CUDA
def test_inside_the_cpu_harness_it_is_the_cpu_and_after_it_an_error_again():
    pytest.importorskip("megatron.core")
    from hybridmem.testing.megatron_cpu import megatron_on_cpu

    with megatron_on_cpu():
        assert megatron_device() == "cpu"
    with pytest.raises(RuntimeError, match="a CPU-only build|no CUDA device visible"):
        megatron_device()


def test_a_cuda_build_without_a_visible_device_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(RuntimeError) as info:
        megatron_device()
    msg = str(info.value)
    assert "\n" not in msg
    assert "built for CUDA 12.8, with no CUDA device visible (torch.cuda.is_available() is False)" in msg, msg
    assert MEGATRON_CPU_HARNESS in msg


def test_a_visible_cuda_device_is_used(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert megatron_device() == "cuda"
