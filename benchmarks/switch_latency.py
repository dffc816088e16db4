"""Switch latency: hybridmem's TRAIN<->INFER against the raw link and a naive per-tensor offload.

Builds a model of a given size with AdamW state and non-zero grads, then measures in one run:

(a) the raw copy bandwidth of the machine: one large device->host and host->device copy into
    pre-allocated pinned memory (on CPU: a memcpy between two preallocated buffers);
(b) a naive baseline, as hand-written sharding managers do it: for every tensor
    ``t.data = t.data.to("cpu")`` and back (on CPU, where ``.to("cpu")`` is a no-op, a fresh
    ``clone()`` per tensor, which is what the pageable round trip costs there);
(c) hybridmem's TRAIN->INFER and INFER->TRAIN (no engine: offload and onload only), each cycle after one
    training step (forward, backward, AdamW step), as in an RL loop: the first switch and the steady
    state (median of ``--repeats``). The host arenas are prewarmed in the background from the manager's
    construction on (``prewarm_host_buffers``), so the first switch finds them ready when a training step
    ran in between; a first switch right after construction, with no step to overlap, is measured apart
    (a second manager on the same model), and so is a first switch with prewarming off.

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

from hybridmem import HybridConfig, ShardingManager
from hybridmem.accel import Accelerator, get_accelerator
from hybridmem.switch.memplan import format_nbytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(num_params: float, dtype: torch.dtype, accel: Accelerator,
          hidden: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A stack of ``hidden x hidden`` linear layers with about ``num_params`` weights, AdamW state and
    non-zero grads, all on the device."""
    num_layers = max(1, round(num_params / (hidden * hidden)))
    with torch.device(accel.device):
        model = torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden, bias=False, dtype=dtype)
                                      for _ in range(num_layers)))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt.step()  # creates exp_avg / exp_avg_sq in the param dtype
    accel.synchronize()
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, accel: Accelerator, hidden: int) -> float:
    """One forward/backward/AdamW step on a batch of 8 random rows; returns its seconds."""
    start = time.perf_counter()
    x = torch.randn(8, hidden, device=accel.device, dtype=next(model.parameters()).dtype)
    model(x).float().square().mean().backward()
    opt.step()
    accel.synchronize()
    return time.perf_counter() - start


def first_switch(model: torch.nn.Module, opt: torch.optim.Optimizer, accel: Accelerator, *,
                 prewarm: bool) -> dict:
    """The first TRAIN->INFER and INFER->TRAIN of a manager used right after its construction."""
    manager = ShardingManager(model, optimizer=opt, accel=accel,
                              config=HybridConfig(skip_zero_grads=False, prewarm_host_buffers=prewarm))
    off, on = manager.to_infer(), manager.to_train()
    manager.close()
    return {"to_infer_s": off.seconds, "to_train_s": on.seconds}


def device_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    out += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
            and v.device == next(model.parameters()).device]
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


TARGETS = {"ratio_to_raw": 0.9, "first_vs_steady": 2.0, "speedup_vs_naive": 10.0, "freed_share": 0.99}
"""GPU targets: steady-state switch >= 0.9 of the raw pinned link both ways, the first switch within 2x of
the steady state, >= 10x over the naive per-tensor loop, device memory freed >= 99% of the bytes offloaded."""


def measure(accel: Accelerator, *, num_params: float, dtype: torch.dtype, hidden: int, repeats: int,
            naive_repeats: int) -> dict:
    """Run (a), (b) and (c) on one model and return the figures (JSON-ready).

    The switch runs ``repeats + 1`` TRAIN->INFER->TRAIN cycles: cycle 1 allocates the host arenas, the
    steady state is the median over the others. ``cycles`` keeps every cycle's seconds.
    """
    model, opt = build(num_params, dtype, accel, hidden)
    tensors = device_tensors(model, opt)
    total = sum(x.untyped_storage().nbytes() for x in tensors)
    raw_d2h, raw_h2d = raw_bandwidth(accel, total, repeats)
    naive = [naive_round_trip(tensors, accel) for _ in range(naive_repeats)]
    naive_off, naive_on = statistics.median(n[0] for n in naive), statistics.median(n[1] for n in naive)
    del tensors
    accel.empty_cache()

    immediate = first_switch(model, opt, accel, prewarm=True)
    cold = first_switch(model, opt, accel, prewarm=False)
    accel.empty_cache()

    manager = ShardingManager(model, optimizer=opt, config=HybridConfig(skip_zero_grads=False), accel=accel)
    cycles, freed, residency = [], [], None
    for _ in range(repeats + 1):
        step_s = train_step(model, opt, accel, hidden)
        free_before = accel.memory_figures().free_nbytes if accel.measures_device_memory else None
        off = manager.to_infer()
        if free_before is not None:
            freed.append(accel.memory_figures().free_nbytes - free_before)
        residency = manager.residency()
        if off.copied_nbytes != total:
            raise RuntimeError(f"hybridmem moved {off.copied_nbytes} bytes, expected {total}")
        on = manager.to_train()
        cycles.append({"to_infer_s": off.seconds, "to_train_s": on.seconds, "freed_nbytes": off.freed_nbytes,
                       "train_step_s": step_s, "to_infer_steps": _steps(off), "to_train_steps": _steps(on)})
    steady_off = statistics.median(c["to_infer_s"] for c in cycles[1:])
    steady_on = statistics.median(c["to_train_s"] for c in cycles[1:])
    # where a steady switch's time goes: each step's median (the copies, the frees, empty_cache, ...)
    steady_steps = {key: {name: statistics.median(c[key][name] for c in cycles[1:])
                          for name in cycles[1][key]} for key in ("to_infer_steps", "to_train_steps")}
    freed_share = (statistics.median(freed) if freed else cycles[-1]["freed_nbytes"]) / total
    manager.close()
    return {
        "num_params": sum(p.numel() for p in model.parameters()),
        "dtype": str(dtype).removeprefix("torch."),
        "total_nbytes": total,
        "raw": {"d2h_s": raw_d2h, "h2d_s": raw_h2d, "d2h_gbps": total / raw_d2h / 1e9,
                "h2d_gbps": total / raw_h2d / 1e9},
        "naive": {"offload_s": naive_off, "onload_s": naive_on},
        "cycles": cycles,
        "steady": {"to_infer_s": steady_off, "to_train_s": steady_on, **steady_steps},
        "to_infer_ratio_to_raw": raw_d2h / steady_off,
        "to_train_ratio_to_raw": raw_h2d / steady_on,
        "to_infer_speedup_vs_naive": naive_off / steady_off,
        "to_train_speedup_vs_naive": naive_on / steady_on,
        "first_vs_steady": max(cycles[0]["to_infer_s"] / steady_off, cycles[0]["to_train_s"] / steady_on),
        "first_right_after_construction": immediate,
        "first_without_prewarm": cold,
        "freed_share": freed_share,
        "freed_source": "mem_get_info" if freed else "tracked",
        "residency_in_infer": None if residency is None else residency.to_dict(),
    }


def _steps(report) -> dict[str, float]:
    """Seconds of each step of a switch, and of an offload or onload step its copies' and its frees' or
    allocations' share (``offload param: copy``, ``onload param: allocate``, ...)."""
    out = {}
    for st in report.steps:
        out[st.name] = st.seconds
        for key in ("copy_s", "free_s", "allocate_s"):
            if key in st.extra:
                out[f"{st.name}: {key.removesuffix('_s')}"] = st.extra[key]
    return out


def targets_met(fig: dict) -> dict[str, bool]:
    """Each GPU target of :data:`TARGETS`, checked on one :func:`measure` result."""
    return {
        "to_infer >= 0.9 raw": fig["to_infer_ratio_to_raw"] >= TARGETS["ratio_to_raw"],
        "to_train >= 0.9 raw": fig["to_train_ratio_to_raw"] >= TARGETS["ratio_to_raw"],
        "first <= 2x steady": fig["first_vs_steady"] <= TARGETS["first_vs_steady"],
        ">= 10x naive": min(fig["to_infer_speedup_vs_naive"],
                            fig["to_train_speedup_vs_naive"]) >= TARGETS["speedup_vs_naive"],
        "freed >= 0.99": fig["freed_share"] >= TARGETS["freed_share"],
    }


def table(fig: dict) -> Table:
    """The figures of one :func:`measure` as a rich table."""
    total = fig["total_nbytes"]
    raw_d2h, raw_h2d = fig["raw"]["d2h_s"], fig["raw"]["h2d_s"]
    naive_off, naive_on = fig["naive"]["offload_s"], fig["naive"]["onload_s"]
    first = fig["cycles"][0]
    out = Table(title=f"switch latency, {format_nbytes(total)} of params + grads + AdamW state")
    for col in ("what", "s", "GB/s", "vs raw link", "speed-up vs naive"):
        out.add_column(col, justify="right" if col != "what" else "left")
    rows = [
        ("raw copy D2H (pinned, preallocated)", raw_d2h, raw_d2h, None),
        ("raw copy H2D (pinned, preallocated)", raw_h2d, raw_h2d, None),
        ("naive per-tensor offload", naive_off, raw_d2h, None),
        ("naive per-tensor onload", naive_on, raw_h2d, None),
        ("hybridmem TRAIN->INFER, first (after a training step)", first["to_infer_s"], raw_d2h, naive_off),
        ("hybridmem INFER->TRAIN, first", first["to_train_s"], raw_h2d, naive_on),
        ("TRAIN->INFER, first, right after construction", fig["first_right_after_construction"]["to_infer_s"],
         raw_d2h, naive_off),
        ("TRAIN->INFER, first, prewarming off", fig["first_without_prewarm"]["to_infer_s"], raw_d2h,
         naive_off),
        ("hybridmem TRAIN->INFER, steady", fig["steady"]["to_infer_s"], raw_d2h, naive_off),
        ("hybridmem INFER->TRAIN, steady", fig["steady"]["to_train_s"], raw_h2d, naive_on),
    ]
    for name, seconds, raw, naive_s in rows:
        out.add_row(name, f"{seconds:.4f}", f"{total / seconds / 1e9:.2f}", f"{raw / seconds:.2f}",
                    "" if naive_s is None else f"{naive_s / seconds:.1f}x")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, default=5e7, help="model weights (count)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=5, help="steady-state cycles after the first (>= 2)")
    parser.add_argument("--naive-repeats", type=int, default=None,
                        help="naive round trips (default: --repeats)")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error(f"--repeats={args.repeats}: need at least 2 cycles after the first")

    accel = get_accelerator(args.device)
    console = Console(width=120)
    console.print(f"machine: {platform.node()} {platform.processor() or platform.machine()}, device "
                  f"{accel.device}"
                  + (f" ({torch.cuda.get_device_name(accel.device)})" if accel.device.type == "cuda" else "")
                  + f", torch {torch.__version__}, {torch.get_num_threads()} threads")
    fig = measure(accel, num_params=args.params, dtype=DTYPES[args.dtype], hidden=args.hidden,
                  repeats=args.repeats, naive_repeats=args.naive_repeats or args.repeats)
    fig["device"] = str(accel.device) + (f" ({torch.cuda.get_device_name(accel.device)})"
                                         if accel.device.type == "cuda" else "")
    console.print(f"model: {fig['num_params'] / 1e6:.1f} M params ({args.dtype}), "
                  f"params + grads + AdamW state = {format_nbytes(fig['total_nbytes'])} on the device")
    console.print(table(fig))
    console.print("first 3 cycles (TRAIN->INFER / INFER->TRAIN s): "
                  + ", ".join(f"{c['to_infer_s']:.4f} / {c['to_train_s']:.4f}" for c in fig["cycles"][:3])
                  + f"; training step before each: {fig['cycles'][0]['train_step_s']:.3f} s")
    steady = fig["steady"]
    console.print("first / steady: TRAIN->INFER "
                  f"{fig['cycles'][0]['to_infer_s'] / steady['to_infer_s']:.2f}x, INFER->TRAIN "
                  f"{fig['cycles'][0]['to_train_s'] / steady['to_train_s']:.2f}x (after a training step); "
                  "right after construction "
                  f"{fig['first_right_after_construction']['to_infer_s'] / steady['to_infer_s']:.2f}x; "
                  f"prewarming off {fig['first_without_prewarm']['to_infer_s'] / steady['to_infer_s']:.2f}x")
    for key, label in (("to_infer_steps", "TRAIN->INFER"), ("to_train_steps", "INFER->TRAIN")):
        console.print(f"steady {label} by step (ms): " + ", ".join(
            f"{name} {seconds * 1e3:.1f}" for name, seconds in steady[key].items()))
    console.print(f"device memory freed by TRAIN->INFER ({fig['freed_source']}): "
                  f"{fig['freed_share'] * 100:.2f}% of the {format_nbytes(fig['total_nbytes'])} offloaded")
    res = fig["residency_in_infer"]
    if res is not None and res["unexplained_nbytes"] is not None:
        console.print(f"device in INFER: {format_nbytes(res['device_used_nbytes'])} used, "
                      f"{format_nbytes(res['owned_nbytes'])} owned, "
                      f"{format_nbytes(res['cached_nbytes'])} cached, "
                      f"{format_nbytes(res['unexplained_nbytes'])} outside the allocator (CUDA context, ...)")
    if accel.measures_device_memory:
        console.print("targets: "
                      + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in targets_met(fig).items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=2)


if __name__ == "__main__":
    main()
