"""FP8 sync benchmark: what a bf16 Megatron trainer moves into an engine serving vLLM's block FP8, per rank,
beside the same sync into a bf16 engine.

Every rank runs two ``ReshardSync`` syncs of the same bf16 Megatron shards over gloo (spawned processes,
``hybridmem.testing.workers.WorkerPool``): one into a stand-in engine that reports FP8 with 128x128 blocks
(``quantization_config``) and takes its vLLM layout as a stream, one into a stand-in bf16 engine. The
stand-ins only count what they are handed. Printed per rank: the bytes received from the other ranks
(FP8: quantized cells as e4m3 bytes and float32 block scales, [Note: quantized cells] in
:mod:`hybridmem.reshard.plan`; bf16: two bytes an element), the fewest the plan could receive
(``min_received_nbytes``), the bytes handed to the engine (its shard: FP8 one byte a quantized element and
four a scale) and the seconds of the sync (best of ``--repeats``). The FP8 figures are compared with the
engine layout's own byte count, computed from its shapes alone.

Example::

    python benchmarks/fp8_sync.py --src tp=2 --dst tp=1 --world 2 --layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridmem.config import ParallelLayout
from hybridmem.contract.engine import EngineCapabilities
from hybridmem.reshard import ModelSpec, megatron_layout, vllm_layout
from hybridmem.reshard.conventions import VLLMConvention
from hybridmem.reshard.fp8 import FP8_BLOCK, FP8_DTYPE, SCALE_SUFFIX
from hybridmem.reshard.transforms import build_local
from hybridmem.testing.megatron_refit import SeededFull

PRESETS = {
    # Qwen3-0.6B's shapes (head_dim 128: Megatron's heads are whole blocks).
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, num_hidden_layers=28, vocab_size=151936,
                       tie_word_embeddings=True),
    # 64-dim heads: Megatron TP 2 cuts k and v inside a 128-block (those cells move in bf16).
    "qwen3-hd64": dict(model_type="qwen3", hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                       head_dim=64, intermediate_size=3072, num_hidden_layers=28, vocab_size=151936,
                       tie_word_embeddings=True),
    # hidden 256, 4x128 q heads, 2 kv heads, MLP 512, vocab 256 (a smoke run; its figures are counted by hand
    # in tests/benchmarks/test_fp8_sync_benchmark.py)
    "tiny": dict(model_type="qwen3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=128, intermediate_size=512, num_hidden_layers=2, vocab_size=256,
                 tie_word_embeddings=False),
}
FP8_CONFIG = {"quant_method": "fp8", "weight_block_size": list(FP8_BLOCK), "activation_scheme": "dynamic"}


class _Counting:
    """A stand-in engine taking its vLLM layout as a stream; counts the bytes it is handed."""

    dtype = torch.bfloat16

    def __init__(self, fp8: bool, layout: ParallelLayout, vocab_size: int):
        self.vocab_size = vocab_size
        self.capabilities = EngineCapabilities(streams_layout=True, describes_weights=True,
                                               reports_quantization=fp8, reports_layout=True)
        self.quantization_config = FP8_CONFIG if fp8 else None
        self.parallel_layout = layout
        self.handed = 0

    def load_layout_weights(self, weights):
        for _, tensor in weights:
            self.handed += tensor.numel() * tensor.element_size()

    def load_weights(self, weights):
        raise AssertionError("takes its own layout")

    def release(self, tags):
        pass

    def resume(self, tags):
        pass


def _layout_nbytes(layout, rank: int) -> int:
    """Bytes of a rank's tensors of an FP8 vLLM layout, from the shapes: e4m3 weights one a element, float32
    scales four, the rest bf16 two."""
    tensors = layout.tensors(rank)
    total = 0
    for name, local in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            size = 4
        else:
            size = FP8_DTYPE.itemsize if name + SCALE_SUFFIX in tensors else 2
        total += local.numel * size
    return total


def _task(ctx, spec: ModelSpec, src: ParallelLayout, dst: ParallelLayout, repeats: int) -> dict:
    from hybridmem.weight_sync import ReshardSync

    torch.set_num_threads(1)
    src_layout = megatron_layout(spec, src, ctx.world_size)
    full = SeededFull(spec, torch.bfloat16)
    train = {name: build_local(local, full, dtype=torch.bfloat16)
             for name, local in src_layout.tensors(ctx.rank).items()}
    del full
    out = {}
    for kind in ("fp8", "bf16"):
        engine = _Counting(kind == "fp8", dst, spec.vocab_size)
        sync = ReshardSync(spec, src, dst, ctx.group, lambda: train, engine)
        best = None
        for _ in range(repeats):
            engine.handed = 0
            t0 = time.perf_counter()
            stats = sync.sync()
            seconds = time.perf_counter() - t0
            best = seconds if best is None else min(best, seconds)
        out[kind] = {"received": stats.received_nbytes, "sent": stats.sent_nbytes,
                     "min": stats.min_received_nbytes, "engine": stats.engine_nbytes,
                     "handed": engine.handed, "seconds": best}
    fp8 = VLLMConvention(weight_block_size=FP8_BLOCK)
    fp8_layout = vllm_layout(spec, dst, ctx.world_size, convention=fp8)
    out["fp8_layout_nbytes"] = _layout_nbytes(fp8_layout, ctx.rank)
    return out


def _parse_layout(text: str) -> ParallelLayout:
    return ParallelLayout(**{k: int(v) for k, v in (part.split("=") for part in text.split(",") if part)})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--src", default="tp=2", help="training (Megatron) layout, e.g. tp=2")
    ap.add_argument("--dst", default="tp=1", help="engine layout, e.g. tp=1")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    args = ap.parse_args(argv)

    from hybridmem.testing.workers import WorkerPool

    fields = dict(PRESETS[args.preset])
    if args.layers is not None:
        fields["num_hidden_layers"] = args.layers
    spec = ModelSpec.from_hf_config(fields)  # as transformers' Qwen3Config has them (q and k norms included)
    src, dst = _parse_layout(args.src), _parse_layout(args.dst)
    with WorkerPool(args.world, timeout_s=args.timeout_s) as pool:
        results = pool.run(_task, spec, src, dst, args.repeats)
    mib = 2**20
    print(f"model {args.preset} ({spec.num_hidden_layers} layers), bf16 Megatron {src} -> engine {dst} on "
          f"{args.world} ranks (gloo, CPU); best of {args.repeats}")
    print(f"{'rank':>4} {'recv fp8':>9} {'min fp8':>9} {'recv bf16':>9} {'fp8/bf16':>8} {'engine fp8':>10} "
          f"{'layout fp8':>10} {'engine bf16':>11} {'fp8 s':>7} {'bf16 s':>7}   (MiB)")
    ok = True
    for r, x in enumerate(results):
        f, b = x["fp8"], x["bf16"]
        ratio = f["received"] / b["received"] if b["received"] else float("nan")
        print(f"{r:>4} {f['received'] / mib:>9.2f} {f['min'] / mib:>9.2f} {b['received'] / mib:>9.2f} "
              f"{ratio:>8.3f} {f['engine'] / mib:>10.2f} {x['fp8_layout_nbytes'] / mib:>10.2f} "
              f"{b['engine'] / mib:>11.2f} {f['seconds']:>7.3f} {b['seconds']:>7.3f}")
        ok = ok and f["engine"] == f["handed"] == x["fp8_layout_nbytes"]
    print("engine fp8 == layout fp8 (the FP8 shard's bytes from its shapes) on every rank:", ok)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"preset": args.preset, "layers": spec.num_hidden_layers, "src": str(src),
                                 "dst": str(dst), "world": args.world, "ranks": results}) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
