"""benchmarks/soak.py on CPU: 2,000 switch cycles in a fresh process, memory measured by the kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_2000_cpu_cycles_grow_rss_by_less_than_16_mib(tmp_path):
    out = tmp_path / "soak.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--cycles", "2000", "--sample-every", "250",
         "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["cycles"] == 2000 and len(r["samples"]) == 9 and r["samples"][-1]["cycle"] == 2000
    growth = r["rss_end_nbytes"] - r["rss_start_nbytes"]  # VmRSS of /proc/self/status in that process
    assert growth < 16 << 20, f"RSS grew by {growth / 2**20:.1f} MiB over 2,000 cycles:\n{proc.stdout}"
    assert r["host_pool_end_nbytes"] == r["host_pool_start_nbytes"] > 0
    assert "slope" in proc.stdout and "RSS" in proc.stdout and "host pool" in proc.stdout
