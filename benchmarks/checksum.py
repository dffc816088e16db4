"""Weight checksum against a copy: :func:`hybridmem.reshard.checksum.tensor_checksum` of one tensor (a read
of its own) and :func:`~hybridmem.reshard.checksum.copy_checksum` (the figures taken while copying, as the
engine-process transport takes them) beside ``dst.copy_(src)`` of the same tensor into a preallocated
one of its dtype, the same run.

Per size and dtype, in a fresh subprocess (so the peak RSS is the case's own): a ``(numel // 4096, 4096)``
tensor, ``--reps`` rounds of a copy, a checksum, a copy on one thread and a copy with figures on one
thread (interleaved, so a noisy neighbour slows all), the median of each, and two ratios against the
target (figures <= 0.25 x copy): the separate read's time over the copy's, and what the figures add to a
copy on one thread (each side of a sync runs on one thread, [Note: vllm packing] in
:mod:`hybridmem.adapters.vllm.server.packing`). Also the checksum's peak transient: the growth of the
process's peak RSS (``ru_maxrss``) over the checksums, measured after the tensors, the copy and the
figures of 8 elements (torch's, MKL's and numba's own start-up) are in place. The
transient is bounded by ``_CHUNK_NUMEL`` float64 elements plus the cached weight vectors, whatever the
size. ``one pass`` says whether the one-pass kernel ([Note: fused figures] in
:mod:`hybridmem.reshard.fused_checksum`: numba on a CPU, Triton on a GPU) served the copy with figures;
``checksum without the one-pass kernel`` times torch's chunked read of the same tensor, for comparison.

    python benchmarks/checksum.py                       # 10, 100, 400 MB; fp32 and bf16; on CPU
    python benchmarks/checksum.py --device cuda --mb 100 1000 --reps 5 --json checksum.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

_CHILD = """
import json, resource, statistics, sys, time
import torch
import hybridmem.reshard.checksum as checksum
from hybridmem.reshard.checksum import _CHUNK_NUMEL, copy_checksum, tensor_checksum
from hybridmem.reshard.fused_checksum import fused_figures
nbytes, dtype_name, device, reps = json.loads(sys.argv[1])
dtype = getattr(torch, dtype_name)
cols = 4096
rows = nbytes // (cols * torch.empty((), dtype=dtype).element_size())
src = torch.randn(rows, cols, dtype=dtype, device=device)  # no float32 temporary to raise the peak
dst = torch.empty_like(src)
dst.copy_(src)
tensor_checksum(src[:1, :8])
flat_src, flat_dst, threads = src.view(-1), dst.view(-1), torch.get_num_threads()
one_pass = fused_figures(flat_src[:8], flat_dst[:8], 0, cols, 61, 53) is not None  # numba's start-up
def sync():
    if device != "cpu":
        torch.cuda.synchronize()
before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
copy_s, checksum_s, copy1_s, fused1_s, chunks_s = [], [], [], [], []
for _ in range(reps):
    sync(); start = time.perf_counter(); dst.copy_(src); sync(); copy_s.append(time.perf_counter() - start)
    start = time.perf_counter(); tensor_checksum(src); checksum_s.append(time.perf_counter() - start)
    torch.set_num_threads(1)
    sync(); start = time.perf_counter(); dst.copy_(src); sync(); copy1_s.append(time.perf_counter() - start)
    start = time.perf_counter(); copy_checksum(flat_dst, flat_src, 0, tuple(src.shape)); sync()
    fused1_s.append(time.perf_counter() - start)
    torch.set_num_threads(threads)
peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib
checksum.fused_figures = lambda *args: None  # torch's chunked read alone (after the peak: its own buffer)
for _ in range(reps):
    start = time.perf_counter(); tensor_checksum(src); chunks_s.append(time.perf_counter() - start)
print(json.dumps(dict(nbytes=src.numel() * src.element_size(), copy_s=statistics.median(copy_s),
                      checksum_s=statistics.median(checksum_s), peak_bytes=peak_kib * 1024,
                      copy1_s=statistics.median(copy1_s), fused1_s=statistics.median(fused1_s),
                      one_pass=one_pass, chunks_s=statistics.median(chunks_s),
                      chunk_bytes=_CHUNK_NUMEL * 8, threads=torch.get_num_threads())))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, nargs="+", default=[10, 100, 400], help="tensor sizes in MB (1e6 B)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, device {args.device}")
    print("| MB | dtype | copy ms | checksum ms (a read) | read / copy | copy on one thread ms | copy with "
          "figures on one thread ms | figures' share: (with - copy) / copy | one pass | checksum without "
          "the one-pass kernel ms | checksum peak RSS growth MiB |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    rows = []
    for mb in args.mb:
        for dtype in args.dtypes:
            case = json.dumps([mb * 10**6, dtype, args.device, args.reps])
            out = subprocess.run([sys.executable, "-c", _CHILD, case], env=env, check=True,
                                 capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            rows.append({"dtype": dtype, **r})
            copy_ms, checksum_ms = r["copy_s"] * 1e3, r["checksum_s"] * 1e3
            copy1_ms, fused1_ms = r["copy1_s"] * 1e3, r["fused1_s"] * 1e3
            print(f"| {r['nbytes'] / 1e6:.0f} | {dtype} | {copy_ms:.2f} | {checksum_ms:.2f} | "
                  f"{checksum_ms / copy_ms:.2f} | {copy1_ms:.2f} | {fused1_ms:.2f} | "
                  f"{(fused1_ms - copy1_ms) / copy1_ms:.2f} | {'yes' if r['one_pass'] else 'no'} | "
                  f"{r['chunks_s'] * 1e3:.2f} | {r['peak_bytes'] / 2**20:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
