"""``benchmarks/fp8_sync.py`` run as a user runs it, as its own program on two gloo ranks: it exits 0 and its
figures for the tiny Qwen3 are the bytes counted by hand (tests/planner/test_fp8_plan.py's model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8_sync.py"


def test_the_benchmark_prints_fp8_bytes_beside_bf16s(tmp_path):
    out = tmp_path / "fp8.jsonl"
    argv = ["--preset", "tiny", "--repeats", "1", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "engine fp8 == layout fp8 (the FP8 shard's bytes from its shapes) on every rank: True" \
        in proc.stdout
    ranks = json.loads(out.read_text())["ranks"]
    # Megatron TP 2 -> two TP 1 engines: per layer the missing half of every weight (393,216 elements, one
    # byte each, 24 blocks of four) and half the embedding and head rows in bf16; in bf16 throughout, two
    # bytes an element of all of it
    fp8 = 2 * (393_216 + 4 * 24) + 2 * (128 * 256) * 2
    bf16 = 2 * 393_216 * 2 + 2 * (128 * 256) * 2
    for rank in ranks:
        assert rank["fp8"]["received"] == rank["fp8"]["min"] == fp8 == 917_696
        assert rank["bf16"]["received"] == bf16
        # the FP8 shard of a TP 1 engine: tests/planner/test_fp8_plan.py's 1,838,976 bytes
        assert rank["fp8"]["engine"] == rank["fp8_layout_nbytes"] == 1_838_976
