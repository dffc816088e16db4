"""``hybridmem plan --engine-process``: an engine in its own process holds its two transfer buckets on every
rank's device in both phases ([Note: vllm buckets] in :mod:`hybridmem.adapters.vllm.server.buckets`), so
every step of both switches holds exactly their bytes more than without, shown as the owner ``engine
buckets``; the default size is the engine's own rule, written out here by hand. An NPU accelerator and a
bucket below one page are refused by name.

See [Note: cluster plan] in :mod:`hybridmem.planner.cluster`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.planner.test_cluster_plan import QWEN25_7B

MIB, GIB = 2**20, 2**30
LAYOUT = ["--world", "8", "--train", "2/1/1", "--infer", "1/1/1"]


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridmem", "plan", *QWEN25_7B, *LAYOUT, *args],
                          capture_output=True, text=True, timeout=300)


def _json(*args: str) -> dict:
    out = _plan(*args, "--json", "-")
    assert out.returncode in (0, 1), out.stderr[-2000:]
    return json.loads(out.stdout)


def _training_state_nbytes() -> int:
    """Megatron TP2 of Qwen2.5-7B over 8 ranks: bf16 weights, fp32 main grads, 12 bytes of Adam state per
    parameter divided over the 4 data-parallel ranks (the figure of test_cluster_plan, by hand)."""
    h, f, v, kv, layers = 3584, 18944, 152064, 512, 28
    split = 2 * v * h + layers * (2 * h * h + h + 2 * (kv * h + kv) + 3 * h * f)
    per_rank = split // 2 + (2 * layers + 1) * h
    return per_rank * (2 + 4) + per_rank * 12 // 4


def _steps(rank: dict) -> list[tuple[str, int, int]]:
    return [(s["name"], s["peak_nbytes"], s["after_nbytes"]) for s in (*rank["to_infer"], *rank["to_train"])]


def _assert_more_by(base: dict, buckets: dict, extra: int) -> None:
    assert [p["rank"] for p in buckets["ranks"]] == [p["rank"] for p in base["ranks"]]
    for b, e in zip(base["ranks"], buckets["ranks"], strict=True):
        assert e["state_nbytes"]["engine buckets"] == extra
        assert "engine buckets" not in b["state_nbytes"]
        assert e["start_nbytes"] == b["start_nbytes"] + extra
        assert e["peak_nbytes"] == b["peak_nbytes"] + extra
        assert _steps(e) == [(name, peak + extra, after + extra) for name, peak, after in _steps(b)]
        assert len(_steps(e)) > 5


def test_two_buckets_of_the_given_size_are_held_in_every_step():
    _assert_more_by(_json(), _json("--engine-process", "--engine-bucket-mib", "256"), 2 * 256 * MIB)


def test_the_default_bucket_is_the_engines_rule():
    # H100 (80 GB) less ~34 GB of training state: a sixteenth is over 1 GiB, so 1 GiB per bucket.
    assert 80e9 - _training_state_nbytes() > 16 * GIB
    _assert_more_by(_json(), _json("--engine-process"), 2 * GIB)
    # 40 GB: a sixteenth of what the training state leaves free, in whole MiB.
    small = ("--device-memory-gb", "40")
    each = (40 * 10**9 - _training_state_nbytes()) // 16 // MIB * MIB
    assert MIB < each < GIB
    _assert_more_by(_json(*small), _json(*small, "--engine-process"), 2 * each)


def test_the_table_shows_the_owner():
    out = _plan("--engine-process", "--engine-bucket-mib", "256")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "engine buckets 0.54" in out.stdout, out.stdout[:1500]  # 2 x 256 MiB in GB
    assert "engine in its own process (2 buckets of 256 MiB per rank)" in out.stdout, out.stdout[:1500]


@pytest.mark.parametrize("args,message", [
    (["--accelerator", "910b", "--engine-process"], "--engine-process with --accelerator 910b (npu)"),
    (["--engine-process", "--engine-bucket-mib", "0"], "--engine-bucket-mib 0: a bucket takes at least"),
    (["--engine-process", "--engine-bucket-mib", "-1"], "--engine-bucket-mib -1: a bucket takes at least"),
    (["--engine-bucket-mib", "64"], "--engine-bucket-mib 64 is for --engine-process"),
])
def test_bad_options_are_named(args, message):
    out = _plan(*args)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) <= 2, \
        out.stderr[-2000:]
