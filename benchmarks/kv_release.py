"""KV-cache release/resume: time, bytes and device memory really returned, per allocator.

For each KV-cache allocator that works on the device (``torch`` always; ``cuda-vmm`` with a GPU and
``cuda.bindings``; SGLang's ``torch_memory_saver`` when importable, as an outside reference) it allocates
a pool of ``--gib`` GiB, writes it once, then runs ``--cycles`` release/resume cycles and reports:

- allocate, release, resume: seconds (median over cycles for release/resume);
- touch: seconds to write the whole pool right after resume (on CPU this is where the pages are really
  faulted in, since ``resume`` only reserves them; on a GPU it is a memset);
- released: the bytes ``release()`` says it gave back;
- freed: how much the device's free memory grew on release (``mem_get_info`` on CUDA; on CPU the drop
  of the process's resident set, from ``/proc/self/statm``), and how much resume took again;
- address stable: whether the pool's ``data_ptr()`` is the same after every resume;
- graph replay (``--graph-check``, CUDA): a CUDA graph that writes into the pool, captured before the
  first release, replays after the last resume and writes the right values at the right address
  (only for allocators whose addresses are stable; for the others a graph must be re-captured).

    python benchmarks/kv_release.py --device cpu --gib 2 --cycles 10
    python benchmarks/kv_release.py --device cuda --gib 40 --cycles 10 --json kv.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.table import Table

from hybridmem.accel import Accelerator, get_accelerator
from hybridmem.kv import KV_ALLOCATORS, CudaVmmKVAllocator
from hybridmem.switch.memplan import format_nbytes

GIB = 1 << 30
BLOCK_NBYTES = 2 << 20  # 16 tokens x 32 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes (bf16) = 2 MiB
STANDALONE = ("torch", "cuda-vmm")
"""Allocators that own their pool (``vllm-sleep`` delegates to a running vLLM and is not benchmarked here)."""


@dataclass
class Result:
    """Figures for one allocator."""

    allocator: str
    nbytes: int
    allocate_s: float
    release_s: float
    resume_s: float
    touch_s: float
    released_nbytes: int
    freed_nbytes: int
    retaken_nbytes: int
    address_stable: bool
    graph_replay: bool | None = None
    """Whether a CUDA graph captured before release replayed correctly after resume (None: not checked)."""
    note: str = ""


def free_nbytes(accel: Accelerator) -> int:
    """Device free memory: ``mem_get_info`` on an accelerator, minus the resident set size on CPU."""
    accel.synchronize()
    if accel.device.type == "cpu":
        with open("/proc/self/statm") as f:
            rss_pages = int(f.read().split()[1])
        return -rss_pages * os.sysconf("SC_PAGE_SIZE")
    return accel.memory_figures().free_nbytes


def timed(accel: Accelerator, fn: Callable[[], object]) -> tuple[float, object]:
    accel.synchronize()
    t = time.perf_counter()
    out = fn()
    accel.synchronize()
    return time.perf_counter() - t, out


class GraphCheck:
    """A CUDA graph captured over the first MiB of a pool: ``y = x * 2`` with ``y`` inside the pool.

    After the pool was released and resumed, :meth:`replay_ok` writes fresh ``x``, replays the graph and
    checks that ``y`` (read through the pool's own tensor, i.e. at the captured address) holds ``x * 2``.
    """

    def __init__(self, pool: torch.Tensor):
        n = (1 << 20) // 4
        self.y = pool[: n * 4].view(torch.float32)
        self.x = torch.randn(n, device=pool.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up outside the capture, as torch.cuda.graphs recommends
            self.y.copy_(self.x * 2)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.y.copy_(self.x * 2)

    def replay_ok(self) -> bool:
        self.y.zero_()
        self.x.copy_(torch.randn(self.x.numel(),
                                 generator=torch.Generator().manual_seed(1)).to(self.x.device))
        self.graph.replay()
        torch.cuda.synchronize()
        return bool(torch.equal(self.y, self.x * 2))


def bench_allocator(name: str, accel: Accelerator, nbytes: int, cycles: int,
                    graph_check: bool = False) -> Result:
    """Allocate, touch, then ``cycles`` x (release, resume, touch) with a hybridmem KV allocator.

    With ``graph_check`` on CUDA and an address-stable allocator, a CUDA graph captured over the pool
    before the first release is replayed after the last resume (see :class:`GraphCheck`).
    """
    kv = KV_ALLOCATORS[name](accel)
    num_blocks = nbytes // BLOCK_NBYTES
    allocate_s, _ = timed(accel, lambda: kv.allocate(block_nbytes=BLOCK_NBYTES, num_blocks=num_blocks))
    pool = kv.view(torch.uint8, (kv.nbytes,))
    pool.fill_(1)
    ptr = pool.data_ptr()
    graph = (GraphCheck(pool) if graph_check and accel.device.type == "cuda" and kv.preserves_addresses
             else None)
    releases, resumes, touches, released, freed, retaken, stable = [], [], [], [], [], [], True
    for _ in range(cycles):
        before = free_nbytes(accel)
        seconds, nbytes_back = timed(accel, kv.release)
        releases.append(seconds)
        released.append(nbytes_back)
        after_release = free_nbytes(accel)
        freed.append(after_release - before)
        resumes.append(timed(accel, kv.resume)[0])
        touches.append(timed(accel, lambda: pool.fill_(1))[0])
        retaken.append(after_release - free_nbytes(accel))
        stable &= pool.data_ptr() == ptr
    replay = None if graph is None else graph.replay_ok()
    pool_nbytes = kv.nbytes
    del graph
    kv.close()
    return Result(
        allocator=name,
        nbytes=pool_nbytes,
        allocate_s=allocate_s,
        release_s=statistics.median(releases),
        resume_s=statistics.median(resumes),
        touch_s=statistics.median(touches),
        released_nbytes=int(statistics.median(released)),
        freed_nbytes=int(statistics.median(freed)),
        retaken_nbytes=int(statistics.median(retaken)),
        address_stable=stable,
        graph_replay=replay,
    )


def import_torch_memory_saver():
    """SGLang/slime's ``torch_memory_saver`` singleton in its in-process ``torch`` hook mode (a pluggable
    CUDA allocator, so no ``LD_PRELOAD`` is needed), or ``None`` when it is not installed."""
    try:
        from torch_memory_saver import torch_memory_saver as saver  # type: ignore[import-not-found]
    except ImportError:
        return None
    if getattr(saver, "_impl", None) is None:  # hook mode can only be chosen before first use
        saver.hook_mode = "torch"
    return saver


def end_process() -> None:
    """End this benchmark's process once its figures are written, past torch_memory_saver's teardown where
    it was loaded.

    On an H200 (torch 2.11, torch_memory_saver 0.0.10) a process that used torch_memory_saver's ``torch``
    hook mode aborts while the interpreter tears its objects down, after every figure was printed and
    written ("only support interesting region", from the library's free hook): the exit status then says
    the run failed when it did not. So such a process flushes its output and leaves with ``os._exit(0)``;
    any other process exits as usual.
    """
    if "torch_memory_saver" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def bench_torch_memory_saver(accel: Accelerator, nbytes: int, cycles: int,
                             graph_check: bool = False) -> Result | None:
    """SGLang's torch_memory_saver pausing one tensor of ``nbytes`` (no CPU backup), if importable."""
    saver = import_torch_memory_saver()
    if saver is None:
        return None
    holder: list[torch.Tensor] = []

    def allocate() -> None:
        with saver.region(tag="kv_cache"):
            holder.append(torch.empty(nbytes, dtype=torch.uint8, device=accel.device))

    allocate_s, _ = timed(accel, allocate)
    pool = holder[0]
    pool.fill_(1)
    ptr = pool.data_ptr()
    graph = GraphCheck(pool) if graph_check else None
    releases, resumes, touches, freed, retaken = [], [], [], [], []
    for _ in range(cycles):
        before = free_nbytes(accel)
        releases.append(timed(accel, lambda: saver.pause("kv_cache"))[0])
        after_release = free_nbytes(accel)
        freed.append(after_release - before)
        resumes.append(timed(accel, lambda: saver.resume("kv_cache"))[0])
        touches.append(timed(accel, lambda: pool.fill_(1))[0])
        retaken.append(after_release - free_nbytes(accel))
    return Result(
        allocator="torch_memory_saver",
        nbytes=nbytes,
        allocate_s=allocate_s,
        release_s=statistics.median(releases),
        resume_s=statistics.median(resumes),
        touch_s=statistics.median(touches),
        released_nbytes=nbytes,
        freed_nbytes=int(statistics.median(freed)),
        retaken_nbytes=int(statistics.median(retaken)),
        address_stable=pool.data_ptr() == ptr,
        graph_replay=None if graph is None else graph.replay_ok(),
        note="released_nbytes is the tensor size (the library reports none)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--gib", type=float, default=1.0, help="KV pool size in GiB")
    parser.add_argument("--cycles", type=int, default=5)
    parser.add_argument("--graph-check", action="store_true",
                        help="CUDA: replay a graph captured before release after resume "
                             "(address-stable pools)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    if args.cycles < 1:
        parser.error(f"--cycles={args.cycles} must be >= 1")

    accel = get_accelerator(args.device)
    nbytes = max(BLOCK_NBYTES, int(args.gib * GIB) // BLOCK_NBYTES * BLOCK_NBYTES)
    console = Console(width=160)
    console.print(
        f"machine: {platform.node()} {platform.processor() or platform.machine()}, device {accel.device}"
        + (f" ({torch.cuda.get_device_name(accel.device)})" if accel.device.type == "cuda" else "")
        + f", torch {torch.__version__}; pool {format_nbytes(nbytes)}, {args.cycles} cycles"
    )

    results: list[Result] = []
    skipped: dict[str, str] = {}
    for name, cls in KV_ALLOCATORS.items():
        if name not in STANDALONE:
            skipped[name] = "needs an inference engine (not a standalone pool)"
            continue
        if accel.name not in cls.backends:
            skipped[name] = f"does not support backend {accel.name!r}"
            continue
        if cls is CudaVmmKVAllocator and not CudaVmmKVAllocator.is_available():
            skipped[name] = "cuda.bindings is not installed"
            continue
        results.append(bench_allocator(name, accel, nbytes, args.cycles, args.graph_check))
    if accel.device.type == "cuda":
        tms = bench_torch_memory_saver(accel, nbytes, args.cycles, args.graph_check)
        if tms is None:
            skipped["torch_memory_saver"] = "not importable"
        else:
            results.append(tms)

    table = Table(title="KV-cache release / resume")
    cols = ("allocator", "pool", "allocate s", "release s", "resume s", "touch s", "released", "freed",
            "re-taken", "address stable", "graph replay")
    for col in cols:
        table.add_column(col, justify="left" if col == "allocator" else "right")
    for r in results:
        table.add_row(r.allocator, format_nbytes(r.nbytes), f"{r.allocate_s:.4f}", f"{r.release_s:.4f}",
                      f"{r.resume_s:.4f}", f"{r.touch_s:.4f}", format_nbytes(r.released_nbytes),
                      format_nbytes(r.freed_nbytes), format_nbytes(r.retaken_nbytes), str(r.address_stable),
                      "-" if r.graph_replay is None else ("ok" if r.graph_replay else "WRONG"))
    console.print(table)
    for name, why in skipped.items():
        console.print(f"skipped {name}: {why}")
    if accel.device.type == "cpu":
        console.print("CPU: freed / re-taken are changes of the process's resident set size")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(accel.device), "nbytes": nbytes, "cycles": args.cycles,
                       "results": [asdict(r) for r in results], "skipped": skipped}, f, indent=2)


if __name__ == "__main__":
    main()
    end_process()
