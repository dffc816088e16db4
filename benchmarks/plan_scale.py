"""Plan scale: time and peak host memory of building the resharding plan, against the world size.

Each case builds ``build_plan(megatron_layout(...), vllm_layout(...))`` for a DeepSeek-V3- or
Qwen3-235B-A22B-shaped spec (bf16, the vLLM layout of the release the layouts default to) in a fresh
subprocess, which reports its wall time and peak RSS (``ru_maxrss``); a case past ``--limit-s`` is
stopped and shown as such. Today every rank builds the whole cluster's plan before its first switch, so
these are per-rank figures of that first switch.

    python benchmarks/plan_scale.py                      # every case up to world 256
    python benchmarks/plan_scale.py --max-world 1024 --limit-s 900
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys

from rich.console import Console
from rich.table import Table

DEEPSEEK_V3 = dict(model_type="deepseek_v3", hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                   intermediate_size=18432, num_hidden_layers=61, vocab_size=129280, n_routed_experts=256,
                   n_shared_experts=1, moe_intermediate_size=2048, first_k_dense_replace=3, q_lora_rank=1536,
                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   topk_method="noaux_tc", tie_word_embeddings=False)
QWEN3_235B = dict(model_type="qwen3_moe", hidden_size=4096, num_attention_heads=64, num_key_value_heads=4,
                  head_dim=128, intermediate_size=12288, num_hidden_layers=94, vocab_size=151936, num_experts=128,
                  moe_intermediate_size=1536, tie_word_embeddings=False)
MODELS = {"DeepSeek-V3": DEEPSEEK_V3, "Qwen3-235B-A22B": QWEN3_235B}
CASES = [  # (model, train tp/pp/ep, infer tp/pp/ep, world)
    ("DeepSeek-V3", (2, 1, 8), (8, 1, 16), 16),
    ("DeepSeek-V3", (2, 1, 32), (8, 1, 64), 64),
    ("DeepSeek-V3", (2, 1, 128), (8, 1, 256), 256),
    ("DeepSeek-V3", (4, 1, 256), (8, 1, 256), 1024),
    ("Qwen3-235B-A22B", (4, 1, 2), (4, 1, 8), 8),
    ("Qwen3-235B-A22B", (4, 2, 4), (4, 1, 32), 32),
]

_CHILD = """
import json, resource, sys, time
from hybridmem.config import ParallelLayout
from hybridmem.reshard import ModelSpec, build_plan, megatron_layout, vllm_layout
config, train, infer, world = json.loads(sys.argv[1])
spec = ModelSpec.from_hf_config(config)
start = time.perf_counter()
layout = lambda tp, pp, ep: ParallelLayout(tp=tp, pp=pp, ep=ep)  # noqa: E731
plan = build_plan(megatron_layout(spec, layout(*train), world), vllm_layout(spec, layout(*infer), world))
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "buckets": len(plan.buckets), "max_recv_bytes": max(plan.recv_nbytes(r) for r in range(world))}))
"""


def run_case(model: str, train: tuple[int, int, int], infer: tuple[int, int, int], world: int,
             limit_s: float) -> dict:
    """One case in a fresh interpreter; ``{"seconds", "peak_rss_mib", ...}`` or ``{"timeout": limit_s}``."""
    arg = json.dumps([MODELS[model], list(train), list(infer), world])
    try:
        out = subprocess.run([sys.executable, "-c", _CHILD, arg], capture_output=True, text=True, timeout=limit_s,
                             check=True)
    except subprocess.TimeoutExpired:
        return {"timeout": limit_s}
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{model} {train} -> {infer} at world {world} failed:\n{exc.stderr[-2000:]}") from None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-world", type=int, default=256, help="skip cases of a larger world")
    parser.add_argument("--limit-s", type=float, default=600.0, help="stop a case after this many seconds")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    console = Console(width=120)
    console.print(f"machine: {platform.node()} {platform.machine()}, python {platform.python_version()}")
    table = Table(title="resharding plan: build time and peak RSS of one rank (global plan)")
    for col in ("model", "train tp/pp/ep", "infer tp/pp/ep", "world", "plan s", "peak RSS MiB", "buckets"):
        table.add_column(col, justify="left" if col == "model" else "right")
    figures = []
    for model, train, infer, world in CASES:
        if world > args.max_world:
            continue
        fig = run_case(model, train, infer, world, args.limit_s)
        figures.append({"model": model, "train": train, "infer": infer, "world": world, **fig})
        fmt = "/".join
        if "timeout" in fig:
            table.add_row(model, fmt(map(str, train)), fmt(map(str, infer)), str(world), f"> {args.limit_s:.0f}", "", "")
        else:
            table.add_row(model, fmt(map(str, train)), fmt(map(str, infer)), str(world), f"{fig['seconds']:.1f}",
                          f"{fig['peak_rss_mib']:.0f}", str(fig["buckets"]))
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
