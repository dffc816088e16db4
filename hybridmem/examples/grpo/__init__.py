"""The GRPO demo (``hybridmem demo``): a tiny Qwen2-style policy learns a counting task with GRPO on CPU,
every iteration switching TRAIN <-> INFER through :class:`hybridmem.ShardingManager` with full
co-location (actor training, rollout engine and reference policy on the same devices).

Spawns ``--world-size`` processes (gloo on CPU); rank 0 prints a progress bar, a per-iteration table,
the mean reward of the first and last 5 iterations, and writes PNG plots and a JSON log to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

LEARN_WINDOW = 5
"""Iterations averaged at each end for the learning check, which runs when the two windows do not overlap."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridmem demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=30,
                   help="GRPO iterations (default 30; from 10 on, the run fails if the last 5 do not beat the first 5)")
    p.add_argument("--world-size", type=int, default=2, help="processes (default 2)")
    p.add_argument("--train-tp", type=int, default=2, help="training tensor-parallel size (rest is data parallel)")
    p.add_argument("--infer-tp", type=int, default=1, help="inference tensor-parallel size (rest are replicas)")
    p.add_argument("--trainer", choices=("torch", "megatron"), default="torch")
    p.add_argument("--engine", choices=("reference", "vllm"), default="reference",
                   help="rollout engine: the embedded one (default) or a real vLLM, co-located in each process "
                        "(--infer-tp 1 or the world size; its policy has head_dim 32; the workers run with "
                        "VLLM_ENABLE_V1_MULTIPROCESSING=0 and one core per vLLM worker)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify", action="store_true", help="checksum every weight sync")
    p.add_argument("--out", default="hybridmem-demo", help="directory for plots and the JSON log")
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, cfg, out: str) -> None:
    import warnings

    import torch
    import torch.distributed as dist

    # megatron-core warns at import about optional packages (Apex, Transformer Engine) the demo does not use.
    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
    torch.set_num_threads(1)
    if cfg.engine == "vllm":
        from hybridmem.examples.grpo.engines import vllm_env

        for key, value in vllm_env(rank, world, cfg.hybrid.infer_layout.tp, port).items():
            os.environ.setdefault(key, value)
    backend = "nccl" if cfg.hybrid.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    try:
        if rank == 0:
            from hybridmem.examples.grpo.report import RankZeroReporter

            reporter = RankZeroReporter(cfg, Path(out))
            from hybridmem.examples.grpo.loop import run_rank

            stats = run_rank(cfg, on_iteration=reporter.on_iteration)
            reporter.finish(stats)
        else:
            from hybridmem.examples.grpo.loop import run_rank

            run_rank(cfg)
    finally:
        if dist.is_initialized():  # vLLM's shutdown destroys it itself
            dist.destroy_process_group()


def _vllm_model():
    from hybridmem.examples.grpo.engines import VLLM_MODEL

    return VLLM_MODEL


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments and run the demo in ``--world-size`` spawned processes."""
    args = _parser().parse_args(argv)
    import torch.multiprocessing as mp

    from hybridmem import HybridConfig
    from hybridmem.examples.grpo.algo import GRPOConfig
    from hybridmem.examples.grpo.loop import DemoConfig

    hybrid = HybridConfig(
        device=args.device,
        tensor_model_parallel_size=args.train_tp,
        infer_tensor_parallel_size=args.infer_tp,
        verify_weight_sync=args.verify,
    )
    for side, layout in (("--train-tp", hybrid.train_layout), ("--infer-tp", hybrid.infer_layout)):
        layout.data_parallel_size(args.world_size)  # ValueError naming the numbers
    cfg = DemoConfig(
        iters=args.iters,
        num_prompts=args.num_prompts,
        grpo=GRPOConfig(group_size=args.group_size, lr=args.lr),
        hybrid=hybrid,
        seed=args.seed,
        trainer=args.trainer,
        engine=args.engine,
        **({"model": _vllm_model()} if args.engine == "vllm" else {}),
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(args.world_size, _free_port(), cfg, args.out), nprocs=args.world_size, join=True)
    summary = json.loads((Path(args.out) / "grpo.json").read_text())
    first, last = summary["first5_reward"], summary["last5_reward"]
    if args.iters >= 2 * LEARN_WINDOW and not last > first:
        raise SystemExit(f"the policy did not learn: mean reward of the last 5 iterations {last:.3f} <= first 5 {first:.3f}")
