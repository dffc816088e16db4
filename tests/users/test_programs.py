"""Users' programs, each run as its own process and judged by what its user sees: the exit status and the
last line. An abort at interpreter exit or a segmentation fault is a signal (a negative return code here),
which no in-process test can catch.

Each program lies in ``programs/``; it loads a tiny Qwen2 checkpoint saved with ``save_pretrained`` (given
as its first argument) the way users load theirs. The expected outcomes are written here, by hand.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = Path(__file__).resolve().parent / "programs"
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
       "TQDM_DISABLE": "1"}


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("policy") / "my-policy"
    subprocess.run([sys.executable, str(PROGRAMS / "_policy.py"), str(directory)], check=True, env=_env(),
                   capture_output=True, timeout=600)
    return str(directory)


def _env() -> dict[str, str]:
    return {**os.environ, **ENV, "PYTHONPATH": str(ROOT)}


def run(program: str, policy: str, cwd: Path, *args: str) -> tuple[int, str, str]:
    """``(return code, last line of stdout, last line of stderr)`` of ``programs/<program>.py``."""
    proc = subprocess.run([sys.executable, str(PROGRAMS / f"{program}.py"), policy, *args], cwd=cwd,
                          env=_env(), capture_output=True, text=True, timeout=600, check=False)

    def last(text: str) -> str:
        lines = [line for line in text.splitlines() if line.strip()]
        return lines[-1] if lines else ""

    return proc.returncode, last(proc.stdout), last(proc.stderr)


# (program, exit code, pattern of the last line of stdout (exit 0) or stderr (exit 1)), written from what a
# user must read: the value at fault and the fix.
CASES = [
    ("two_managers", 1, (r"^ValueError: model Qwen2ForCausalLM is already managed by "
                        r"ShardingManager\(phase=TRAIN, .*\(built at .*two_managers\.py:14\): "
                        r"one manager per model\..* call its close\(\)$")),
    ("close_then_new_manager", 0, (r"^cannot switch to INFER: the manager is in phase CLOSED; .*build a new "
                                  r"ShardingManager$")),
    ("rebuilds_a_dropped_manager", 0, r"^two managers, one after another$"),
    ("foreign_optimizer", 1, (r"^ValueError: optimizer AdamW holds 27 of its 27 parameters outside the model "
                             r"Qwen2ForCausalLM \(the first: shape \(256, 64\), torch\.float32\); "
                             r"pass the optimizer built on this model's parameters")),
    ("config_typo", 1, (r"^TypeError: HybridConfig got an unknown keyword 'offload_train_optimiser': "
                       r"did you mean 'offload_train_optimizer'")),
    ("empty_yaml", 1, (r"^hybridmem\.errors\.ConfigError: job\.yaml is empty "
                      r".*use HybridConfig\(\) for the defaults$")),
    ("misplaced_yaml_key", 1, (r"^hybridmem\.errors\.ConfigError: "
                              r"actor_config\.infer_tensor_parallel_size=4 in job\.yaml is not allowed: "
                              r"expected infer_tensor_parallel_size under generate_config")),
]


@pytest.mark.parametrize("program, code, last_line", CASES, ids=[c[0] for c in CASES])
def test_a_users_mistake_ends_in_one_line_and_no_signal(policy, tmp_path, program, code, last_line):
    rc, out, err = run(program, policy, tmp_path)
    assert rc == code, f"{program} exited {rc} (a negative code is a signal), expected {code}:\n{err}"
    line = out if code == 0 else err
    assert re.search(last_line, line), f"{program}'s last line: {line!r}"


# What a read of the offloaded training state inside ``inference()`` did before the guard: SIGSEGV (139)
# for the norm, the gradient and AdamW's moment; exit 0 for the checkpoint, whose bytes were freed memory.
# The same with FSDP2 (``fsdp``: DTensor parameters, gradients and moments) before the DTensors were
# guarded as well as their local shards. Under torch.distributed the error's lines carry torch's
# ``[rank0]: `` prefix.
READS = [("param_norm", "norm", "param"), ("checkpoint", "detach", "param"), ("grad", "abs", "grad"),
         ("optimizer", "sum", "optimizer"), ("print", "repr", "param")]
CASES_READ = [(*r, "") for r in READS] + [(*r, "fsdp") for r in READS if r[0] != "print"]


@pytest.mark.parametrize("read, op, kind, sharding", CASES_READ, ids=[f"{c[0]}{'-' + c[3] if c[3] else ''}"
                                                                        for c in CASES_READ])
def test_reading_the_offloaded_training_state_is_one_error_naming_it(policy, tmp_path, read, op, kind,
                                                                     sharding):
    rc, out, err = run("reads_offloaded_state", policy, tmp_path, read, *([sharding] if sharding else []))
    assert rc == 1, f"{read}: exit {rc} (a negative code is a signal):\n{err}"
    assert out == "shape (256, 64)", out
    prefix = r"\[rank0\]: " if sharding else ""
    assert re.search(rf"^{prefix}hybridmem\.errors\.OffloadedTensorError: cannot {op} a tensor of the "
                     rf"training state \({kind}, shape \[\d+(, \d+)*\], torch\.float32\): "
                     rf"hybridmem moved its bytes to host memory .*"
                     rf"manager\.to_train\(\) / manager\.recover\(\)$", err), err


def _busy() -> subprocess.Popen:
    """A process keeping one core busy."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


@pytest.mark.slow
def test_a_script_ending_with_a_switch_and_a_step_exits_zero_under_load(policy, tmp_path):
    """Before the prewarming thread was joined at exit, 3 of 5 runs of this program aborted after their last
    line (SIGABRT, "terminate called without an active exception") on an idle 2-core machine."""
    load = [_busy() for _ in range(os.cpu_count() or 2)]
    try:
        for attempt in range(3):
            rc, out, err = run("ends_with_a_step", policy, tmp_path)
            assert (rc, out) == (0, "last line"), (
                f"run {attempt + 1}: exit {rc}, last lines {out!r} / {err!r}")
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
