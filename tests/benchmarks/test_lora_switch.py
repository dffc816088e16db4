"""``benchmarks/lora_switch.py`` parses its options and refuses bad ones before it starts vLLM.

The benchmark itself starts a vLLM (about a minute here), so CI runs only its option handling; its figures
are in docs/benchmarks.md.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lora_switch.py"


@pytest.fixture(scope="module")
def lora_switch():
    spec = importlib.util.spec_from_file_location("lora_switch_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_names_both_routes(lora_switch, capsys):
    with pytest.raises(SystemExit) as exc:
        lora_switch.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for option in ("--hidden", "--layers", "--rank", "--steps", "--json"):
        assert option in out
    assert "LoraSync" in out and "merged_lora_weights" in out


@pytest.mark.parametrize(("argv", "named"), [(["--steps", "1"], "--steps 1"),
                                             (["--hidden", "100"], "--hidden 100"),
                                             (["--rank", "0"], "--rank 0")])
def test_bad_options_are_refused_before_vllm_starts(lora_switch, capsys, argv, named):
    before = set(sys.modules)
    with pytest.raises(SystemExit) as exc:
        lora_switch.main(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
    assert "vllm" not in set(sys.modules) - before
