"""The server adapter's weight transfer (``VLLMServerEngine``'s buckets and channel into hybridmem's
worker-side backend, ``HybridmemWeightTransferEngine``) against the model classes of every vLLM release
hybridmem supports (``SUPPORTED_VLLM_VERSIONS``: the range ``pyproject.toml`` allows).

Each case runs ``tests/adapters/_vllm_transfer_program.py`` as a program of its own under a Python whose
vLLM is that release: the one running this test where it has that release, else one named in
``HYBRIDMEM_VLLM_PYTHONS`` (interpreters of other environments, separated by ``os.pathsep``); a release
with neither is skipped, naming the variable. The program builds a tiny model twice with that vLLM's own
classes on CPU (no engine): the reference loaded by vLLM's ``load_weights`` from a checkpoint, the other
from other values and then updated through the adapter with buckets smaller than its largest tensor. The
program exits non-zero unless the updated model's every parameter and buffer equals the reference's and its
linear layers compute what the reference's compute; here the test checks its exit status and what it
reports: the release, a damaged bucket refused by its figures, and the update's size.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridmem.reshard.vllm_versions import SUPPORTED_VLLM_VERSIONS, installed_vllm_version
from tests.reshard.families import COMMON, MODELS, distinct_values, take_checkpoint

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PYTHONS_VAR = "HYBRIDMEM_VLLM_PYTHONS"
"""Interpreters of other environments, each with another vLLM release (``os.pathsep``-separated)."""
CASES = ["qwen2-bias-kv2", "llama-tied"]
"""Qwen2 (q/k/v bias, fused q/k/v and gate/up layers, 2 kv heads, its own head), Llama (head tied to the
embedding)."""
_ASK = "from hybridmem.reshard.vllm_versions import installed_vllm_version as v; print(v())"


def _series(version: str) -> str:
    """``"0.32.0+cpu"`` -> ``"0.32"``."""
    return ".".join(version.split(".")[:2])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["VLLM_TARGET_DEVICE"] = "cpu"  # a CUDA wheel of vLLM builds its model classes on CPU when told
    return env


@functools.cache
def _release_of(python: str) -> str | None:
    """The vLLM release series ``python`` has (``None``: none, or it does not run)."""
    if python == sys.executable:
        version = installed_vllm_version()
    else:
        try:
            done = subprocess.run([python, "-c", _ASK], cwd=ROOT, env=_env(), capture_output=True, text=True,
                                  timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return None
        version = done.stdout.strip() if done.returncode == 0 else None
    return None if version in (None, "None") else _series(version)


def _python_for(release: str) -> str | None:
    others = [p for p in os.environ.get(PYTHONS_VAR, "").split(os.pathsep) if p]
    return next((p for p in [sys.executable, *others] if _release_of(p) == release), None)


def release_program(release: str, module: str, *args: str, out: Path, timeout_s: float,
                    installed_only_when_full: str | None = None) -> dict:
    """Run ``python -m module *args out`` under the Python that has vLLM ``release`` (skipped where none is
    here; the installed one skipped with ``installed_only_when_full`` as reason unless
    ``HYBRIDMEM_TESTS_FULL`` is set) and return the report it wrote to ``out``, checked to come from that
    release and from this checkout's hybridmem."""
    from tests._full import TESTS_FULL

    python = _python_for(release)
    if python is None:
        pytest.skip(f"no Python with vLLM {release} here: this one has {installed_vllm_version()}; name the "
                    f"interpreter of an environment with vLLM {release} in {PYTHONS_VAR}")
    if python == sys.executable and installed_only_when_full and not TESTS_FULL:
        pytest.skip(f"{installed_only_when_full}; HYBRIDMEM_TESTS_FULL=1 runs it")
    done = subprocess.run([python, "-m", module, *args, str(out)], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    report = json.loads(out.read_text())
    assert _series(report["vllm"]) == release, report["vllm"]
    assert report["hybridmem"] == str(ROOT / "hybridmem" / "__init__.py"), "the checkout's hybridmem ran"
    return report


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``{model id: dir}``: transformers' tiny checkpoint of each case, every value distinct (1..N)."""
    transformers = pytest.importorskip("transformers")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    out = {}
    for model_id in CASES:
        family, kw = MODELS[model_id]
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(family, **{**COMMON, **kw}))
        path = tmp_path_factory.mktemp(model_id)
        model.save_pretrained(path)
        safetensors_torch.save_file(distinct_values(take_checkpoint(path)), path / "model.safetensors")
        out[model_id] = str(path)
    return out


@pytest.mark.parametrize("model_id", CASES)
@pytest.mark.parametrize("release", SUPPORTED_VLLM_VERSIONS)
def test_worker_backend_writes_what_vllm_loads(checkpoints, tmp_path, release, model_id):
    report = release_program(release, "tests.adapters._vllm_transfer_program", checkpoints[model_id],
                             out=tmp_path / "report.json", timeout_s=900)
    # The damaged bucket: refused by the worker's figures of that tensor, the model partly written.
    assert ("staged tensor model.layers.1.mlp.down_proj.weight reads (sum, weighted)"
            in report["corrupted_error"]), report["corrupted_error"]
    assert report["damaged_after_refusal"] is True and report["damaged_after_update"] is False
    # The good update: the whole layout, split over more buckets than the two that are reused.
    assert report["largest_nbytes"] > report["bucket_nbytes"]
    assert report["streamed"] == report["layout_tensors"] and report["unwritten"] == []
    assert report["commit"]["engine_buckets_handed"] > 2
    assert report["commit"]["weight_version"] == report["worker_version"] == "hybridmem-1"
    assert report["linear_outputs"] == 2 * 4 and report["compared"] > report["layout_tensors"]
