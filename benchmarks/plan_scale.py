"""Plan scale: time and host memory of building one rank's resharding plan, against the world size.

Each case builds, in a fresh subprocess per rank, ``build_plan(megatron_layout(...), vllm_layout(...),
rank=r)`` (what each rank of a job computes before its first switch: its own sends, receives and copies)
for a DeepSeek-V3- or Qwen3-235B-A22B-shaped spec (bf16, vLLM 0.33's layout) and reports the wall time
of the call and the growth of the process's peak RSS during it (``ru_maxrss`` after the call minus
before; the interpreter with torch imported holds ~300 MiB before any plan), for the first, a middle and
the last rank (the table shows the largest). Next to it, where ``--whole-max-world`` allows and
``--limit-s`` is not exceeded, the whole plan (``rank=None``: every rank's transfers, what every rank
computed before per-rank plans).

    python benchmarks/plan_scale.py                        # every case, whole plans up to world 256
    python benchmarks/plan_scale.py --max-world 1024 --whole-max-world 1024 --limit-s 900
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

from rich.console import Console
from rich.table import Table

DEEPSEEK_V3 = dict(model_type="deepseek_v3", hidden_size=7168, num_attention_heads=128,
                   num_key_value_heads=128, intermediate_size=18432, num_hidden_layers=61, vocab_size=129280,
                   n_routed_experts=256, n_shared_experts=1, moe_intermediate_size=2048,
                   first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, topk_method="noaux_tc", tie_word_embeddings=False)
QWEN3_235B = dict(model_type="qwen3_moe", hidden_size=4096, num_attention_heads=64, num_key_value_heads=4,
                  head_dim=128, intermediate_size=12288, num_hidden_layers=94, vocab_size=151936,
                  num_experts=128, moe_intermediate_size=1536, tie_word_embeddings=False)
MODELS = {"DeepSeek-V3": DEEPSEEK_V3, "Qwen3-235B-A22B": QWEN3_235B}
CASES = [  # (model, train tp/pp/ep, infer tp/pp/ep, world)
    ("DeepSeek-V3", (2, 1, 8), (8, 1, 16), 16),
    ("DeepSeek-V3", (2, 1, 32), (8, 1, 64), 64),
    ("DeepSeek-V3", (2, 1, 128), (8, 1, 256), 256),
    ("DeepSeek-V3", (4, 1, 256), (8, 1, 256), 1024),
    ("DeepSeek-V3", (8, 1, 256), (8, 1, 256), 4096),
    ("Qwen3-235B-A22B", (4, 1, 2), (4, 1, 8), 8),
    ("Qwen3-235B-A22B", (4, 2, 4), (4, 1, 32), 32),
    ("Qwen3-235B-A22B", (4, 2, 32), (4, 1, 128), 256),
    ("Qwen3-235B-A22B", (4, 2, 128), (4, 1, 128), 1024),
]

_CHILD = """
import json, resource, sys, time
from hybridmem.config import ParallelLayout
from hybridmem.reshard import ModelSpec, build_plan, megatron_layout, vllm_layout
config, train, infer, world, rank = json.loads(sys.argv[1])
spec = ModelSpec.from_hf_config(config)
layout = lambda tp, pp, ep: ParallelLayout(tp=tp, pp=pp, ep=ep)  # noqa: E731
src, dst = (megatron_layout(spec, layout(*train), world),
            vllm_layout(spec, layout(*infer), world, vllm_version="0.33"))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
plan = build_plan(src, dst, rank=rank)
seconds = time.perf_counter() - start
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ranks = range(world) if rank is None else (rank,)
print(json.dumps({"seconds": seconds, "rss_growth_mib": (after - before) / 1024, "peak_rss_mib": after / 1024,
                  "steps": len(plan.buckets), "send": max(plan.send_nbytes(r) for r in ranks),
                  "recv": max(plan.recv_nbytes(r) for r in ranks)}))
"""


def run_case(model: str, train: tuple[int, int, int], infer: tuple[int, int, int], world: int,
             rank: int | None, limit_s: float) -> dict:
    """One plan in a fresh interpreter; ``{"seconds", "rss_growth_mib", ...}`` or ``{"timeout": limit_s}``."""
    arg = json.dumps([MODELS[model], list(train), list(infer), world, rank])
    try:
        out = subprocess.run([sys.executable, "-c", _CHILD, arg], capture_output=True, text=True,
                             timeout=limit_s, check=True)
    except subprocess.TimeoutExpired:
        return {"timeout": limit_s}
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(
            f"{model} {train} -> {infer} at world {world} failed:\n{exc.stderr[-2000:]}") from None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-world", type=int, default=4096, help="skip cases of a larger world")
    parser.add_argument("--whole-max-world", type=int, default=256,
                        help="build the whole plan up to this world")
    parser.add_argument("--limit-s", type=float, default=600.0,
                        help="stop a whole plan after this many seconds")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    console = Console(width=140)
    console.print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cpus, python "
                  f"{platform.python_version()}")
    table = Table(title="resharding plan of one rank (largest of ranks 0, world/2+1, world-1) and "
                        "the whole plan")
    for col in ("model", "train tp/pp/ep", "infer tp/pp/ep", "world", "rank plan s", "RSS growth MiB",
                "steps", "send GiB", "recv GiB", "whole plan s", "whole peak RSS MiB"):
        table.add_column(col, justify="left" if col == "model" else "right")
    figures = []
    gib = 2**30
    for model, train, infer, world in CASES:
        if world > args.max_world:
            continue
        shares = [run_case(model, train, infer, world, r, args.limit_s)
                  for r in sorted({0, world // 2 + 1, world - 1})]
        whole = (run_case(model, train, infer, world, None, args.limit_s) if world <= args.whole_max_world
                 else {"skipped": True})
        figures.append({"model": model, "train": train, "infer": infer, "world": world, "shares": shares,
                        "whole": whole})
        worst = max(shares, key=lambda f: f["seconds"])
        whole_s = (f"> {args.limit_s:.0f}" if "timeout" in whole else "" if "skipped" in whole
                   else f"{whole['seconds']:.1f}")
        whole_rss = f"{whole['peak_rss_mib']:.0f}" if "seconds" in whole else ""
        fmt = "/".join
        table.add_row(model, fmt(map(str, train)), fmt(map(str, infer)), str(world),
                      f"{worst['seconds']:.2f}", f"{max(f['rss_growth_mib'] for f in shares):.0f}",
                      str(max(f["steps"] for f in shares)), f"{max(f['send'] for f in shares) / gib:.1f}",
                      f"{max(f['recv'] for f in shares) / gib:.1f}", whole_s, whole_rss)
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
