"""``HYBRIDMEM_VLLM_BUSY_POLL_S``: set for vLLM's processes on its CPU platform, applied by the plugin to
vLLM's own ``SpinCondition`` (see [Note: vllm busy poll] in :mod:`hybridmem.adapters.vllm.busy_poll`).

The plugin's effect is checked in a fresh interpreter, as vLLM's processes load it: vLLM's
``SpinCondition`` built as a reader spins for the variable's seconds, and for vLLM's own 1 s when the
variable is unset; a writer never spins. The time a switch saves is a figure of
``benchmarks/engine_process.py`` (docs/benchmarks.md), not of a test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridmem.adapters.vllm.busy_poll import BUSY_POLL_VAR, busy_poll_s, default_busy_poll
from hybridmem.adapters.vllm.server.process import server_command

ROOT = Path(__file__).resolve().parents[2]

_PROGRAM = """
import json, zmq
from hybridmem.adapters.vllm.plugin import register
register()
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
ctx = zmq.Context()
reader = SpinCondition(True, ctx, "ipc:///tmp/hybridmem-busy-poll-test")
writer = SpinCondition(False, ctx, "ipc:///tmp/hybridmem-busy-poll-test-w")
print(json.dumps([reader.busy_loop_s, writer.busy_loop_s]))
"""


def _spin_in_a_vllm_process(value: str | None) -> list[float]:
    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items() if k != BUSY_POLL_VAR}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    if value is not None:
        env[BUSY_POLL_VAR] = value
    proc = subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_plugin_sets_vllms_reader_spin_and_leaves_it_unset_otherwise():
    assert _spin_in_a_vllm_process("0.01") == [0.01, 0]
    assert _spin_in_a_vllm_process(None) == [1, 0]  # vLLM's own: 1 s (shm_broadcast.SpinCondition)


def test_engines_on_vllms_cpu_platform_ask_for_no_spin_unless_the_caller_set_it():
    on_cpu: dict[str, str] = {}
    default_busy_poll(on_cpu, on_cpu=True)
    assert on_cpu == {BUSY_POLL_VAR: "0.01"}
    chosen = {BUSY_POLL_VAR: "0.25"}
    default_busy_poll(chosen, on_cpu=True)
    assert chosen == {BUSY_POLL_VAR: "0.25"}
    on_gpu: dict[str, str] = {}
    default_busy_poll(on_gpu, on_cpu=False)
    assert on_gpu == {}
    _, env = server_command("/nonexistent-model", tensor_parallel_size=1, port=8000, on_cpu=False,
                            env={BUSY_POLL_VAR: "0.5"})
    assert env[BUSY_POLL_VAR] == "0.5"


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan"])
def test_a_bad_value_is_refused_naming_the_variable(value):
    with pytest.raises(ValueError, match=rf"{BUSY_POLL_VAR}={value!r}: expected seconds above 0"):
        busy_poll_s({BUSY_POLL_VAR: value})
    with pytest.raises(ValueError, match=BUSY_POLL_VAR):
        default_busy_poll({BUSY_POLL_VAR: value}, on_cpu=True)
