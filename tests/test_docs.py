"""Every code block of README.md and docs/*.md runs, as printed, in a fresh interpreter per file.

A file's ``python`` blocks run in order in one namespace, as a reader running them in turn would;
``python torchrun N`` blocks run as programs under torchrun; shell blocks (``bash``, ``console``
transcripts checked against what each command prints, ``bash server`` left running for the blocks after
it and stopped with Ctrl-C at the end) run as a reader runs them in a terminal, from a directory that
holds the checkout's top-level folders (``benchmarks/configs/...`` resolves as it does from the root of a
clone); blocks a machine cannot run (a GPU, a second environment, the whole suite) are skipped only
through a ``<!-- skip: next ... -->`` with a reason (see ``_docs.py``). The test fails when a block
raises or exits non-zero, and when the number of blocks run or skipped differs from the number of fences
in the file (counted here with a regular expression, independently of Sybil's parser).

Three files carry the programs users write first, and their switches are also checked
(``_docs_check.py``): the training state after every INFER->TRAIN equals, byte for byte, the state before
the TRAIN->INFER, and every greedy generation inside INFER equals transformers' greedy generation on the
training weights of that switch:

- README.md: a ``from_pretrained`` Qwen2 and AdamW into the embedded engine, ``ShardingManager`` with
  defaults;
- docs/vllm.md: the same into real vLLM (``VLLMEngine.create(model_dir, dtype="float32",
  max_model_len=256, skip_tokenizer_init=True)``) in one plain process, with no environment variable set;
  and an agent loop into an ``AsyncLLM`` in its own process (``VLLMServerEngine.start_async``), as a
  program of its own;
- docs/megatron.md: megatron-core ``GPTModel`` at TP2 under torchrun (2 processes, megatron-core's CPU
  harness here) with ``HybridConfig()``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
FENCE = re.compile(r"^[ \t]*```(python|bash|console|yaml\s+title=)", re.MULTILINE)
CHECKED = {"README.md": 3, "vllm.md": 3, "megatron.md": 3}
"""Files whose switches are checked, with the number of switches their program makes (per process)."""
SLOW = {"vllm.md", "megatron.md", "fsdp.md", "trl.md", "ray.md"}
# The variables vLLM's CPU build would otherwise use to reach the network or a shared cache; none of them
# changes how hybridmem or vLLM run the program.
ISOLATION_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
                 "VLLM_HOST_IP": "127.0.0.1", "TRL_EXPERIMENTAL_SILENCE": "1"}
KNOBS = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "RANK",
         "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _params():
    for path in DOCS:
        marks = [pytest.mark.slow] if path.name in SLOW else []
        yield pytest.param(path, id=str(path.relative_to(ROOT)), marks=marks)


@pytest.mark.parametrize("path", list(_params()))
def test_every_code_block_runs(path, tmp_path):
    fences = len(FENCE.findall(path.read_text()))
    if fences == 0:
        pytest.skip(f"{path.name} has no code blocks")
    check_dir = tmp_path / "check"
    check_dir.mkdir()
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in KNOBS}
    env.update(ISOLATION_ENV, PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE)]),
               HYBRIDMEM_DOCS_CHECK=str(check_dir), XDG_CACHE_HOME=str(cache),
               VLLM_CACHE_ROOT=str(cache / "vllm"), HF_HOME=str(cache / "hf"))
    summary = tmp_path / "summary.json"
    work = tmp_path / "work"
    work.mkdir()
    for entry in ROOT.iterdir():  # the reader's checkout: its folders, seen from where the blocks run
        if not entry.name.startswith("."):
            (work / entry.name).symlink_to(entry)
    proc = subprocess.run([sys.executable, str(HERE / "_docs.py"), str(path), str(summary)], cwd=work,
                          env=env, capture_output=True, text=True, timeout=1500)
    result = json.loads(summary.read_text()) if summary.exists() else {}
    assert proc.returncode == 0, f"{result.get('failed')}\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
    assert len(result["ran"]) + len(result["skipped"]) == fences, result
    assert all(reason for _, reason in result["skipped"]), result["skipped"]
    if path.name in CHECKED:
        _check_switches(path.name, check_dir)


def _check_switches(name: str, check_dir: Path) -> None:
    reports = [json.loads(p.read_text()) for p in sorted(check_dir.glob("check-*.json"))]
    watched = [r for r in reports if r["switches"]]
    assert watched, f"{name}: no process made a switch ({len(reports)} reports)"
    for report in watched:
        assert len(report["switches"]) == CHECKED[name], report["switches"]
        assert all(report["switches"]), f"{name}: training state changed by a switch: {report['switches']}"
        assert len(report["greedy"]) == CHECKED[name], f"{name}: {len(report['greedy'])} greedy generations"
        for i, call in enumerate(report["greedy"]):
            assert call["got"] == call["expected"], (
                f"{name}: switch {i}: engine {call['got']} != transformers {call['expected']}")
        # Training changed the weights enough to change the greedy tokens: the engine followed them.
        assert report["greedy"][0]["expected"] != report["greedy"][-1]["expected"], name
