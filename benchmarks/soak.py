"""Soak: many TRAIN<->INFER cycles, with the process's memory measured by the operating system.

Builds a small model (``TinyNet``) with AdamW state and grads, a ``TorchCopyEngine`` and a
``ShardingManager``, runs a few warm-up cycles (the first one allocates the host arenas), then ``--cycles``
switch cycles (``to_infer`` + ``to_train``). Every ``--sample-every`` cycles it records the process's
resident set size (``VmRSS`` in ``/proc/self/status``), the host pool's bytes and, on CUDA, the device's
free bytes (``cudaMemGetInfo``). It prints the figures at start and end and the least-squares slope per
1,000 cycles; a leak of one tensor per cycle shows as a slope of its size times 1,000.

    python benchmarks/soak.py                                   # 10,000 cycles on CPU
    python benchmarks/soak.py --cycles 2000 --json soak.json    # what the CPU test runs
    python benchmarks/soak.py --device cuda                     # on a GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hybridmem import HybridConfig, ShardingManager
from hybridmem.accel import get_accelerator
from hybridmem.engines import TorchCopyEngine
from hybridmem.switch.memplan import format_nbytes
from hybridmem.testing.tiny import TinyNet, train_step

WARMUP_CYCLES = 20


def rss_nbytes() -> int:
    """The process's resident set size, from the kernel (``VmRSS`` of ``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise RuntimeError(f"unexpected VmRSS unit {unit!r} in /proc/self/status")
            return int(value) * 1024
    raise RuntimeError("/proc/self/status has no VmRSS line (not Linux?)")


@dataclass
class Sample:
    cycle: int
    rss_nbytes: int
    host_pool_nbytes: int
    device_free_nbytes: int | None


@dataclass
class SoakResult:
    device: str
    cycles: int
    dim: int
    seconds: float
    samples: list[Sample] = field(default_factory=list)

    @property
    def rss_slope_per_1k(self) -> float:
        """Least-squares slope of RSS over cycles, in bytes per 1,000 cycles."""
        xs = [s.cycle for s in self.samples]
        ys = [s.rss_nbytes for s in self.samples]
        return statistics.linear_regression(xs, ys).slope * 1000 if len(set(xs)) > 1 else 0.0

    @property
    def rss_growth_nbytes(self) -> int:
        return self.samples[-1].rss_nbytes - self.samples[0].rss_nbytes

    @property
    def host_pool_growth_nbytes(self) -> int:
        return self.samples[-1].host_pool_nbytes - self.samples[0].host_pool_nbytes

    @property
    def device_free_drop_nbytes(self) -> int | None:
        first, last = self.samples[0].device_free_nbytes, self.samples[-1].device_free_nbytes
        return None if first is None or last is None else first - last

    def to_dict(self) -> dict:
        return {
            **{k: v for k, v in asdict(self).items() if k != "samples"},
            "rss_start_nbytes": self.samples[0].rss_nbytes,
            "rss_end_nbytes": self.samples[-1].rss_nbytes,
            "rss_growth_nbytes": self.rss_growth_nbytes,
            "rss_slope_per_1k_cycles_nbytes": self.rss_slope_per_1k,
            "host_pool_start_nbytes": self.samples[0].host_pool_nbytes,
            "host_pool_end_nbytes": self.samples[-1].host_pool_nbytes,
            "device_free_drop_nbytes": self.device_free_drop_nbytes,
            "samples": [asdict(s) for s in self.samples],
        }


def soak(*, cycles: int = 10_000, dim: int = 64, device: str = "cpu", sample_every: int = 250) -> SoakResult:
    """Run ``cycles`` switch cycles after a warm-up and sample the OS's memory figures."""
    if cycles < 1 or sample_every < 1 or dim < 1:
        raise ValueError(f"cycles={cycles}, sample_every={sample_every} and dim={dim} must be >= 1")
    accel = get_accelerator(device)
    torch.manual_seed(0)
    model = TinyNet(dim=dim).to(accel.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt, 0)
    manager = ShardingManager(model, TorchCopyEngine(model, kv_cache_nbytes=64 * dim * 4), optimizer=opt,
                              config=HybridConfig(device=device), accel=accel)
    cuda = accel.device.type == "cuda"

    def sample(cycle: int) -> Sample:
        gc.collect()
        free = torch.cuda.mem_get_info(accel.device)[0] if cuda else None
        return Sample(cycle, rss_nbytes(), manager.pool.held_nbytes(), free)

    for _ in range(WARMUP_CYCLES):
        manager.to_infer()
        manager.to_train()
    result = SoakResult(device=str(accel.device), cycles=cycles, dim=dim, seconds=0.0, samples=[sample(0)])
    start = time.perf_counter()
    for cycle in range(1, cycles + 1):
        manager.to_infer()
        manager.to_train()
        if cycle % sample_every == 0 or cycle == cycles:
            result.samples.append(sample(cycle))
    result.seconds = time.perf_counter() - start
    manager.close()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description="TRAIN<->INFER soak with OS-measured memory")
    p.add_argument("--cycles", type=int, default=10_000,
                   help="switch cycles after the warm-up (default 10000)")
    p.add_argument("--dim", type=int, default=64, help="TinyNet width (default 64)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, ...")
    p.add_argument("--sample-every", type=int, default=250, help="cycles between samples (default 250)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    torch.set_num_threads(1)
    r = soak(cycles=args.cycles, dim=args.dim, device=args.device, sample_every=args.sample_every)
    first, last = r.samples[0], r.samples[-1]
    print(f"soak on {r.device} ({platform.node()}), TinyNet dim={r.dim}, {r.cycles} cycles in "
          f"{r.seconds:.1f} s ({r.seconds / r.cycles * 1e3:.2f} ms/cycle)")
    print(f"  RSS        start {format_nbytes(first.rss_nbytes)}, end {format_nbytes(last.rss_nbytes)}, "
          f"growth {format_nbytes(r.rss_growth_nbytes)}, slope {format_nbytes(r.rss_slope_per_1k)} / "
          "1,000 cycles")
    print(f"  host pool  start {format_nbytes(first.host_pool_nbytes)}, end "
          f"{format_nbytes(last.host_pool_nbytes)}")
    if r.device_free_drop_nbytes is not None:
        print(f"  device free (mem_get_info) start {format_nbytes(first.device_free_nbytes)}, end "
              f"{format_nbytes(last.device_free_nbytes)}, drop {format_nbytes(r.device_free_drop_nbytes)}")
    if args.json:
        args.json.write_text(json.dumps(r.to_dict(), indent=1))


if __name__ == "__main__":
    main()
