"""One command for every GPU claim of hybridmem: tests, switch speed, memory freed, peers, the demo.

    python benchmarks/gpu_suite.py --device cuda --out suite-out          # one H100/H200, < 9 minutes
    python benchmarks/gpu_suite.py --device cpu --quick --out suite-out   # the CPU dry run (CI), < 3 minutes

Each part runs as its own subprocess with a time limit (a crash or a hang in one part cannot take the
others down, and every part starts with a clean device), writes JSON, and the suite folds the results
into one markdown report (printed, and written to ``OUT/gpu_suite.md``) and one JSON
(``OUT/gpu_suite.json``). The parts:

- ``tests``: the CUDA tests (``pytest -m cuda``): counts and the names of failures.
- ``dsa``: ``vllm_sparse_attention.py``: vLLM's own DeepSeek-V3.2 and GLM-5 models (the CUDA sparse attention
  class and its indexer) loaded from a transformers checkpoint equal hybridmem's vLLM layout, every parameter
  (skipped, with the reason, without a CUDA device or vLLM).
- ``lora``: ``lora_shared_base.py``: a PEFT LoRA model trained under the manager with vLLM's LoRA, the base
  kept resident in the engine and then shared with the trainer (one copy): bytes per switch (the adapters'),
  switch times, device memory in TRAIN and INFER, greedy tokens against PEFT's (skipped, with the reason,
  without a CUDA device or vLLM).
- ``switch``: ``switch_latency.py`` at three sizes of params + grads + AdamW state (up to 20 GB on a
  GPU): each direction in GB/s against the raw pinned copy measured in the same process, against a
  naive per-tensor ``.to('cpu')``, first switch and steady state, device memory freed
  (``mem_get_info``) over bytes offloaded, and what the device holds in INFER outside every owner.
- ``tms``: the same models paused/resumed by torch_memory_saver (CPU backup on): the first cycles.
- ``kv``: ``kv_release.py``: the ``torch`` and ``cuda-vmm`` KV allocators and torch_memory_saver,
  address stability and a CUDA graph replayed after resume.
- ``buckets``: ``bucket_transport.py``: the engine-in-its-own-process weight transport without vLLM: the
  real bucket writer streams ~4 GB of LLM-shaped tensors through the CUDA IPC buckets into a stand-in
  worker process running the worker side's own receive code; GB/s against a raw device copy and against
  host staging, device and host memory of both processes, the worker's tensors checked equal (on CPU: the
  CUDA transfer skipped with the reason, the same path with the ``/dev/shm`` buckets at ~10 MB).
- ``checksum``: ``checksum.py``: the one checksum of the weights (``tensor_checksum``, and the figures
  taken while copying) beside a plain copy of the same tensor, 100 MB and 1 GB, fp32 and bf16.
- ``demo``: the GRPO demo on the device, torch, Megatron and FSDP2 trainers (one process: one GPU), and the
  torch trainer in a Ray worker actor holding the GPU's placement-group bundle (``--launcher ray``; on a GPU
  where Ray is installed).

The parent never touches the device, so each part's ``mem_get_info`` sees only its own process.
Targets (GPU only): steady-state switch >= 0.9 of the raw pinned link both ways, first switch within 2x
of the steady state, >= 10x over naive, freed >= 0.99 of offloaded. Missed targets are reported, not
fatal; the exit status is 1 when a part failed to run (error or time-out), else 0. ``--device cuda`` where
this Python's torch sees no CUDA device is refused before any part runs (one line, exit status 2).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GB = 1e9
PARTS = ("tests", "dsa", "lora", "switch", "tms", "kv", "buckets", "checksum", "demo")


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """Sizes for one kind of run."""

    state_nbytes: tuple[float, ...]
    """Bytes of params + grads + AdamW state per switch size (fp32: 16 bytes per parameter)."""
    hidden: int
    repeats: int
    """Steady-state switch cycles after the first."""
    naive_repeats: int
    kv_gib: float
    kv_cycles: int
    demo_iters: int
    test_paths: tuple[str, ...] = ("tests",)


PROFILES = {
    ("cuda", False): Profile(state_nbytes=(1.25 * GB, 5 * GB, 20 * GB), hidden=4096, repeats=3,
                             naive_repeats=2, kv_gib=16, kv_cycles=5, demo_iters=12),
    ("cuda", True): Profile(state_nbytes=(0.25 * GB, 1 * GB, 2 * GB), hidden=4096, repeats=2, naive_repeats=1,
                            kv_gib=2, kv_cycles=3, demo_iters=3),
    ("cpu", False): Profile(state_nbytes=(0.1 * GB, 0.2 * GB, 0.4 * GB), hidden=1024, repeats=3,
                            naive_repeats=2, kv_gib=0.25, kv_cycles=3, demo_iters=12),
    # The CPU dry run shows the tests part runs and is reported; collecting the whole tree (every vLLM,
    # Megatron and TRL import) would only cost time, so it collects the files made of CUDA tests.
    ("cpu", True): Profile(state_nbytes=(8e6, 32e6), hidden=512, repeats=2, naive_repeats=1,
                           kv_gib=0.03, kv_cycles=2, demo_iters=2,
                           test_paths=("tests/test_cuda_memory.py", "tests/kv",
                                       "tests/offload/test_host_pool.py", "tests/megatron/test_cuda.py")),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """One subprocess of the suite."""

    part: str
    label: str
    argv: tuple[str, ...]
    timeout_s: float
    result: str | None = None
    """File (in the output folder) the job writes its figures to."""


@dataclass(kw_only=True, slots=True)
class JobRun:
    """How a job went."""

    label: str
    part: str
    command: str
    rc: int | None
    """Exit status; ``None`` if it was not started (budget spent) or timed out."""
    seconds: float
    status: str
    """``ok``, ``failed``, ``timeout`` or ``not run``."""
    log: str
    result: dict | None = field(default=None)


def build_jobs(device: str, quick: bool, out: Path, parts: tuple[str, ...]) -> list[Job]:
    """The suite's jobs for ``device``, in the order they run."""
    prof = PROFILES[(device, quick)]
    py = sys.executable
    bench = str(HERE)
    jobs: list[Job] = []
    if "tests" in parts:
        jobs.append(Job(part="tests", label="cuda tests", timeout_s=240, result="cuda_tests.xml",
                        argv=(py, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                              f"--junitxml={out / 'cuda_tests.xml'}", *prof.test_paths)))
    if "dsa" in parts:
        jobs.append(Job(part="dsa", label="dsa vllm", timeout_s=150, result="dsa.json",
                        argv=(py, f"{bench}/vllm_sparse_attention.py", "--device", device,
                              "--json", str(out / "dsa.json"))))
    if "lora" in parts:
        jobs.append(Job(part="lora", label="lora shared base", timeout_s=240, result="lora.json",
                        argv=(py, f"{bench}/lora_shared_base.py", "--device", device, "--json",
                              str(out / "lora.json"))))
    for i, nbytes in enumerate(prof.state_nbytes):
        params = f"{nbytes / 16:.4g}"
        if "switch" in parts:
            jobs.append(Job(part="switch", label=f"switch {nbytes / GB:g} GB", timeout_s=150,
                            result=f"switch_{i}.json",
                            argv=(py, f"{bench}/switch_latency.py", "--device", device, "--params", params,
                                  "--hidden", str(prof.hidden), "--dtype", "fp32", "--repeats",
                                  str(prof.repeats), "--naive-repeats", str(prof.naive_repeats), "--json",
                                  str(out / f"switch_{i}.json"))))
        if "tms" in parts:
            jobs.append(Job(part="tms", label=f"torch_memory_saver {nbytes / GB:g} GB", timeout_s=120,
                            result=f"tms_{i}.json",
                            argv=(py, f"{bench}/tms_switch.py", "--params", params, "--hidden",
                                  str(prof.hidden), "--dtype", "fp32", "--cycles", str(prof.repeats + 1),
                                  "--json", str(out / f"tms_{i}.json"))))
    if "kv" in parts:
        jobs.append(Job(part="kv", label=f"kv {prof.kv_gib:g} GiB", timeout_s=120, result="kv.json",
                        argv=(py, f"{bench}/kv_release.py", "--device", device, "--gib", str(prof.kv_gib),
                              "--cycles", str(prof.kv_cycles), "--graph-check", "--json",
                              str(out / "kv.json"))))
    if "buckets" in parts:
        jobs.append(Job(part="buckets", label="bucket transport", timeout_s=120, result="buckets.json",
                        argv=(py, f"{bench}/bucket_transport.py", "--device", device,
                              *(("--quick",) if quick else ()), "--json", str(out / "buckets.json"))))
    if "checksum" in parts:
        jobs.append(Job(part="checksum", label="checksum", timeout_s=90, result="checksum.json",
                        argv=(py, f"{bench}/checksum.py", "--device", device, "--mb",
                              *(("10",) if quick else ("100", "1000")), "--reps", "3" if quick else "5",
                              "--json", str(out / "checksum.json"))))
    if "demo" in parts:
        for trainer in ("torch", "megatron", "fsdp"):
            jobs.append(Job(part="demo", label=f"demo --trainer {trainer}", timeout_s=240,
                            result=f"demo_{trainer}/grpo.json",
                            argv=(py, "-m", "hybridmem", "demo", "--device", device, "--trainer", trainer,
                                  "--world-size", "1", "--train-tp", "1", "--infer-tp", "1",
                                  "--iters", str(prof.demo_iters), "--out", str(out / f"demo_{trainer}"))))
        # On a GPU, where Ray is installed (the ray extra); the CPU dry run leaves it to
        # tests/examples/test_grpo_ray.py, which runs this command's shape (one actor) and the other
        # launchers'.
        if device == "cuda" and importlib.util.find_spec("ray") is not None:
            jobs.append(Job(part="demo", label="demo --launcher ray", timeout_s=240,
                            result="demo_ray/grpo.json",
                            argv=(py, "-m", "hybridmem", "demo", "--device", device, "--launcher", "ray",
                                  "--world-size", "1", "--train-tp", "1", "--infer-tp", "1",
                                  "--iters", str(prof.demo_iters), "--out", str(out / "demo_ray"))))
    return jobs


def read_junit(path: Path) -> dict:
    """Counts and failing test names from a pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failed": failed}


def run_job(job: Job, out: Path, env: dict[str, str], budget_left_s: float) -> JobRun:
    """Run one job with ``min(job.timeout_s, budget_left_s)`` seconds; its output goes to a log file."""
    log = out / "logs" / (job.label.replace(" ", "_").replace("-", "").replace(".", "p") + ".log")
    command = " ".join(job.argv)
    if budget_left_s < 5:
        return JobRun(label=job.label, part=job.part, command=command, rc=None, seconds=0.0, status="not run",
                      log=str(log.relative_to(out)))
    t = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(job.argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=min(job.timeout_s, budget_left_s)).returncode
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            rc, status = None, "timeout"
    run = JobRun(label=job.label, part=job.part, command=command, rc=rc, seconds=time.perf_counter() - t,
                 status=status, log=str(log.relative_to(out)))
    path = out / job.result if job.result else None
    if path is not None and path.exists():
        run.result = read_junit(path) if path.suffix == ".xml" else json.loads(path.read_text())
    if job.part == "tests" and run.result is not None and run.result["failures"] + run.result["errors"] > 0:
        run.status = "failed"
    return run


def machine_info(device: str) -> dict:
    """What ran the suite, read without touching the device (``nvidia-smi`` where present)."""
    info = {"host": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "device": device}
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = None
    if device == "cuda" and shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                            "--format=csv,noheader"],
                           capture_output=True, text=True, check=False)
        info["gpu"] = q.stdout.strip()
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                         check=False)
    info["commit"] = git.stdout.strip() or None
    return info


def cuda_unavailable() -> str | None:
    """Why ``--device cuda`` cannot run here, or ``None`` when this Python's torch sees a CUDA device.

    Asked in a subprocess, so the parent still never touches the device (see the module docstring).
    """
    probe = ("import json, torch; print(json.dumps([torch.__version__, torch.version.cuda, "
             "torch.cuda.is_available()]))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return f"torch does not import in {sys.executable} ({proc.stderr.strip().splitlines()[-1:]})"
    version, cuda, available = json.loads(proc.stdout.strip().splitlines()[-1])
    if available:
        return None
    build = "a CPU-only build" if cuda is None else f"built for CUDA {cuda}, but no CUDA device is visible"
    return f"torch.cuda.is_available() is False in {sys.executable} (torch {version}, {build})"


def _gib(nbytes: float | None) -> str:
    from hybridmem.switch.memplan import format_nbytes  # the parent imports no torch before it must

    return "-" if nbytes is None else format_nbytes(nbytes)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def report(info: dict, runs: list[JobRun], device: str) -> str:
    """The markdown report of one suite run."""
    by_part: dict[str, list[JobRun]] = {}
    for r in runs:
        by_part.setdefault(r.part, []).append(r)
    lines = [f"# hybridmem GPU suite ({info['date']})", "",
             f"machine: {info.get('gpu') or device}; host {info['host']}, {info['cpu_count']} CPUs, "
             f"Python {info['python']}, torch {info['torch']}, commit {info['commit']}", ""]

    for r in by_part.get("tests", []):
        res = r.result or {}
        lines += ["## CUDA tests (`pytest -m cuda`)", "",
                  f"{res.get('passed', '-')} passed, {res.get('failures', '-')} failed, "
                  f"{res.get('errors', '-')} errors, {res.get('skipped', '-')} skipped ({r.status}, "
                  f"{r.seconds:.0f} s)", ""]
        lines += [f"- failed: `{name}`" for name in res.get("failed", [])]
        lines.append("")

    for r in by_part.get("dsa", []):
        lines += ["## DeepSeek sparse attention in vLLM (`vllm_sparse_attention.py`)", ""]
        res = r.result or {}
        if "skipped" in res:
            lines.append(f"skipped: {res['skipped']}")
        for model_type, f in res.get("families", {}).items():
            verdict = "equal to the layout" if f["ok"] else (
                f"**differs**: missing in vLLM {f['missing_in_vllm']}, not in the layout "
                f"{f['not_in_layout']}, different values {f['different']}")
            lines.append(f"- `{model_type}` (vLLM {res['vllm']}, `{f['model_class']}`, indexer "
                         f"{', '.join(f['indexer_class'])}): {f['parameters']} parameters "
                         f"({f['indexer_parameters']} of the indexer), {verdict}")
        if not res:
            lines.append(f"no figures ({r.status})")
        lines.append("")

    for r in by_part.get("lora", []):
        lines += ["## LoRA with vLLM: the base resident in the engine, then shared (`lora_shared_base.py`)",
                  ""]
        res = r.result or {}
        if "skipped" in res:
            lines.append(f"skipped: {res['skipped']}")
        for m in res.get("modes", []):
            steps = m["steps"]
            lines.append(f"- `{m['mode']}` ({m['route']}; adapters {_gib(m['adapter_nbytes'])}, base "
                         f"{_gib(m['base_nbytes'])}, {m['shared_tensors']} base tensors shared): synced "
                         f"{', '.join(_gib(s['synced_nbytes']) for s in steps)}; TRAIN->INFER ms "
                         f"{', '.join(_ms(s['to_infer_s']) for s in steps)}; device in use TRAIN "
                         f"{_gib(steps[-1]['train_used_nbytes'])}, INFER "
                         f"{_gib(steps[-1]['infer_used_nbytes'])}; greedy equal to PEFT "
                         f"{sum(s['greedy_equal'] for s in steps)}/{len(steps)}")
        if "ok" in res:
            lines.append(f"- shared saves {_gib(res['shared_saves_nbytes'])} in TRAIN; {res['ok']}")
        if not res:
            lines.append(f"no figures ({r.status})")
        lines.append("")

    switch = [r.result for r in by_part.get("switch", []) if r.result]
    if switch:
        lines += ["## Switch latency (params + grads + AdamW state, fp32)", "",
                  "| state | raw D2H / H2D GB/s | TRAIN->INFER s (GB/s, vs raw) "
                  "| INFER->TRAIN s (GB/s, vs raw) "
                  "| first / steady | vs naive (off / on) | freed / offloaded |",
                  "|---|---|---|---|---|---|---|"]
        for f in switch:
            total, st = f["total_nbytes"], f["steady"]
            lines.append(
                f"| {_gib(total)} | {f['raw']['d2h_gbps']:.1f} / {f['raw']['h2d_gbps']:.1f} "
                f"| {st['to_infer_s']:.3f} ({total / st['to_infer_s'] / GB:.1f}, "
                f"{f['to_infer_ratio_to_raw']:.2f}) "
                f"| {st['to_train_s']:.3f} ({total / st['to_train_s'] / GB:.1f}, "
                f"{f['to_train_ratio_to_raw']:.2f}) "
                f"| {f['first_vs_steady']:.2f}x "
                f"| {f['to_infer_speedup_vs_naive']:.1f}x / {f['to_train_speedup_vs_naive']:.1f}x "
                f"| {f['freed_share']:.4f} ({f['freed_source']}) |")
        lines.append("")
        for f in switch:  # where a steady switch's time goes (older JSON has no steps)
            for key, label in (("to_infer_steps", "TRAIN->INFER"), ("to_train_steps", "INFER->TRAIN")):
                if key in f["steady"]:
                    lines.append(f"- {_gib(f['total_nbytes'])}, steady {label} by step (ms): " + ", ".join(
                        f"{name} {sec * 1e3:.1f}" for name, sec in f["steady"][key].items()))
        lines.append("")

    tms_runs = by_part.get("tms", [])
    tms = {r.result["total_nbytes"]: r.result for r in tms_runs if r.result and "total_nbytes" in r.result}
    tms_skip = next((r.result["skipped"] for r in tms_runs if r.result and "skipped" in r.result), None)
    if switch:
        lines += ["## First three cycles: hybridmem vs torch_memory_saver (CPU backup)", "",
                  "| state | cycle | hybridmem TRAIN->INFER / INFER->TRAIN s | "
                  "torch_memory_saver pause / resume s |",
                  "|---|---|---|---|"]
        for f in switch:
            peer = tms.get(f["total_nbytes"])
            for i, c in enumerate(f["cycles"][:3]):
                if peer is None:
                    theirs = "skipped" if tms_skip else "not run"
                else:
                    pc = peer["cycles"][i] if i < len(peer["cycles"]) else None
                    theirs = "-" if pc is None else f"{pc['pause_s']:.3f} / {pc['resume_s']:.3f}"
                lines.append(f"| {_gib(f['total_nbytes'])} | {i + 1} "
                             f"| {c['to_infer_s']:.3f} / {c['to_train_s']:.3f} "
                             f"| {theirs} |")
        if tms_skip:
            lines.append(f"- torch_memory_saver skipped: {tms_skip}")
        lines += [f"- torch_memory_saver state bitwise equal after resume: {v['bitwise_after_resume']}, "
                  f"freed / paused {v['freed_share']:.4f} ({_gib(k)})" for k, v in tms.items()]
        lines.append("")

    for r in by_part.get("kv", []):
        if not r.result:
            continue
        lines += ["## KV cache release / resume", "",
                  "| allocator | pool | release s | resume s | touch s | freed | re-taken | address stable | "
                  "graph replay |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for k in r.result["results"]:
            graph = "-" if k.get("graph_replay") is None else ("ok" if k["graph_replay"] else "WRONG")
            lines.append(f"| {k['allocator']} | {_gib(k['nbytes'])} | {k['release_s']:.4f} "
                         f"| {k['resume_s']:.4f} "
                         f"| {k['touch_s']:.4f} | {_gib(k['freed_nbytes'])} | {_gib(k['retaken_nbytes'])} "
                         f"| {k['address_stable']} | {graph} |")
        lines += [f"- skipped {name}: {why}" for name, why in r.result.get("skipped", {}).items()]
        lines.append("")

    for r in by_part.get("buckets", []):
        lines += ["## Bucket transport: the engine in its own process, without vLLM (`bucket_transport.py`)",
                  ""]
        res = r.result or {}
        for key in ("skipped", "cuda_skipped"):
            if key in res:
                lines.append(f"CUDA IPC buckets skipped: {res[key]}")
        if "error" in res:
            lines.append(f"**failed**: {res['error']}")
        elif "weights_equal" in res:
            from bucket_transport import summary  # a sibling script

            lines += summary(res)
        if not res:
            lines.append(f"no figures ({r.status})")
        lines.append("")

    for r in by_part.get("checksum", []):
        lines += ["## The weights' checksum beside a copy (`checksum.py`)", "",
                  "| MB | dtype | copy ms | checksum ms (a read) | read / copy | copy with figures ms "
                  "| one pass | torch's chunked read ms |",
                  "|---:|---|---:|---:|---:|---:|---|---:|"]
        for row in (r.result or {}).get("rows", []):
            chunks = row.get("chunks_s")
            lines.append(f"| {row['nbytes'] / 1e6:.0f} | {row['dtype']} | {_ms(row['copy_s'])} | "
                         f"{_ms(row['checksum_s'])} | {row['checksum_s'] / row['copy_s']:.2f} | "
                         f"{_ms(row['fused1_s'])} | {'yes' if row.get('one_pass') else 'no'} | "
                         f"{'-' if chunks is None else _ms(chunks)} |")
        if not r.result:
            lines.append(f"no figures ({r.status})")
        lines.append("")

    demos = [r for r in by_part.get("demo", []) if r.result]
    if demos:
        lines += ["## GRPO demo (1 process; ray: 1 worker actor)", "",
                  "| trainer | iterations | wall s | reward first -> last | TO_INFER ms | TO_TRAIN ms "
                  "| device TRAIN / INFER | outside allocator in INFER |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in demos:
            its = r.result["iterations"]
            # med is called within this iteration only, so it reads this iteration's its
            med = lambda key: statistics.median(i[key] for i in its)  # noqa: E731, B023
            unexplained = its[-1].get("device_unexplained_nbytes")
            lines.append(f"| {r.label.split()[-1]} | {len(its)} | {r.seconds:.0f} "
                         f"| {r.result['first5_reward']:.3f} -> {r.result['last5_reward']:.3f} "
                         f"| {_ms(med('to_infer_s'))} | {_ms(med('to_train_s'))} "
                         f"| {_gib(its[-1]['device_train_nbytes'])} / {_gib(its[-1]['device_infer_nbytes'])} "
                         f"| {_gib(unexplained)} |")
        lines.append("")

    residencies = [(f["total_nbytes"], f["residency_in_infer"]) for f in switch
                   if f.get("residency_in_infer")]
    if residencies:
        lines += ["## Device in INFER, by owner (switch benchmark, no engine)", "",
                  "| state offloaded | owned | allocated, no owner | cached by allocator | "
                  "outside allocator | device used |",
                  "|---|---|---|---|---|---|"]
        for total, res in residencies:
            lines.append(f"| {_gib(total)} | {_gib(res['owned_nbytes'])} | {_gib(res['unowned_nbytes'])} "
                         f"| {_gib(res['cached_nbytes'])} | {_gib(res['unexplained_nbytes'])} | "
                         f"{_gib(res['device_used_nbytes'])} |")
        lines.append("")

    if switch:
        lines += ["## Targets", ""]
        if device == "cpu":
            lines.append("not applicable on CPU (no PCIe link, no `mem_get_info`); the dry run checks that "
                         "every part runs.")
        else:
            from switch_latency import targets_met  # a sibling script

            lines += ["| state | " + " | ".join(targets_met(switch[0])) + " |",
                      "|---|" + "---|" * len(targets_met(switch[0]))]
            for f in switch:
                lines.append(f"| {_gib(f['total_nbytes'])} | "
                             + " | ".join("met" if ok else "**missed**" for ok in targets_met(f).values())
                             + " |")
        lines.append("")

    lines += ["## Jobs", "", "| job | status | s | log |", "|---|---|---|---|"]
    lines += [f"| {r.label} | {r.status} | {r.seconds:.1f} | {r.log} |" for r in runs]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes (the CPU dry run, or a fast GPU check)")
    parser.add_argument("--out", default="gpu-suite-out", help="folder for the report, JSON and logs")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="wall-clock budget for all parts (default 540)")
    args = parser.parse_args(argv)
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown part(s) {unknown}; choose from {list(PARTS)}")

    if args.device == "cuda":
        why = cuda_unavailable()
        if why is not None:
            print(f"gpu_suite.py: --device cuda needs a CUDA device, and {why}: run it on a GPU "
                  f"machine, or run the CPU dry run with --device cpu --quick", file=sys.stderr)
            return 2
    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    info = machine_info(args.device)
    jobs = build_jobs(args.device, args.quick, out, parts)
    start = time.perf_counter()
    runs = []
    for job in jobs:
        run = run_job(job, out, env, args.budget_s - (time.perf_counter() - start))
        print(f"[{time.perf_counter() - start:6.1f} s] {job.label}: {run.status} ({run.seconds:.1f} s)",
              flush=True)
        runs.append(run)
    text = report(info, runs, args.device)
    (out / "gpu_suite.md").write_text(text)
    (out / "gpu_suite.json").write_text(json.dumps({"machine": info, "runs": [asdict(r) for r in runs]},
                                                   indent=1))
    print(text)
    bad = [r.label for r in runs if r.status != "ok"]
    if bad:
        print(f"parts that did not finish: {bad} (logs in {out / 'logs'})", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    # The report reads sibling scripts and hybridmem's formatting: from the source tree, where hybridmem
    # is not installed (a bare GPU machine, docs/gpu.md), as the parts read it through PYTHONPATH.
    sys.path[:0] = [str(HERE), str(ROOT)]
    raise SystemExit(main())
