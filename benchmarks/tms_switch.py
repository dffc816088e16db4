"""The training state of ``switch_latency.py``'s model paused and resumed by torch_memory_saver.

torch_memory_saver (SGLang's allocator, used by slime to co-locate Megatron and SGLang) allocates tensors
created inside ``region(tag, enable_cpu_backup=True)`` with ``cuMemCreate``/``cuMemMap``; ``pause(tag)``
copies them to host memory and unmaps the physical memory (addresses stay valid), ``resume(tag)`` maps
new memory and copies back. This script builds the same model as ``switch_latency.py`` (a stack of
linear layers with grads and AdamW state, all inside one region), runs ``--cycles`` pause/resume cycles
and prints each cycle's seconds, so its first cycles sit beside hybridmem's in the GPU suite's report.
It also checks that the state came back bitwise (a host copy taken before the first pause).

    python benchmarks/tms_switch.py --params 3e8 --hidden 4096 --dtype fp32 --cycles 5 --json tms.json

Needs CUDA and the ``torch_memory_saver`` package (0.0.10 works); without them it writes a JSON that says
why it was skipped and exits 0, so the GPU suite's CPU dry run goes through this script too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from kv_release import end_process, import_torch_memory_saver  # a sibling script of benchmarks/
from switch_latency import DTYPES, build, device_tensors

from hybridmem.accel import get_accelerator
from hybridmem.switch.memplan import format_nbytes

TAG = "train"


def measure(*, num_params: float, dtype: torch.dtype, hidden: int, cycles: int) -> dict:
    """Pause/resume the model's params, grads and AdamW state ``cycles`` times; figures per cycle."""
    saver = import_torch_memory_saver()
    accel = get_accelerator("cuda")
    with saver.region(tag=TAG, enable_cpu_backup=True):
        model, opt = build(num_params, dtype, accel, hidden)
    tensors = device_tensors(model, opt)
    total = sum(x.untyped_storage().nbytes() for x in tensors)
    reference = [x.detach().to("cpu") for x in tensors]
    rows = []
    for _ in range(cycles):
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        t = time.perf_counter()
        saver.pause(TAG)
        torch.cuda.synchronize()
        pause_s = time.perf_counter() - t
        freed = torch.cuda.mem_get_info()[0] - free0
        t = time.perf_counter()
        saver.resume(TAG)
        torch.cuda.synchronize()
        rows.append({"pause_s": pause_s, "resume_s": time.perf_counter() - t, "freed_nbytes": freed})
    bitwise = all(torch.equal(r, x.to("cpu")) for r, x in zip(reference, tensors))
    return {
        "num_params": sum(p.numel() for p in model.parameters()),
        "dtype": str(dtype).removeprefix("torch."),
        "total_nbytes": total,
        "cycles": rows,
        "steady": {"pause_s": statistics.median(r["pause_s"] for r in rows[1:]) if len(rows) > 1 else None,
                   "resume_s": statistics.median(r["resume_s"] for r in rows[1:]) if len(rows) > 1 else None},
        "freed_share": statistics.median(r["freed_nbytes"] for r in rows) / total,
        "bitwise_after_resume": bitwise,
    }


def skip_reason() -> str | None:
    """Why this benchmark cannot run here, or ``None``."""
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    if import_torch_memory_saver() is None:
        return "torch_memory_saver is not installed"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=5e7, help="model weights (count)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--cycles", type=int, default=4, help="pause/resume cycles (>= 1)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    if args.cycles < 1:
        parser.error(f"--cycles={args.cycles} must be >= 1")
    why = skip_reason()
    if why is not None:
        print(f"torch_memory_saver benchmark skipped: {why}")
        fig: dict = {"skipped": why}
    else:
        fig = measure(num_params=args.params, dtype=DTYPES[args.dtype], hidden=args.hidden,
                      cycles=args.cycles)
        fig["device"] = torch.cuda.get_device_name()
        print(f"torch_memory_saver, {format_nbytes(fig['total_nbytes'])} of params + grads + AdamW state "
              f"(cpu backup on):")
        for i, r in enumerate(fig["cycles"], 1):
            print(f"  cycle {i}: pause {r['pause_s']:.4f} s "
                  f"({fig['total_nbytes'] / r['pause_s'] / 1e9:.1f} GB/s), resume {r['resume_s']:.4f} s "
                  f"({fig['total_nbytes'] / r['resume_s'] / 1e9:.1f} GB/s), freed "
                  f"{format_nbytes(r['freed_nbytes'])}")
        print(f"state bitwise equal after resume: {fig['bitwise_after_resume']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=2)


if __name__ == "__main__":
    main()
    end_process()
