"""Switch latency: hybridmem's TRAIN<->INFER against the raw link and a naive per-tensor offload.

Builds a model of a given size with AdamW state and non-zero grads, then measures in one run:

(a) the raw copy bandwidth of the machine: one large device->host and host->device copy into
    pre-allocated pinned memory (on CPU: a memcpy between two preallocated buffers);
(b) a naive baseline, as hand-written sharding managers do it: for every tensor
    ``t.data = t.data.to("cpu")`` and back (on CPU, where ``.to("cpu")`` is a no-op, a fresh
    ``clone()`` per tensor, which is what the pageable round trip costs there);
(c) hybridmem's TRAIN->INFER and INFER->TRAIN (no engine: offload and onload only), the first switch
    (which allocates the host arenas) and the steady state (median of ``--repeats``).

It prints bytes, seconds, GB/s, the ratio of (c) to (a), the speed-up of (c) over (b), and the device
memory freed (``mem_get_info``) as a share of the bytes offloaded. Targets on a GPU: >= 0.9 of (a),
>= 10x over (b), freed >= 99%.

    python benchmarks/switch_latency.py --params 2e9 --dtype bf16          # on a GPU
    python benchmarks/switch_latency.py --params 5e7 --device cpu          # on CPU
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from hybridmem import Direction, HybridConfig, ShardingManager
from hybridmem.accel import Accelerator, get_accelerator
from hybridmem.memplan import format_nbytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(num_params: float, dtype: torch.dtype, accel: Accelerator, hidden: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A stack of ``hidden x hidden`` linear layers with about ``num_params`` weights, AdamW state and
    non-zero grads, all on the device."""
    num_layers = max(1, round(num_params / (hidden * hidden)))
    with torch.device(accel.device):
        model = torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden, bias=False, dtype=dtype) for _ in range(num_layers)))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt.step()  # creates exp_avg / exp_avg_sq in the param dtype
    accel.synchronize()
    return model, opt


def device_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    out += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.device == next(model.parameters()).device]
    return out


def raw_bandwidth(accel: Accelerator, nbytes: int, repeats: int) -> tuple[float, float]:
    """Seconds for one device->host and one host->device copy of ``nbytes`` (pinned, preallocated)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=accel.device)
    host = accel.alloc_host(nbytes, torch.uint8, pin=True)
    d2h, h2d = [], []
    for _ in range(repeats):
        accel.synchronize()
        t = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        accel.synchronize()
        d2h.append(time.perf_counter() - t)
        t = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        accel.synchronize()
        h2d.append(time.perf_counter() - t)
    del dev, host
    accel.empty_cache()
    return statistics.median(d2h), statistics.median(h2d)


def naive_round_trip(tensors: list[torch.Tensor], accel: Accelerator) -> tuple[float, float]:
    """The hand-written way: ``t.data = t.data.to('cpu')`` per tensor, then back."""
    accel.synchronize()
    t = time.perf_counter()
    on_cpu = accel.device.type == "cpu"
    for x in tensors:
        x.data = x.data.clone() if on_cpu else x.data.to("cpu")
    accel.synchronize()
    off = time.perf_counter() - t
    t = time.perf_counter()
    for x in tensors:
        x.data = x.data.clone() if on_cpu else x.data.to(accel.device)
    accel.synchronize()
    return off, time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=5e7, help="model weights (count)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()

    accel = get_accelerator(args.device)
    console = Console()
    model, opt = build(args.params, DTYPES[args.dtype], accel, args.hidden)
    tensors = device_tensors(model, opt)
    total = sum(x.untyped_storage().nbytes() for x in tensors)
    console.print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, device {accel.device}"
                  + (f" ({torch.cuda.get_device_name(accel.device)})" if accel.device.type == "cuda" else "")
                  + f", torch {torch.__version__}, {torch.get_num_threads()} threads")
    console.print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params ({args.dtype}), "
                  f"params + grads + AdamW state = {format_nbytes(total)} on the device")

    raw_d2h, raw_h2d = raw_bandwidth(accel, total, args.repeats)
    naive = [naive_round_trip(tensors, accel) for _ in range(args.repeats)]
    naive_off, naive_on = statistics.median(n[0] for n in naive), statistics.median(n[1] for n in naive)

    manager = ShardingManager(model, optimizer=opt, config=HybridConfig(skip_zero_grads=False), accel=accel)
    first_off = manager.to_infer()
    first_on = manager.to_train()
    offs, ons, freed = [], [], []
    for _ in range(args.repeats):
        free_before = accel.memory_figures().free_nbytes if accel.device.type != "cpu" else None
        offs.append(manager.to_infer())
        if free_before is not None:
            freed.append(accel.memory_figures().free_nbytes - free_before)
        ons.append(manager.to_train())
    off = sorted(offs, key=lambda r: r.seconds)[len(offs) // 2]
    on = sorted(ons, key=lambda r: r.seconds)[len(ons) // 2]
    moved = off.copied_nbytes
    assert moved == total, f"hybridmem moved {moved} bytes, expected {total}"

    def gbps(seconds: float) -> float:
        return total / seconds / 1e9

    table = Table(title="switch latency")
    for col in ("what", "bytes", "s", "GB/s", "vs raw link", "speed-up vs naive"):
        table.add_column(col, justify="right" if col != "what" else "left")
    rows = [
        ("raw copy D2H (preallocated)", raw_d2h, None),
        ("raw copy H2D (preallocated)", raw_h2d, None),
        ("naive per-tensor offload", naive_off, None),
        ("naive per-tensor onload", naive_on, None),
        ("hybridmem TRAIN->INFER, first", first_off.seconds, naive_off),
        ("hybridmem INFER->TRAIN, first", first_on.seconds, naive_on),
        ("hybridmem TRAIN->INFER", off.seconds, naive_off),
        ("hybridmem INFER->TRAIN", on.seconds, naive_on),
    ]
    figures = {}
    for name, seconds, naive_s in rows:
        raw = raw_d2h if ("offload" in name or "D2H" in name or "->INFER" in name) else raw_h2d
        table.add_row(name, format_nbytes(total), f"{seconds:.4f}", f"{gbps(seconds):.2f}",
                      f"{raw / seconds:.2f}", "" if naive_s is None else f"{naive_s / seconds:.1f}x")
        figures[name] = {"seconds": seconds, "gbps": gbps(seconds), "ratio_to_raw": raw / seconds,
                         "speedup_vs_naive": None if naive_s is None else naive_s / seconds}
    console.print(table)
    if freed:
        share = statistics.median(freed) / total
        console.print(f"device memory freed by TRAIN->INFER (mem_get_info): {format_nbytes(statistics.median(freed))} "
                      f"= {share * 100:.2f}% of the {format_nbytes(total)} offloaded")
        figures["freed_share"] = share
    else:
        console.print("device memory freed: CPU backend, freed bytes = tracked bytes "
                      f"({format_nbytes(off.freed_nbytes)} of {format_nbytes(total)})")
        figures["freed_share"] = off.freed_nbytes / total
    console.print(manager.last_reports[Direction.TO_INFER])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(accel.device), "total_nbytes": total, "figures": figures}, f, indent=2)


if __name__ == "__main__":
    main()
