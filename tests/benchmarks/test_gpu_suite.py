"""The GPU suite's CPU dry run (``benchmarks/gpu_suite.py --device cpu --quick``) runs every part.

On CPU the suite cannot check the GPU targets; what it must show is that each part's script still runs
and that the report is built from the figures the parts wrote, so the suite does not rot while no GPU is
around. CI leaves out the demo part: it runs the demo of each trainer for two iterations, as
tests/examples/test_grpo_demo.py does (``HYBRIDMEM_TESTS_FULL=1`` runs it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._full import TESTS_FULL

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "benchmarks" / "gpu_suite.py"
SECTIONS = ("## CUDA tests", "## DeepSeek sparse attention in vLLM", "## LoRA with vLLM", "## Switch latency",
            "## First three cycles", "## KV cache release / resume", "## Bucket transport",
            "## The weights' checksum", "## GRPO demo",
            "## Device in INFER", "## Targets", "## Jobs")
BUCKET_TENSORS = 17
"""``bucket_transport.py --quick`` on CPU: the embedding, two layers of seven tensors, the final norm, the
head."""
BUCKET_NBYTES = (2 * 4096 * 256 * 2  # embedding and head, bf16
                 + 256 * 2  # final norm, bf16
                 + (384 * 256 + 384 + 256 * 256 + 2048 * 256 + 256 * 1024 + 2 * 256) * (4 + 2))  # layers
"""Its bytes, by hand: hidden 256, K and V 64 wide each (qkv 384 rows), intermediate 1024, vocab 4096; layer 0
in fp32, layer 1 in bf16."""


def _suite(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SUITE), "--device", "cpu", "--out", str(tmp_path), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)


@pytest.mark.slow
def test_cpu_quick_dry_run_runs_every_part(tmp_path):
    parts = ["tests", "dsa", "lora", "switch", "tms", "kv", "buckets", "checksum"] + (
        ["demo"] if TESTS_FULL else [])
    proc = _suite(tmp_path, "--quick", "--parts", ",".join(parts))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_suite.json").read_text())
    runs = {r["label"]: r for r in data["runs"]}
    assert {r["part"] for r in runs.values()} == set(parts)
    assert all(r["status"] == "ok" for r in runs.values()), {k: r["status"] for k, r in runs.items()}

    tests = runs["cuda tests"]["result"]
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"], "without a GPU every CUDA test skips"

    for run in (r for r in runs.values() if r["part"] == "switch"):
        fig = run["result"]
        hidden = 512
        num_layers = fig["num_params"] // (hidden * hidden)
        # fp32 params, grads, exp_avg, exp_avg_sq: 16 bytes a weight; AdamW's step counters (4 bytes a
        # layer) sit on the CPU, which is the device here
        assert fig["total_nbytes"] == 16 * fig["num_params"] + 4 * num_layers
        assert len(fig["cycles"]) == 3 and fig["freed_share"] == 1.0
    for run in (r for r in runs.values() if r["part"] == "tms"):
        assert run["result"] == {"skipped": "needs a CUDA device"}
    assert runs["dsa vllm"]["result"] == {
        "skipped": "needs --device cuda (vLLM's CPU platform refuses sparse attention)"}
    assert runs["lora shared base"]["result"]["skipped"].startswith("needs --device cuda")
    for trainer in ("torch", "megatron", "fsdp") if TESTS_FULL else ():
        assert len(runs[f"demo --trainer {trainer}"]["result"]["iterations"]) == 2
    assert "demo --launcher ray" not in runs  # GPU only (tests/examples/test_grpo_ray.py runs it on CPU)
    kv = runs["kv 0.03 GiB"]["result"]
    assert [r["allocator"] for r in kv["results"]] == ["torch"]
    buckets = runs["bucket transport"]["result"]
    assert buckets["cuda_skipped"].startswith("needs --device cuda")
    assert buckets["transport"] == "CPU buckets (shared files)"
    assert (buckets["tensors"], buckets["total_nbytes"]) == (BUCKET_TENSORS, BUCKET_NBYTES)
    assert buckets["larger_than_bucket"] == [  # 2 MiB each, more than the 1 MiB bucket
        "model.embed_tokens.weight", "model.layers.0.mlp.gate_up_proj.weight", "lm_head.weight"]
    assert buckets["weights_equal"] is True and buckets["different"] == []
    # the stand-in ran the worker side's receive code without vLLM ([Note: vllm receive] in
    # :mod:`hybridmem.adapters.vllm.server.receive`)
    assert buckets["vllm_imported"] is False
    assert [r["verify"] for r in buckets["rounds"]] == [False] * 4 + [True] * 2  # cold and warm figures
    assert len(buckets["checksum_s"]) == 3 and all(s > 0 for s in buckets["checksum_s"])
    assert all(r["buckets_handed"] >= 10 for r in buckets["rounds"])  # ~9.9 MB through 1 MiB buckets
    checksum = runs["checksum"]["result"]
    # 10 MB as (rows, 4096): 610 rows of fp32 or 1220 of bf16, 9,994,240 bytes either way
    assert [(r["dtype"], r["nbytes"]) for r in checksum["rows"]] == [("float32", 9_994_240),
                                                                      ("bfloat16", 9_994_240)]
    assert all(r["checksum_s"] > 0 and r["copy_s"] > 0 for r in checksum["rows"])

    text = (tmp_path / "gpu_suite.md").read_text()
    assert "skipped: needs --device cuda" in text
    assert "CUDA IPC buckets skipped: needs --device cuda" in text
    assert "the worker's tensors after the last round: equal to the sources" in text
    for section in SECTIONS:
        if section != "## GRPO demo" or TESTS_FULL:
            assert section in text, f"report lacks {section!r}"
    assert text in proc.stdout


def test_cuda_without_a_cuda_device_is_refused_at_once_in_one_line(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the suite runs there")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SUITE), "--device", "cuda", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "--device cuda" in lines[-1] and "torch.cuda.is_available() is False" in lines[-1], lines[-1]
    assert "--device cpu --quick" in lines[-1]  # the run that works here
    assert not out.exists() and proc.stdout == ""  # refused before any part ran or any file was written


def test_unknown_part_is_refused_by_name(tmp_path):
    proc = _suite(tmp_path, "--quick", "--parts", "switch,nope")
    assert proc.returncode == 2 and "nope" in proc.stderr and "tests" in proc.stderr


def test_parts_left_without_time_fail_the_run(tmp_path):
    proc = _suite(tmp_path, "--quick", "--parts", "kv", "--budget-s", "1")
    assert proc.returncode == 1
    data = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert [r["status"] for r in data["runs"]] == ["not run"]
    assert "did not finish" in proc.stderr


def test_sparse_attention_check_without_a_gpu_skips_and_says_why(tmp_path):
    """The ``dsa`` part's script, where it cannot build vLLM's CUDA model: exit status 0, the reason printed
    and written, and nothing imported that needs a GPU."""
    torch = pytest.importorskip("torch")
    out = tmp_path / "dsa.json"
    script = ROOT / "benchmarks" / "vllm_sparse_attention.py"
    for device in ("cpu", "cuda"):
        if device == "cuda" and torch.cuda.is_available():
            continue  # this machine runs the check itself
        proc = subprocess.run([sys.executable, str(script), "--device", device, "--json", str(out)],
                              capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        why = json.loads(out.read_text())["skipped"]
        assert why in proc.stdout and (
            "--device cuda" in why if device == "cpu" else "CUDA device" in why), why


def test_bucket_transport_fails_when_the_worker_holds_other_weights(tmp_path):
    """``bucket_transport.py`` on CPU with one source value changed behind the figures' back before the last
    round: the stand-in worker's comparison with the regenerated sources finds it, the run fails (exit
    status 1) naming the tensor."""
    out = tmp_path / "buckets.json"
    script = ROOT / "benchmarks" / "bucket_transport.py"
    proc = subprocess.run([sys.executable, str(script), "--device", "cpu", "--quick", "--rounds", "1",
                           "--tamper", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    want = "FAILED: the worker's tensors differ from the sources: ['model.embed_tokens.weight']"
    assert want in proc.stderr
    result = json.loads(out.read_text())
    assert result["different"] == ["model.embed_tokens.weight"] and result["weights_equal"] is False
