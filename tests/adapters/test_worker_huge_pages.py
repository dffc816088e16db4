"""The worker side of the bucket stream asks for transparent huge pages for the fresh tensors it copies into
(see :mod:`hybridmem.accel.huge_pages`), where the caller did not turn them off: read from the kernel's own
``/proc/self/smaps`` in a fresh process, so no earlier allocation of the test run shares its pages."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hybridmem.accel.huge_pages import THP_MODE_PATH, THP_VAR, kernel_mode, wanted

# One update of one 64 MiB float32 tensor, fresh from the allocator, through the receive side's copy out of a
# bucket; then the kB of the tensor's bytes the kernel backs with huge pages, and whether the bytes arrived.
_PROBE = r"""
import json, torch
from hybridmem.adapters.vllm.server.receive import StreamUpdate
numel = 16 << 20
target = torch.empty(numel, dtype=torch.float32)
bucket = torch.arange(numel, dtype=torch.float32).view(torch.uint8)
update = StreamUpdate({"w": ((numel,), torch.float32)}, run="r", verify=False, who="probe",
                      tensors={"w": target})
update.copy(bucket, [{"name": "w", "dtype": "float32", "shape": [numel], "start": 0, "end": 4 * numel,
                      "offset": 0}])
lo, hi = target.data_ptr(), target.data_ptr() + 4 * numel
huge, overlap = 0, False
for line in open("/proc/self/smaps").read().splitlines():
    head = line.split()[0]
    if "-" in head and all(c in "0123456789abcdef-" for c in head):
        start, end = (int(x, 16) for x in head.split("-"))
        overlap = start < hi and lo < end
    elif overlap and line.startswith("AnonHugePages:"):
        huge += int(line.split()[1])
print(json.dumps({"huge_kib": huge, "equal": bool(torch.equal(target, bucket.view(torch.float32)))}))
"""


def _probe(**env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k != THP_VAR}
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**base, **env}, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_huge_pages_are_wanted_unless_pytorchs_switch_says_0():
    assert wanted({}) is sys.platform.startswith("linux")
    assert wanted({THP_VAR: "1"}) is sys.platform.startswith("linux")
    assert wanted({THP_VAR: "0"}) is False


@pytest.mark.skipif(kernel_mode() in (None, "never"),
                    reason=f"the kernel gives no transparent huge pages ({THP_MODE_PATH})")
def test_the_worker_copies_into_fresh_tensors_backed_by_huge_pages():
    got = _probe()
    assert got["equal"], "the bucket's bytes did not arrive"
    # the 2 MiB-aligned inside of 64 MiB is at least 62 MiB; the kernel may fall back to small pages for a few
    assert got["huge_kib"] >= 32 << 10, f"{got['huge_kib']} kB of the 64 MiB tensor in huge pages"
    if kernel_mode() == "madvise":  # only memory that was asked for gets them: the advice made the difference
        off = _probe(**{THP_VAR: "0"})
        assert off["equal"]
        assert off["huge_kib"] == 0, f"{off['huge_kib']} kB in huge pages with {THP_VAR}=0"
