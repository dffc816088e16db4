"""``THP_MEM_ALLOC_ENABLE=1`` in the environment of the ``vllm serve`` hybridmem starts on a CPU: the kernel
backs that process's large torch tensors with transparent huge pages (read from ``/proc/self/smaps``, the
kernel's own figures), and a caller's own value is kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hybridmem.accel.huge_pages import THP_MODE_PATH, kernel_mode
from hybridmem.adapters.vllm.server.process import THP_VAR, server_command, server_env

# A 64 MiB tensor, every page touched; the kB of its mapping the kernel backs with huge pages.
_PROBE = r"""
import json, torch
t = torch.empty(64 << 20, dtype=torch.uint8)
t.fill_(1)
ptr = t.data_ptr()
huge, inside = None, False
for line in open("/proc/self/smaps").read().splitlines():
    head = line.split()[0]
    if "-" in head and all(c in "0123456789abcdef-" for c in head):
        lo, hi = (int(x, 16) for x in head.split("-"))
        inside = lo <= ptr < hi
    elif inside and line.startswith("AnonHugePages:"):
        huge = int(line.split()[1])
        break
print(json.dumps(huge))
"""


def _huge_kib(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_the_server_on_a_cpu_asks_for_huge_pages_unless_the_caller_chose():
    base = {k: v for k, v in os.environ.items() if k != THP_VAR}
    assert server_env(tensor_parallel_size=1, base=base, on_cpu=True)[THP_VAR] == "1"
    assert THP_VAR not in server_env(tensor_parallel_size=1, base=base, on_cpu=False)
    assert server_env(tensor_parallel_size=1, base={**base, THP_VAR: "0"}, on_cpu=True)[THP_VAR] == "0"
    _, env = server_command("/nonexistent-model", tensor_parallel_size=1, port=8000, on_cpu=True,
                            env={THP_VAR: "0"})
    assert env[THP_VAR] == "0"


@pytest.mark.skipif(kernel_mode() in (None, "never"),
                    reason=f"the kernel gives no transparent huge pages ({THP_MODE_PATH})")
def test_a_process_with_the_servers_environment_gets_huge_pages_for_its_tensors():
    base = {k: v for k, v in os.environ.items() if k != THP_VAR}
    env = server_env(tensor_parallel_size=1, base=base, on_cpu=True)
    assert _huge_kib(env) >= 2048, "no huge page backs a 64 MiB tensor in the server's environment"
    if kernel_mode() == "madvise":  # only a process that asks gets them: the switch made the difference
        assert _huge_kib({**env, THP_VAR: "0"}) == 0
