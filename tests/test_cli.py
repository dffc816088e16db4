"""The ``hybridmem`` command: every mistake is one line naming the option and what is allowed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from hybridmem.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _fail(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{out.err}"
    assert out.out == ""
    return lines[0]


def test_version_matches_the_package_metadata(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"hybridmem {expected}"


@pytest.mark.parametrize("command, prog", [("demo", "hybridmem demo"),
                                           ("switch-loop", "hybridmem switch-loop")])
def test_help_names_the_command_and_has_no_markup(capsys, command, prog):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: {prog} ")
    for markup in ("``", ":class:", ":func:", ":mod:", ":meth:"):
        assert markup not in text, f"raw reST {markup!r} in --help"


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["demo", "--train-tp", "3"], ["--train-tp 3", "--world-size 2", "[1, 2]"]),
        (["demo", "--infer-tp", "4"], ["--infer-tp 4", "--world-size 2", "[1, 2]"]),
        (["demo", "--world-size", "4", "--train-tp", "3"], ["--train-tp 3", "[1, 2, 4]"]),
        (["demo", "--world-size", "3", "--train-tp", "3", "--trainer", "megatron"],
         ["--train-tp 3", "[1]", "vocabulary of 16"]),
        (["demo", "--iters", "0"], ["--iters 0", ">= 1"]),
        (["demo", "--group-size", "1"], ["--group-size 1", ">= 2"]),
        (["demo", "--lr", "0"], ["--lr 0.0", "> 0"]),
        (["demo", "--trainer", "jax"], ["--trainer", "'jax'", "'torch'"]),
        (["demo", "--device", "tpu"], ["--device", "'tpu'", "'cpu'"]),
        (["demo", "--iters", "many"], ["--iters", "'many'"]),
        (["switch-loop", "--device", "tpu"], ["--device tpu", "auto, cpu, cuda, npu"]),
        (["switch-loop", "--iters", "-1"], ["--iters -1", ">= 1"]),
        (["launch"], ["'launch'", "'demo'", "'switch-loop'"]),
    ],
)
def test_each_mistake_is_one_line_naming_the_option_and_what_is_allowed(capsys, argv, needles):
    line = _fail(capsys, *argv)
    assert line.startswith("hybridmem")
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_demo_on_cuda_without_a_gpu_is_refused_before_spawning(capsys):
    line = _fail(capsys, "demo", "--device", "cuda")
    assert "--device cuda" in line and "CUDA devices visible 0" in line and "--device cpu" in line


def test_demo_megatron_trainer_without_megatron_core_says_how_to_get_it(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "megatron" else real(name, *a))
    line = _fail(capsys, "demo", "--trainer", "megatron")
    assert "--trainer megatron" in line and "hybridmem[megatron]" in line and "--trainer torch" in line


@pytest.mark.slow
def test_demo_without_matplotlib_writes_the_json_and_says_how_to_get_plots(tmp_path):
    # A matplotlib that cannot be imported, first on the path of this process and the spawned workers.
    blocker = tmp_path / "blocker" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker.parent), str(ROOT)])}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "hybridmem", "demo", "--iters", "1", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "matplotlib is not installed" in proc.stderr and "hybridmem[bench]" in proc.stderr
    assert len(json.loads((out / "grpo.json").read_text())["iterations"]) == 1
    assert not list(out.glob("*.png"))


def test_demo_vllm_engine_takes_infer_tp_1_or_the_world_size(capsys):
    from hybridmem.examples import grpo

    with pytest.raises(SystemExit) as info:
        grpo.main(["--engine", "vllm", "--world-size", "4", "--train-tp", "1", "--infer-tp", "2"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hybridmem demo: error: --infer-tp 2 is not allowed with --engine vllm: expected 1 "
                   "(a replica per process) or 4 (--world-size, one engine over all processes) "
                   "(see 'hybridmem demo --help')"], err
