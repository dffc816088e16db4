"""The TRL integration's import-time check ([Note: TRL hooks] in :mod:`hybridmem.integrations.trl_compat`),
its reading of ``trl.GRPOTrainer``'s arguments, and TRL's vLLM-range warning, against the installed TRL.
Other TRL releases are stood in for by copies of the installed modules with one hook taken out."""

from __future__ import annotations

import functools
import inspect
import os
import pathlib
import subprocess
import sys
import types
from contextlib import contextmanager

import pytest
import torch

trl = pytest.importorskip("trl", reason="needs Hugging Face TRL (README install: the trl extra)")

from hybridmem.errors import UnsupportedLibraryError  # noqa: E402
from hybridmem.integrations.trl_compat import (  # noqa: E402
    TESTED_TRL,
    TRL_HOOKS,
    TRL_HOOKS_READ_FROM,
    TRL_MODULES,
    check_trl,
    import_trl,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATION = "trl.generation.vllm_generation"
TRAINER = "trl.trainer.grpo_trainer"


@pytest.fixture(scope="module")
def modules() -> dict[str, types.ModuleType]:
    return import_trl()


def _without(modules: dict, module: str, cls: str, **changes) -> dict:
    """``modules`` with ``module.cls`` replaced by a copy whose attributes in ``changes`` are replaced, or
    removed where the change is ``None``."""
    real = getattr(modules[module], cls)
    namespace = {k: v for k, v in vars(real).items() if k not in ("__dict__", "__weakref__")}
    namespace.update({k: v for k, v in changes.items() if v is not None})
    for name in (k for k, v in changes.items() if v is None):
        namespace.pop(name)
    fake = type(cls, real.__bases__, namespace)
    return {**modules, module: types.SimpleNamespace(**{**vars(modules[module]), cls: fake})}


def _init_without_peft_config(init):
    @functools.wraps(init)
    def wrapped(*args, **kwargs):
        return init(*args, **kwargs)

    signature = inspect.signature(init)
    wrapped.__signature__ = signature.replace(
        parameters=[p for p in signature.parameters.values() if p.name != "peft_config"])
    return wrapped


def _generate_without_sleep_flag(self, prompts, images, num_generations, profiler=None):
    return self.enable_sleep_mode


def test_the_installed_trl_has_every_hook_and_is_in_the_tested_range(modules):
    check_trl(trl.__version__, modules)
    # Every hook lives in a module the check imports (one elsewhere would never be checked).
    assert all(any(h.where == m or h.where.startswith(m + ".") for m in TRL_MODULES[1:]) for h in TRL_HOOKS)


@pytest.mark.parametrize("release, expected", [
    ("sync_weights", "trl.generation.vllm_generation.VLLMGeneration.sync_weights"),
    ("peft_config", "parameter 'peft_config' of trl.trainer.grpo_trainer.GRPOTrainer.__init__"),
    ("_llm_weights_sleeping",
     "'_llm_weights_sleeping' set or read in trl.generation.vllm_generation.VLLMGeneration.generate"),
])
def test_a_missing_hook_is_refused_naming_it_and_where_trl_should_have_it(modules, release, expected):
    trainer = modules[TRAINER].GRPOTrainer
    changed = {
        "sync_weights": lambda: _without(modules, GENERATION, "VLLMGeneration", sync_weights=None),
        "peft_config": lambda: _without(modules, TRAINER, "GRPOTrainer",
                                        __init__=_init_without_peft_config(trainer.__init__)),
        "_llm_weights_sleeping": lambda: _without(modules, GENERATION, "VLLMGeneration",
                                                  generate=_generate_without_sleep_flag),
    }[release]()
    with pytest.raises(UnsupportedLibraryError) as caught:
        check_trl("1.16.0", changed)
    error = caught.value
    assert isinstance(error, ImportError)
    assert len(error.missing) == 1 and error.missing[0].startswith(expected), error.missing
    assert "trl 1.16.0 lacks 1 hook(s)" in str(error) and expected in str(error)
    assert f"hooks read from trl {TRL_HOOKS_READ_FROM}" in str(error)


@pytest.mark.parametrize("version", ["1.17.0", "1.15.2", "2.0.0", "1.17.0rc1", "unknown"])
def test_a_trl_outside_the_tested_range_is_refused_naming_its_version_and_the_range(modules, version):
    with pytest.raises(UnsupportedLibraryError) as caught:
        check_trl(version, modules)
    message = str(caught.value)
    assert f"trl {version} is outside the tested range trl{TESTED_TRL}" in message, message
    assert f'pip install "trl=={TRL_HOOKS_READ_FROM}"' in message
    assert caught.value.installed == version and caught.value.missing == ()


@pytest.mark.parametrize("version", ["1.16.0", "1.16.3", "1.16.1+local", "1.16.0.dev0"])
def test_patch_releases_of_the_series_the_hooks_were_read_from_are_accepted(version):
    check_trl(version, {})


class _Built(Exception):  # noqa: N818 - a signal that stops the constructor, not an error
    """Raised by the stand-in for ``trl.GRPOTrainer.__init__``: what came before it is under test."""


def test_the_trainer_reads_model_args_and_peft_config_by_position_or_keyword(monkeypatch, tmp_path):
    from trl import GRPOConfig

    from hybridmem.integrations import trl as integration

    seen: dict = {}

    def trl_init(self, *args, **kwargs):
        seen["bound"] = integration._TRL_INIT.bind(*args, **kwargs).arguments
        raise _Built

    @contextmanager
    def building_llm(dtype, lora_rank):
        seen["llm"] = (dtype, lora_rank)
        yield

    monkeypatch.setattr(integration.GRPOTrainer, "__init__", trl_init)
    monkeypatch.setattr(integration, "_building_llm", building_llm)
    monkeypatch.setattr(integration, "_vllm_has_sleep_mode", lambda: True)
    model = torch.nn.Linear(2, 2, dtype=torch.float64)
    peft_config = types.SimpleNamespace(r=8, rank_pattern={"proj": 24})
    config = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="colocate", use_cpu=True,
                        report_to="none")
    by_position = (model, None, config, None, None, None, None, None, (None, None), None, peft_config)
    calls = [(by_position, {}),
             ((), {"model": model, "args": config, "peft_config": peft_config}),
             ((model, None), {"peft_config": peft_config, "args": config})]
    for args, kwargs in calls:
        seen.clear()
        with pytest.raises(_Built):
            integration.HybridGRPOTrainer(*args, **kwargs)
        assert seen["llm"] == (torch.float64, 24)  # the model's dtype, the adapter's largest rank
        bound = seen["bound"]
        assert bound["model"] is model and bound["peft_config"] is peft_config
        assert bound["args"] is not config and bound["args"].vllm_enable_sleep_mode is True
    assert config.vllm_enable_sleep_mode is False  # the caller's config is left as it was

    off = GRPOConfig(output_dir=str(tmp_path), use_vllm=False, use_cpu=True, report_to="none")
    with pytest.raises(ValueError, match="use_vllm=False"):
        integration.HybridGRPOTrainer(model, None, off)
    with pytest.raises(TypeError, match="trl.GRPOTrainer's arguments.*peft_confg"):
        integration.HybridGRPOTrainer(model=model, args=config, peft_confg=peft_config)


def test_trls_vllm_range_warning_prints_once_and_other_warnings_still_print():
    from hybridmem.reshard.vllm_versions import installed_vllm_version

    vllm = installed_vllm_version()
    release = tuple(int(x) for x in vllm.split("+")[0].split(".")[:2]) if vllm else None
    expected = 1 if release is not None and not (0, 22) <= release <= (0, 31) else 0
    code = "import warnings, hybridmem.integrations.trl; warnings.warn('another warning')"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env.update(PYTHONPATH=str(ROOT), VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("TRL currently supports vLLM versions") == expected, proc.stderr[-4000:]
    assert "UserWarning: another warning" in proc.stderr
