"""The GPU's one-pass figures (:mod:`hybridmem.reshard.fused_triton`) against the figures' definition, written
here from :func:`hybridmem.reshard.checksum.tensor_checksum`'s docstring (every element weighed by
``(1 + (row mod rp) / rp) * (1 + (col mod cp) / cp)`` in float64): on a GPU where there is one, and without
one in Triton's interpreter, which runs the same kernel on CPU tensors (where Triton is installed: it is not
in the CPU install, whose megatron-core would take Triton paths it cannot run there)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from hybridmem.reshard import fused_triton
from hybridmem.reshard.checksum import copy_checksum, tensor_checksum

_CASES = [  # (elements, the first one's index, columns): whole rows, ranges starting and ending mid-row, one
    (1000, 0, 1000),  # row, ranges shorter than a row, rows narrower than a tile, rows wider than a tile
    (5000, 37, 300),
    (3, 5, 7),
    (70000, 123, 4096),
    (300, 0, 1),
    (9000, 4095, 4096),
]


def _reference(x: torch.Tensor, lo: int, cols: int, rp: int, cp: int) -> tuple[float, float]:
    g = torch.arange(lo, lo + x.numel(), dtype=torch.int64)
    row, col = g // cols, g % cols
    w = (1 + (row % rp).double() / rp) * (1 + (col % cp).double() / cp)
    xd = x.detach().cpu().double()
    return xd.sum().item(), (xd * w).sum().item()


def _close(got, want) -> bool:
    return all(abs(a - b) <= 1e-9 * max(1.0, abs(b)) for a, b in zip(got, want, strict=True))


_INTERPRETED = r"""
import json, torch
from hybridmem.reshard.fused_triton import triton_figures, _FAILED
torch.manual_seed(0)
out = []
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
    for n, lo, cols in CASES:
        x = torch.randn(n).to(dtype)
        dst = torch.zeros_like(x)
        copied = triton_figures(x, dst, lo, cols, 61, 53)
        read = triton_figures(x, None, lo, cols, 61, 53)
        out.append({"dtype": str(dtype), "n": n, "lo": lo, "cols": cols, "copied": copied, "read": read,
                    "equal": bool(torch.equal(dst, x)), "x": x.double().tolist()})
print(json.dumps({"cases": out, "failed": _FAILED}))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="Triton is not installed (its interpreter runs the GPU kernel on CPU tensors)")
def test_the_kernel_in_tritons_interpreter_gives_the_definitions_figures_and_copies():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = _INTERPRETED.replace("CASES", repr(_CASES))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["failed"] == []
    for case in got["cases"]:
        x = torch.tensor(case["x"], dtype=torch.float64)
        want = _reference(x, case["lo"], case["cols"], 61, 53)
        what = f"{case['dtype']} n={case['n']} lo={case['lo']} cols={case['cols']}"
        assert case["copied"] is not None and _close(case["copied"], want), (what, case["copied"], want)
        assert case["read"] is not None and _close(case["read"], want), (what, case["read"], want)
        assert case["equal"], f"{what}: the copy differs from its source"


def test_a_kernel_that_fails_hands_the_range_to_torch_and_is_not_tried_again(monkeypatch, caplog):
    class Broken:
        calls = 0

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                Broken.calls += 1
                raise RuntimeError("no kernel image is available for execution on the device")
            return launch

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets the kernel be tried on CPU tensors
    monkeypatch.setattr(fused_triton, "_kernel", lambda: Broken())
    monkeypatch.setattr(fused_triton, "_FAILED", [])
    x = torch.randn(100)
    with caplog.at_level(logging.WARNING, logger="hybridmem.reshard.fused_triton"):
        assert fused_triton.triton_figures(x, None, 0, 10, 61, 53) is None
    assert "no kernel image" in caplog.text
    assert fused_triton.triton_figures(x, torch.empty(100), 0, 10, 61, 53) is None
    assert Broken.calls == 1, "a kernel that failed was tried again"


def test_a_kernel_built_wrong_is_caught_on_its_first_use_and_torch_reads_instead(monkeypatch, caplog):
    """A kernel that runs but sums wrong (as a miscompiled one would): its first use in the process compares
    it with the definition, so it is dropped there, and no weight sync ever compares its figures."""
    launches = []

    class Wrong:
        def __getitem__(self, grid):
            def launch(source, target, partial, rows, ncols, *args, write, **kwargs):
                launches.append(grid)
                partial.zero_()  # every tile's sums 0
                if write:
                    target[:rows * ncols].copy_(source[:rows * ncols])
            return launch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused_triton, "_kernel", lambda: Wrong())
    monkeypatch.setattr(fused_triton, "_FAILED", [])
    monkeypatch.setattr(fused_triton, "_CHECKED", set())
    x, dst = torch.randn(5000) + 1.0, torch.zeros(5000)
    with caplog.at_level(logging.WARNING, logger="hybridmem.reshard.fused_triton"):
        assert fused_triton.triton_figures(x, dst, 37, 300, 61, 53) is None
    assert "disagrees with the figures' definition" in caplog.text
    tried = len(launches)
    assert fused_triton.triton_figures(x, None, 0, 300, 61, 53) is None
    assert len(launches) == tried, "a kernel found wrong was run again"
    assert _close(copy_checksum(dst, x, 37, (5000 // 300 + 1, 300)), _reference(x, 37, 300, 61, 53))


def test_a_device_out_of_memory_is_raised_and_the_kernel_stays_in_use(monkeypatch):
    def full(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 MiB")

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused_triton, "_kernel", lambda: object())
    monkeypatch.setattr(fused_triton, "_FAILED", [])
    monkeypatch.setattr(fused_triton, "_CHECKED", {torch.float32})
    monkeypatch.setattr(fused_triton, "_launch", full)
    with pytest.raises(torch.OutOfMemoryError):
        fused_triton.triton_figures(torch.randn(100), None, 0, 10, 61, 53)
    assert fused_triton._FAILED == [], "an out-of-memory device turned the kernel off for the process"


def test_tensors_the_kernel_does_not_take_are_left_to_torch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fused_triton, "_kernel", lambda: pytest.fail("the kernel was asked"))
    x = torch.randn(4, 8)
    assert fused_triton.triton_figures(x.t().reshape(-1)[::2], None, 0, 8, 61, 53) is None  # not contiguous
    assert fused_triton.triton_figures(x, None, 0, 8, 61, 53) is None  # 2-D
    assert fused_triton.triton_figures(x.reshape(-1).to(torch.int32), None, 0, 8, 61, 53) is None
    other = torch.empty(32, dtype=torch.float64)
    assert fused_triton.triton_figures(x.reshape(-1), other, 0, 8, 61, 53) is None  # another dtype
    monkeypatch.delenv("TRITON_INTERPRET")
    assert fused_triton.triton_figures(x.reshape(-1), None, 0, 8, 61, 53) is None  # a CPU tensor, compiled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_on_a_gpu_the_checksum_and_the_copy_take_the_definitions_figures_in_one_pass(dtype):
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed with this CUDA PyTorch")
    torch.manual_seed(0)
    x = torch.randn(3000, 4096, device="cuda").to(dtype)
    want = _reference(x.reshape(-1), 0, 4096, 61, 53)
    assert _close(tensor_checksum(x), want)
    flat = x.reshape(-1)
    part, lo = flat[4095:4095 + 9000], 4095
    dst = torch.zeros_like(part)
    assert fused_triton.triton_figures(part, dst, lo, 4096, 61, 53) is not None, fused_triton._FAILED
    got = copy_checksum(dst, part, lo, (3000, 4096))
    assert torch.equal(dst, part)
    assert _close(got, _reference(part, lo, 4096, 61, 53))
    assert fused_triton._FAILED == []
