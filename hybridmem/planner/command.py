"""``hybridmem plan``: both switches of a cluster predicted from a model config and two layouts.

    hybridmem plan path/to/config.json --world 8 --train fsdp2 --infer 2/1/1 --accelerator h100
    hybridmem plan deepseek_v3.json --world 256 --train 4/8/8 --train-stages 7,7,8,8,8,8,8,7 \\
        --infer 8/1/32 --accelerator h100 --json plan.json --plot plan.png

    hybridmem plan path/to/config.json --world 1 --lora-rank 16 --accelerator h100

Prints, for the rank with the highest predicted peak, every step of TRAIN->INFER and INFER->TRAIN (bytes
allocated, freed, transient, moved over the host link and the network, peak, time), the host memory of
the fullest node, whether both fit, and, when they do not, which knob would make them fit. See [Note:
cluster plan] in :mod:`hybridmem.planner.cluster` and [Note: host plan] in :mod:`hybridmem.planner.host`. With
``--lora-rank`` (one device): what each place of a LoRA model's base holds and moves per switch, beside the
sync of merged weights ([Note: lora plan] in :mod:`hybridmem.planner.lora`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import replace

from hybridmem.config import ParallelLayout
from hybridmem.config.arguments import OneLineErrorParser
from hybridmem.contract.buckets import MIN_BUCKET_NBYTES
from hybridmem.contract.kinds import StateKind
from hybridmem.errors import did_you_mean_path
from hybridmem.planner.cluster import (
    ACCELERATORS,
    GB,
    ClusterPlan,
    TrainingSetup,
    hf_buffer_nbytes,
    plan_cluster,
)
from hybridmem.planner.host import HOST_SOURCES, SLEEP_LEVELS
from hybridmem.planner.lora import LoraRoutePlan, LoraSetup, plan_lora, to_dicts
from hybridmem.reshard import ModelSpec, vllm_stage_layers
from hybridmem.reshard.fp8 import FP8_FAMILIES

__all__ = ["main", "build_parser"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
KINDS = {"param": StateKind.PARAM, "grad": StateKind.GRAD, "optimizer": StateKind.OPTIMIZER}


def _layout(text: str, what: str) -> ParallelLayout:
    try:
        tp, pp, ep = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"{what}={text!r}: expected tp/pp/ep, e.g. 4/1/1") from None
    return ParallelLayout(tp=tp, pp=pp, ep=ep)


def build_parser() -> OneLineErrorParser:
    p = OneLineErrorParser(prog="hybridmem plan", description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="a HF config.json (or the directory holding it)")
    p.add_argument("--family", help="instead of a config: a model_type (qwen2, deepseek_v3, ...) with --set")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config field (with --family)")
    p.add_argument("--world", type=int, required=True, help="ranks (devices) in the job")
    p.add_argument("--train", default="1/1/1",
                   help="training layout: Megatron tp/pp/ep, or 'fsdp2' (default 1/1/1)")
    p.add_argument("--train-stages",
                   help="Megatron layers per pipeline stage, first to last (e.g. 7,7,8,8,8,8,8,7)")
    p.add_argument("--infer", default="1/1/1", help="inference (vLLM) layout tp/pp/ep (default 1/1/1)")
    p.add_argument("--accelerator", default="h100", choices=sorted(ACCELERATORS),
                   help="the preset of device memory, bandwidths, devices and host memory per node "
                        "(default h100; each figure can be overridden below)")
    p.add_argument("--device-memory-gb", type=float, help="override the accelerator's memory (10^9 bytes)")
    p.add_argument("--host-link-gbps", type=float, help="override host<->device bandwidth (GB/s)")
    p.add_argument("--intra-node-gbps", type=float,
                   help="override device<->device bandwidth within a node (GB/s)")
    p.add_argument("--inter-node-gbps", type=float,
                   help="override device<->device bandwidth across nodes (GB/s)")
    p.add_argument("--devices-per-node", type=int, help="override devices per node (sharing its host memory)")
    p.add_argument("--devices-per-nvlink-domain", type=int,
                   help="override devices reached over NVLink (default: the node's; 72 for gb200/gb300)")
    p.add_argument("--device-copy-gbps", type=float, help="override device-local copy bandwidth (GB/s)")
    p.add_argument("--host-memory-gb", type=float, help="override host memory per node (10^9 bytes)")
    p.add_argument("--no-pinned-rounding", action="store_true",
                   help="pinned arenas take their size, not the next power of two "
                        "(torch's pinned_max_round_threshold_mb)")
    p.add_argument("--param-dtype", default="bf16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--grad-dtype", default=None, choices=sorted(DTYPE_BYTES),
                   help="default: fp32 for Megatron (main grads), the param dtype for fsdp2")
    p.add_argument("--infer-dtype", default="bf16", choices=sorted(DTYPE_BYTES),
                   help="the engine's weights (default bf16); fp8: vLLM's block FP8, one byte a quantized "
                        "weight element and four a 128x128 block's scale, the rest in --param-dtype; whole "
                        "blocks move quantized, into the engine's shards (--engine-process) or its stage's "
                        "full tensors (vLLM in the trainer's process) (families "
                        f"{', '.join(FP8_FAMILIES)})")
    p.add_argument("--optimizer-bytes-per-param", type=int, default=12,
                   help="Megatron (default 12: fp32 Adam)")
    p.add_argument("--no-distributed-optimizer", action="store_true",
                   help="Megatron optimizer state not sharded")
    p.add_argument("--offload", default="param,grad,optimizer",
                   help="kinds offloaded on TRAIN->INFER, comma-separated, or 'none' (default all three)")
    p.add_argument("--kv-cache-gb", type=float, help="KV cache per rank (default: utilization rule)")
    p.add_argument("--kv-cache-bytes", type=int, help="KV cache per rank in bytes")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="vLLM's rule for the KV cache")
    p.add_argument("--bucket-mib", type=float, default=512, help="resharding bucket (reshard_bucket_bytes)")
    p.add_argument("--sleep-level", type=int, default=2, choices=SLEEP_LEVELS,
                   help="the engine's sleep: 1 keeps its weights in host memory, 2 (default) discards them")
    p.add_argument("--engine-process", action="store_true",
                   help="the engine runs in its own process (vLLM's AsyncLLM or vllm serve) with hybridmem's "
                        "bucket transport: its 2 transfer buckets stay on every rank's device (GPU only)")
    p.add_argument("--engine-bucket-mib", type=float,
                   help="bytes per transfer bucket with --engine-process, MiB (default: the engine's own "
                        "rule, a sixteenth of the device's free memory, 1 MiB to 1 GiB)")
    p.add_argument("--train-host-gb", type=float, default=0.0,
                   help="the training framework's own host buffers per rank (default 0: none known)")
    p.add_argument("--lora-rank", type=int,
                   help="plan a LoRA model of this rank on one device (--world 1): each place its base can "
                        "stay (HybridConfig.lora_base) beside the merged sync")
    p.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                   help="the adapters' target modules, comma-separated (default: attention and MLP)")
    p.add_argument("--lora-dtype", default="fp32", choices=sorted(DTYPE_BYTES),
                   help="the adapters' dtype in the trainer (default fp32, as PEFT keeps them)")
    p.add_argument("--ranks", default="4",
                   help="how many ranks to plan (those with the most bytes), or 'all'")
    p.add_argument("--json", help="write every figure to this file ('-': standard output, no table)")
    p.add_argument("--plot", help="draw the worst rank's memory per step to this image file")
    return p


def _config(args) -> dict:
    if args.family:
        config = {"model_type": args.family}
        for item in args.set:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--set {item!r}: expected KEY=VALUE")
            config[key] = json.loads(value) if value not in ("", "None") else None
        return config
    if not args.model:
        raise ValueError("give a config.json (or its directory), or --family with --set KEY=VALUE")
    path = os.path.join(args.model, "config.json") if os.path.isdir(args.model) else args.model
    if not os.path.isfile(path):
        hint = did_you_mean_path(args.model)
        missing = (f"no config.json in the directory {args.model!r}" if os.path.isdir(args.model) else
                   f"no such file or directory {args.model!r}" + (f" ({hint})" if hint else ""))
        raise ValueError(f"{missing}: hybridmem plan reads a model's Hugging Face config.json (or its "
                         "directory); give that, or --family with --set KEY=VALUE")
    with open(path) as f:
        text = f.read()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc.msg} at line {exc.lineno}){_looks_like(path, text)}: "
                         "hybridmem plan reads a model's Hugging Face config.json (or its directory); give "
                         "that, or --family with --set KEY=VALUE, and the layouts as options (--world, "
                         "--train, --infer)") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object: hybridmem plan reads "
                         "a model's Hugging Face config.json (or its directory)")
    return config


def _looks_like(path: str, text: str) -> str:
    """``"; it looks like YAML (a job config?)"`` for a YAML file, else ``""``."""
    first = next((line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")),
                 "")
    json_like = first.lstrip().startswith(("{", "["))
    if path.endswith((".yaml", ".yml")) or not json_like and (first.rstrip().endswith(":") or ": " in first):
        return "; it looks like YAML (a job config?)"
    return ""


def _stages(text: str | None, pp: int, num_layers: int, train: str) -> tuple[int, ...] | None:
    """``--train-stages`` as layer counts, checked against ``--train``'s pp and the model's layers, in the
    command line's words (the layouts' own checks name the Python API's)."""
    example = ",".join(map(str, vllm_stage_layers(num_layers, pp))) if num_layers >= pp else None
    hint = f" (e.g. --train-stages {example})" if example else ""
    if text is None:
        if num_layers % pp:
            raise ValueError(f"--train {train}: pp={pp} does not divide the model's {num_layers} layers; "
                             "give each pipeline stage's layer count, first to last, with "
                             f"--train-stages{hint}")
        return None
    try:
        stages = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--train-stages {text!r}: expected comma-separated layer counts{hint}") from None
    if len(stages) != pp or sum(stages) != num_layers or min(stages) < 1:
        raise ValueError(f"--train-stages {text}: expected pp={pp} positive layer counts (--train {train}) "
                         f"summing to the model's {num_layers} layers{hint}")
    return stages


def plan_from_args(args) -> ClusterPlan:
    """The :class:`ClusterPlan` the command line asks for.

    Raises:
        ValueError: A bad option (named).
    """
    config = _config(args)
    spec = ModelSpec.from_hf_config(config)
    fp8 = args.infer_dtype == "fp8"
    if fp8:
        _check_fp8(spec, args)
    accel = ACCELERATORS[args.accelerator]
    overrides = {"memory_nbytes": args.device_memory_gb and int(args.device_memory_gb * GB),
                 "host_link_bps": args.host_link_gbps and args.host_link_gbps * GB,
                 "intra_node_bps": args.intra_node_gbps and args.intra_node_gbps * GB,
                 "inter_node_bps": args.inter_node_gbps and args.inter_node_gbps * GB,
                 "devices_per_node": args.devices_per_node,
                 "devices_per_nvlink_domain": args.devices_per_nvlink_domain,
                 "device_copy_bps": args.device_copy_gbps and args.device_copy_gbps * GB,
                 "host_memory_nbytes": args.host_memory_gb and int(args.host_memory_gb * GB),
                 "pinned_rounds_up": False if args.no_pinned_rounding else None}
    if (args.devices_per_node is not None and args.devices_per_nvlink_domain is None
            and accel.devices_per_nvlink_domain):
        overrides["devices_per_nvlink_domain"] = max(accel.devices_per_nvlink_domain, args.devices_per_node)
    accel = replace(accel, **{k: v for k, v in overrides.items() if v is not None})
    if args.train_host_gb < 0:
        raise ValueError(f"--train-host-gb {args.train_host_gb} must be >= 0")
    host_buffers = int(args.train_host_gb * GB)
    param = DTYPE_BYTES[args.param_dtype]
    if args.train == "fsdp2":
        if args.train_stages:
            raise ValueError("--train-stages is for a Megatron training layout, not fsdp2")
        setup = TrainingSetup(kind="fsdp2", param_bytes=param,
                              grad_bytes=DTYPE_BYTES[args.grad_dtype or args.param_dtype],
                              buffer_nbytes=hf_buffer_nbytes(config, param), host_buffer_nbytes=host_buffers)
    else:
        parallel = _layout(args.train, "--train")
        stages = _stages(args.train_stages, parallel.pp, spec.num_hidden_layers, args.train)
        setup = TrainingSetup(kind="megatron", parallel=parallel, stage_layers=stages,
                              param_bytes=param, grad_bytes=DTYPE_BYTES[args.grad_dtype or "fp32"],
                              optimizer_bytes_per_param=args.optimizer_bytes_per_param,
                              distributed_optimizer=not args.no_distributed_optimizer,
                              host_buffer_nbytes=host_buffers)
    names = [] if args.offload == "none" else [n.strip() for n in args.offload.split(",") if n.strip()]
    unknown = [n for n in names if n not in KINDS]
    if unknown:
        raise ValueError(f"--offload {args.offload!r}: unknown {unknown}; expected some of {sorted(KINDS)} "
                         "or 'none'")
    if args.kv_cache_gb is not None and args.kv_cache_bytes is not None:
        raise ValueError("give at most one of --kv-cache-gb and --kv-cache-bytes")
    kv = args.kv_cache_bytes if args.kv_cache_bytes is not None else (
        int(args.kv_cache_gb * GB) if args.kv_cache_gb is not None else None)
    ranks = args.world if args.ranks == "all" else int(args.ranks)
    if args.engine_process and accel.device_type != "cuda":
        raise ValueError(f"--engine-process with --accelerator {args.accelerator} ({accel.device_type}): an "
                         "engine in its own process moves weights through CUDA IPC only; an NPU engine runs "
                         "in the trainer's process")
    engine_bucket = None
    if args.engine_bucket_mib is not None:
        if not args.engine_process:
            raise ValueError(f"--engine-bucket-mib {args.engine_bucket_mib:g} is for --engine-process")
        engine_bucket = int(args.engine_bucket_mib * 2**20)
        if engine_bucket < MIN_BUCKET_NBYTES:
            raise ValueError(f"--engine-bucket-mib {args.engine_bucket_mib:g}: a bucket takes at least "
                             f"{MIN_BUCKET_NBYTES} bytes (one page)")
    return plan_cluster(spec, setup, _layout(args.infer, "--infer"), args.world, accel=accel,
                        offload={k: k.value in names for k in KINDS.values()}, kv_nbytes=kv,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        infer_bytes=param if fp8 else DTYPE_BYTES[args.infer_dtype],
                        bucket_nbytes=int(args.bucket_mib * 2**20), sleep_level=args.sleep_level, ranks=ranks,
                        engine_process=args.engine_process, engine_bucket_nbytes=engine_bucket,
                        infer_fp8=fp8)


def _check_fp8(spec: ModelSpec, args) -> None:
    """``--infer-dtype fp8`` with a family that has an FP8 layout and a parameter dtype the quantizer takes,
    in the command line's words."""
    if spec.family not in FP8_FAMILIES or spec.multimodal:
        raise ValueError(f"--infer-dtype fp8: family={spec.family!r} has no FP8 layout (vLLM's block FP8, "
                         f"128x128 scales); the families with one are {', '.join(FP8_FAMILIES)}")
    if args.param_dtype == "fp8":
        raise ValueError("--infer-dtype fp8 with --param-dtype fp8: the engine's FP8 weights are quantized "
                         "from the training weights, which must be bf16, fp16 or fp32")


def lora_plan_from_args(args) -> list[LoraRoutePlan]:
    """The LoRA routes' figures the command line asks for (``--lora-rank``, one device).

    Raises:
        ValueError: A bad option (named), or a layout other than one device.
    """
    if args.engine_process or args.engine_bucket_mib is not None:
        raise ValueError("--engine-process is planned without --lora-rank (a LoRA plan keeps its engine in "
                         "the trainer's process)")
    if args.infer_dtype == "fp8":
        raise ValueError("--infer-dtype fp8 is planned without --lora-rank (a LoRA plan's engine holds its "
                         "base unquantized)")
    if args.world != 1 or args.infer != "1/1/1" or args.train not in ("1/1/1", "fsdp2"):
        raise ValueError("--lora-rank plans one device: give --world 1 --infer 1/1/1 (got --world "
                         f"{args.world} --train {args.train} --infer {args.infer})")
    config = _config(args)
    spec = ModelSpec.from_hf_config(config)
    accel = ACCELERATORS[args.accelerator]
    device = int(args.device_memory_gb * GB) if args.device_memory_gb else accel.memory_nbytes
    lora = LoraSetup(rank=args.lora_rank,
                     targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()),
                     adapter_bytes=DTYPE_BYTES[args.lora_dtype])
    param, infer = DTYPE_BYTES[args.param_dtype], DTYPE_BYTES[args.infer_dtype]
    if args.kv_cache_gb is not None and args.kv_cache_bytes is not None:
        raise ValueError("give at most one of --kv-cache-gb and --kv-cache-bytes")
    kv = args.kv_cache_bytes if args.kv_cache_bytes is not None else (
        int(args.kv_cache_gb * GB) if args.kv_cache_gb is not None else None)
    if kv is None:  # vLLM's rule for the engine alone: its share of the device less its weights
        merged = plan_lora(spec, lora, param_bytes=param, infer_bytes=infer, device_nbytes=device,
                           kv_nbytes=0)[0]
        kv = max(0, int(args.gpu_memory_utilization * device) - merged.infer_nbytes)
    return plan_lora(spec, lora, param_bytes=param, infer_bytes=infer, device_nbytes=device, kv_nbytes=kv,
                     sleep_level=args.sleep_level, buffer_nbytes=hf_buffer_nbytes(config, param))


def _print_lora(plans: list[LoraRoutePlan], args) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    table = Table(title=f"LoRA rank {args.lora_rank} on one {args.accelerator} ({args.lora_targets}); engine "
                        f"sleep level {args.sleep_level} for engine_sleeps; vLLM's sleep mode keeps the KV "
                        "cache in TRAIN beside a resident or shared base")
    for col in ("route (lora_base)", "TRAIN GB", "INFER GB", "KV room GB", "host link GB/switch pair",
                "written into engine GB/switch", "fits"):
        table.add_column(col, justify="left" if col.startswith("route") else "right")
    for p in plans:
        table.add_row(p.route, *(f"{x / GB:.3f}" for x in (p.train_nbytes, p.infer_nbytes, p.kv_room_nbytes,
                                                          p.host_link_nbytes, p.engine_write_nbytes)),
                      "yes" if p.fits else "[red]NO[/red]")
    Console(width=150).print(table)


def _print(plan: ClusterPlan, args) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console(width=150)
    worst = plan.worst
    a = plan.accelerator
    console.print(f"{args.world} x {a.name} ({a.memory_nbytes / GB:.0f} GB, host link "
                  f"{a.host_link_bps / GB:.0f} GB/s, NVLink {a.intra_node_bps / GB:.0f} GB/s, network "
                  f"{a.inter_node_bps / GB:.0f} GB/s, {a.devices_per_node}/node with "
                  f"{a.host_memory_nbytes / GB:.0f} GB host memory); train {args.train}, infer {args.infer}, "
                  f"engine sleep level {plan.sleep_level}{_engine_text(args)}; planned ranks "
                  f"{[p.rank for p in plan.ranks]}")
    state = ", ".join(f"{k} {v / GB:.2f}" for k, v in worst.state_nbytes.items())
    console.print(f"worst rank {worst.rank} (GB): {state}")
    for direction, steps in (("TRAIN->INFER", worst.to_infer), ("INFER->TRAIN", worst.to_train)):
        table = Table(title=f"{direction}, rank {worst.rank}: {sum(s.seconds for s in steps):.2f} s")
        for col in ("step", "+alloc GB", "-free GB", "+transient GB", "host link GB", "network GB", "peak GB",
                    "after GB", "seconds"):
            table.add_column(col, justify="left" if col == "step" else "right")
        for s in steps:
            over = s.peak_nbytes > plan.budget_nbytes
            table.add_row(s.name,
                          *(f"{x / GB:.2f}" for x in (s.alloc_nbytes, s.free_nbytes, s.transient_nbytes,
                                                      s.host_link_nbytes, s.network_nbytes)),
                          f"[red]{s.peak_nbytes / GB:.2f}[/red]" if over else f"{s.peak_nbytes / GB:.2f}",
                          f"{s.after_nbytes / GB:.2f}", f"{s.seconds:.3f}")
        console.print(table)
    slowest = max(plan.ranks, key=lambda p: sum(p.seconds.values()))
    console.print(f"slowest planned rank {slowest.rank}: TRAIN->INFER {slowest.seconds['to_infer']:.2f} s, "
                  f"INFER->TRAIN {slowest.seconds['to_train']:.2f} s")
    node = plan.worst_node
    sources = ", ".join(f"{k} {node.nbytes[k] / GB:.1f}" for k in HOST_SOURCES)
    rounding = "each rounded up to a power of two" if a.pinned_rounds_up else "at their size"
    console.print(f"host per node (GB), node {node.node} (ranks {node.ranks[0]}-{node.ranks[-1]}): {sources}")
    console.print(f"  pinned arenas {rounding}; the training framework's own host buffers: "
                  f"{'as given' if args.train_host_gb else 'none known (0)'}")
    device = "fits" if plan.device_fits else "DOES NOT FIT"
    host = "fits" if plan.host_fits else "DOES NOT FIT"
    console.print(f"peak {worst.peak_nbytes / GB:.2f} GB of {plan.budget_nbytes / GB:.2f} GB per device: "
                  f"{device}; host peak {node.peak_nbytes / GB:.1f} GB of {plan.host_budget_nbytes / GB:.1f} "
                  f"GB per node: {host}")
    for advice in plan.advice:
        how = (f" ({' '.join(advice.options)}): peak {advice.peak_nbytes / GB:.2f} GB" if advice.options
               else "")
        if advice.options and advice.host_peak_nbytes is not None:
            how += f", host {advice.host_peak_nbytes / GB:.1f} GB per node"
        console.print(f"  would fit with: {advice.knob}{how}")


def _engine_text(args) -> str:
    if not args.engine_process:
        return ""
    size = (f"{args.engine_bucket_mib:g} MiB" if args.engine_bucket_mib is not None
            else "the engine's default size")
    return f", engine in its own process (2 buckets of {size} per rank)"


def _plot(plan: ClusterPlan, path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    worst = plan.worst
    steps = [*worst.to_infer, *worst.to_train]
    fig, ax = plt.subplots(figsize=(max(8, len(steps) * 0.8), 4.5))
    xs = range(len(steps))
    ax.bar(xs, [s.peak_nbytes / GB for s in steps], color="tab:orange", label="peak in step")
    ax.bar(xs, [s.after_nbytes / GB for s in steps], color="tab:blue", label="after step")
    ax.axhline(plan.budget_nbytes / GB, color="tab:red", linestyle="--", label="device memory")
    ax.axvline(len(worst.to_infer) - 0.5, color="grey", linewidth=0.8)
    ax.set_xticks(list(xs), [s.name for s in steps], rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("GB")
    ax.set_title(f"rank {worst.rank}: TRAIN->INFER | INFER->TRAIN")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _write_json(data: object, where: str | None) -> None:
    """``--json``: ``data`` to that file, or to standard output for ``-``; nothing without the option."""
    if not where:
        return
    text = json.dumps(data, indent=1)
    if where == "-":
        print(text)
    else:
        with open(where, "w") as f:
            f.write(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.lora_rank is not None:
        return _lora_main(parser, args)
    try:
        plan = plan_from_args(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    _write_json(plan.to_dict(), args.json)
    if args.json != "-":
        _print(plan, args)
    if args.plot:
        _plot(plan, args.plot)
    return 0 if plan.fits else 1


def _lora_main(parser: OneLineErrorParser, args) -> int:
    try:
        plans = lora_plan_from_args(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    _write_json(to_dicts(plans), args.json)
    if args.json != "-":
        _print_lora(plans, args)
    return 0 if any(p.fits for p in plans) else 1
