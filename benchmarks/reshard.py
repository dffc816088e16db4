"""Resharding benchmark: bytes received per rank and wall time for one training -> inference layout pair.

Methods, all in one run on gloo with spawned processes (hybridmem.testing.workers.WorkerPool):

(a) hybridmem: ``build_plan`` + ``run_plan`` (each rank receives only what it lacks).
(b) all-gather-to-full then slice (verl's approach): every TP-split Megatron tensor is all-gathered in
    its TP group, every stage's tensors are broadcast along the PP group, each rank rebuilds the full
    HF tensors and slices its vLLM shard.
(c) megatron-core's ``megatron.core.resharding.swap_model_weights`` (gloo copy service), which refits
    Megatron -> Megatron only: a source GPTModel in the training layout and a target GPTModel in the
    inference (tp, pp) as a Megatron layout, built on CPU under the test harness
    (``hybridmem.testing.megatron_refit``). hybridmem's plan is run for the same Megatron -> Megatron pair
    so the bytes compare like for like; both targets are checked against the layout's slices. Skipped,
    with the reason printed, when megatron-core is missing or the inference layout is not a Megatron one.

With ``--src fsdp`` the source is an FSDP2 model instead (transformers' names, every parameter a
DTensor ``Shard(0)`` over all ranks, uneven last shards as ``fully_shard`` leaves them) and the methods are:

(a) hybridmem: the same plan from :func:`hybridmem.reshard.hf_source.hf_source_layout`, each rank
    receiving only the rows of its vLLM shards it does not hold.
(b) verl's FSDP path: ``full_tensor()`` of every parameter on every rank (an all-gather), then each
    rank slices its vLLM shard out of the full tensor, one parameter at a time.

Example::

    python benchmarks/reshard.py --preset qwen2-0.5b --src tp=4 --dst tp=2 --world 4
    python benchmarks/reshard.py --preset qwen2-0.5b --src fsdp --dst tp=2 --world 4
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
from hybridmem.reshard import ModelSpec, build_plan, megatron_layout, vllm_layout
from hybridmem.reshard.transforms import build_local, scatter_local
from hybridmem.testing.megatron_refit import SeededFull, compare_refits

PRESETS = {
    # Qwen1.5-0.5B's shapes with 4 kv heads (Qwen2-0.5B's 2 kv heads cannot be split 4 ways by Megatron).
    "qwen2-0.5b": dict(family="qwen2", hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                       head_dim=64, intermediate_size=2816, num_hidden_layers=24, vocab_size=151936,
                       qkv_bias=True, tie_word_embeddings=True),
    "tiny": dict(family="qwen2", hidden_size=64, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                 intermediate_size=128, num_hidden_layers=4, vocab_size=1000, qkv_bias=True),
}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _parse_layout(text: str) -> ParallelLayout:
    kw = dict(part.split("=") for part in text.split(",") if part)
    return ParallelLayout(**{k: int(v) for k, v in kw.items()})


def _train_shards(spec, layout, rank, dtype):
    full = SeededFull(spec, dtype)
    out = {}
    for name, local in layout.tensors(rank).items():
        out[name] = build_local(local, full, dtype=dtype)
        for p in local.pieces:  # drop full tensors as soon as possible (bounded memory per rank)
            full.pop(p.hf_name, None)
    return out


def _allgather_then_slice(ctx, spec, src, dst_layout, train, groups):
    """verl-style: gather TP shards, broadcast stages, rebuild full HF tensors, slice the vLLM shard."""
    import torch.distributed as dist

    tp, pp, world = src.tp, src.pp, ctx.world_size
    dp = world // (tp * pp)
    me = src_layout = megatron_layout(spec, src, world)
    my_pp, my_dp, my_tp = ctx.rank // (tp * dp), (ctx.rank // tp) % dp, ctx.rank % tp
    received = 0
    full: dict[str, torch.Tensor] = {}
    dtype = next(iter(train.values())).dtype
    for stage in range(pp):
        stage_rank0 = stage * tp * dp  # (stage, dp 0, tp 0)
        names = src_layout.tensors(stage_rank0)
        for name, local0 in names.items():
            split = tp > 1 and src_layout.tensors(stage_rank0 + 1)[name] != local0
            shards: list[torch.Tensor]
            if my_pp == stage:
                mine = train[name].contiguous()
                if split:
                    flat = torch.empty((tp * mine.shape[0], *mine.shape[1:]), dtype=dtype)
                    dist.all_gather_into_tensor(flat, mine, group=groups["tp"][(my_pp, my_dp)])
                    gathered = flat.view(tp, *mine.shape)
                    received += (tp - 1) * mine.numel() * mine.element_size()
                else:
                    gathered = mine.unsqueeze(0)
            else:
                gathered = torch.empty(((tp if split else 1), *local0.shape), dtype=dtype)
            if pp > 1:
                src_global = stage * tp * dp + my_dp * tp + my_tp
                dist.broadcast(gathered, src=src_global, group=groups["pp"][(my_dp, my_tp)])
                if my_pp != stage:
                    received += gathered.numel() * gathered.element_size()
            shards = list(gathered) if split else [gathered[0]] * tp
            for t in range(tp):
                scatter_local(src_layout.tensors(stage_rank0 + t)[name], shards[t], _Alloc(full, spec, dtype))
    out = {name: build_local(local, full, dtype=dtype)
           for name, local in dst_layout.tensors(ctx.rank).items()}
    del me
    return out, received


class _Alloc(dict):
    def __init__(self, full, spec, dtype):
        super().__init__()
        self.full, self.shapes, self.dtype = full, spec.full_shapes(), dtype

    def __getitem__(self, name):
        if name not in self.full:
            self.full[name] = torch.empty(self.shapes[name], dtype=self.dtype)
        return self.full[name]


def _task(ctx, spec, src, dst, dtype, bucket_nbytes, repeats):
    import torch.distributed as dist


    torch.set_num_threads(1)
    world = ctx.world_size
    tp, pp = src.tp, src.pp
    dp = world // (tp * pp)
    # Every rank creates every subgroup, in the same order.
    groups = {"tp": {}, "pp": {}}
    for s in range(pp):
        for d in range(dp):
            groups["tp"][(s, d)] = dist.new_group([s * tp * dp + d * tp + t for t in range(tp)])
    for d in range(dp):
        for t in range(tp):
            groups["pp"][(d, t)] = dist.new_group([s * tp * dp + d * tp + t for s in range(pp)])
    src_layout = megatron_layout(spec, src, world)
    dst_layout = vllm_layout(spec, dst, world)
    train = _train_shards(spec, src_layout, ctx.rank, dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    t0 = time.perf_counter()
    plan = build_plan(src_layout, dst_layout, itemsize=itemsize, bucket_nbytes=bucket_nbytes, rank=ctx.rank)
    plan_s = time.perf_counter() - t0
    res = {"plan_s": plan_s, "min_nbytes": plan.min_recv_nbytes(ctx.rank),
           "dst_nbytes": plan.dst_nbytes(ctx.rank), "buckets": len(plan.buckets)}
    res.update(_compare(ctx, plan, train,
                        lambda: _allgather_then_slice(ctx, spec, src, dst_layout, train, groups), repeats))
    return res


def _compare(ctx, plan, src: dict, baseline, repeats: int) -> dict:
    """Time (a) ``run_plan`` over ``src`` and (b) ``baseline()`` (returns ``(out, received_nbytes)``), best of
    ``repeats`` each, and check that both give the same shards."""
    import torch.distributed as dist

    from hybridmem.reshard.execute import run_plan

    a_times, b_times = [], []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        out_a, stats = run_plan(plan, rank=ctx.rank, src=src)
        a_times.append(time.perf_counter() - t0)
        del out_a
        dist.barrier()
        t0 = time.perf_counter()
        out_b, recv_b = baseline()
        b_times.append(time.perf_counter() - t0)
        del out_b
    out_a, stats = run_plan(plan, rank=ctx.rank, src=src)
    out_b, _ = baseline()
    return {"same_result": all(torch.equal(out_a[n], out_b[n]) for n in out_a),
            "a_recv": stats.received_nbytes, "a_sent": stats.sent_nbytes, "a_temp": stats.temp_peak_nbytes,
            "a_s": min(a_times), "b_recv": recv_b, "b_s": min(b_times)}


def _fsdp_task(ctx, spec, dst, dtype, bucket_nbytes, repeats):
    """FSDP2 source: (a) the plan from the FSDP2 shards, (b) ``full_tensor()`` of every parameter, then
    slice."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from hybridmem.reshard.hf_source import fsdp_rows, hf_source_layout
    from hybridmem.reshard.transforms import piece_view, src_index

    torch.set_num_threads(1)
    world = ctx.world_size
    mesh = init_device_mesh("cpu", (world,))
    src_layout = hf_source_layout(spec, world, shard_size=world)
    dst_layout = vllm_layout(spec, dst, world)
    full = SeededFull(spec, dtype)
    local, dtensors = {}, {}
    for name, shape in spec.full_shapes().items():
        lo, hi = fsdp_rows(shape[0], ctx.rank, world)
        local[name] = full[name][lo:hi].clone()
        full.pop(name)
        t = torch.empty(shape)
        dtensors[name] = DTensor.from_local(local[name], mesh, [Shard(0)], run_check=False,
                                            shape=torch.Size(shape), stride=t.stride())
        del t
    itemsize = torch.empty((), dtype=dtype).element_size()
    t0 = time.perf_counter()
    plan = build_plan(src_layout, dst_layout, itemsize=itemsize, bucket_nbytes=bucket_nbytes, rank=ctx.rank)
    res = {"plan_s": time.perf_counter() - t0, "min_nbytes": plan.min_recv_nbytes(ctx.rank),
           "dst_nbytes": plan.dst_nbytes(ctx.rank), "buckets": len(plan.buckets)}
    wants: dict[str, list] = {}
    for dname, dlocal in dst_layout.tensors(ctx.rank).items():
        for piece in dlocal.pieces:
            wants.setdefault(piece.hf_name, []).append((dname, piece))

    def full_then_slice():
        out = {n: torch.zeros(t.shape, dtype=dtype) for n, t in dst_layout.tensors(ctx.rank).items()}
        received = 0
        for name, dt in dtensors.items():
            whole = dt.full_tensor()  # verl: every parameter gathered on every rank
            received += (whole.numel() - local[name].numel()) * itemsize
            for dname, piece in wants.get(name, ()):
                piece_view(out[dname], piece).copy_(whole[src_index(piece.src)])
            del whole
        return out, received

    res.update(_compare(ctx, plan, local, full_then_slice, repeats))
    return res


def _megatron_reason(spec: ModelSpec, dst: ParallelLayout, world: int) -> str | None:
    """Why (c) cannot run for this case, or ``None`` when it can."""
    try:
        import megatron.core.resharding  # noqa: F401
    except Exception as exc:  # report why it is absent
        return f"megatron.core.resharding not importable ({type(exc).__name__}: {exc})"
    if spec.is_moe:
        return "MoE presets are not wired into (c)"
    try:
        megatron_layout(spec, dst, world)
    except ValueError as exc:
        return f"the inference layout is not a Megatron layout ({exc})"
    return None


def _print_megatron(results: list[dict], repeats: int) -> None:
    mib = 2**20
    print("(c) megatron-core swap_model_weights (gloo), Megatron src -> Megatron dst with the "
          "inference (tp, pp); hybridmem's plan run for the same Megatron -> Megatron pair:")
    print(f"{'rank':>4} {'dst MiB':>9} {'min MiB':>9} {'mcore recv':>10} {'ours recv':>10} "
          f"{'mcore/ours':>10} {'mcore s':>8} {'ours s':>8} {'mcore 1st s':>11} equal(mcore, ours)")
    for r, x in enumerate(results):
        ratio = x["megatron_recv"] / x["hybridmem_recv"] if x["hybridmem_recv"] else float("nan")
        print(f"{r:>4} {x['dst_nbytes'] / mib:>9.1f} {x['min_recv'] / mib:>9.1f} "
              f"{x['megatron_recv'] / mib:>10.1f} {x['hybridmem_recv'] / mib:>10.1f} {ratio:>10.2f} "
              f"{x['megatron_s']:>8.3f} {x['hybridmem_s']:>8.3f} {x['megatron_first_s']:>11.3f} "
              f"{x['megatron_equal']}, {x['hybridmem_equal']}")
    tot_c = sum(x["megatron_recv"] for x in results)
    tot_a = sum(x["hybridmem_recv"] for x in results)
    ratio = tot_c / tot_a if tot_a else float("inf") if tot_c else 1.0
    print(f"total received: mcore {tot_c / mib:.1f} MiB, ours {tot_a / mib:.1f} MiB, ratio {ratio:.2f}; "
          f"wall (slowest rank, best of {repeats}): mcore {max(x['megatron_s'] for x in results):.3f} s, "
          f"ours {max(x['hybridmem_s'] for x in results):.3f} s; mcore's first call (plan + copy) "
          f"{max(x['megatron_first_s'] for x in results):.3f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen2-0.5b")
    ap.add_argument("--src", default="tp=4",
                    help="training layout, e.g. tp=2,pp=2, or 'fsdp' (FSDP2 over all ranks)")
    ap.add_argument("--dst", default="tp=2", help="inference layout, e.g. tp=2")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--megatron", action=argparse.BooleanOptionalAction, default=True,
                    help="also run (c), megatron-core's swap_model_weights (needs megatron-core)")
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    args = ap.parse_args(argv)

    from hybridmem.testing.workers import WorkerPool

    spec = ModelSpec(**PRESETS[args.preset])
    fsdp = args.src == "fsdp"
    src, dst = ("FSDP2" if fsdp else _parse_layout(args.src)), _parse_layout(args.dst)
    if not fsdp:
        megatron_layout(spec, src, args.world)  # validate before spawning
    vllm_layout(spec, dst, args.world)
    dtype = DTYPES[args.dtype]
    reason = ("an FSDP2 source" if fsdp
              else _megatron_reason(spec, dst, args.world) if args.megatron else "--no-megatron")
    with WorkerPool(args.world, timeout_s=args.timeout_s) as pool:
        if fsdp:
            results = pool.run(_fsdp_task, spec, dst, dtype, args.bucket_mb * 2**20, args.repeats)
        else:
            results = pool.run(_task, spec, src, dst, dtype, args.bucket_mb * 2**20, args.repeats)
        megatron = None if reason else pool.run(compare_refits, spec, src, dst, dtype=dtype,
                                                repeats=args.repeats)
    mib = 2**20
    nparams = sum(torch.Size(s).numel() for s in spec.full_shapes().values())
    print(f"model {args.preset}: {nparams / 1e6:.1f} M params, {args.dtype}; {src} -> {dst} on "
          f"{args.world} ranks (gloo, CPU); bucket {args.bucket_mb} MiB; plan built in "
          f"{results[0]['plan_s']:.2f} s, {results[0]['buckets']} buckets")
    print(f"{'rank':>4} {'dst MiB':>9} {'min MiB':>9} {'(a) recv':>9} {'(b) recv':>9} {'b/a':>6} "
          f"{'(a) s':>7} {'(b) s':>7} {'(a) temp MiB':>12} same")
    for r, x in enumerate(results):
        ratio = x["b_recv"] / x["a_recv"] if x["a_recv"] else float("inf") if x["b_recv"] else 1.0
        print(f"{r:>4} {x['dst_nbytes'] / mib:>9.1f} {x['min_nbytes'] / mib:>9.1f} {x['a_recv'] / mib:>9.1f} "
              f"{x['b_recv'] / mib:>9.1f} {ratio:>6.2f} {x['a_s']:>7.3f} {x['b_s']:>7.3f} "
              f"{x['a_temp'] / mib:>12.1f} {x['same_result']}")
    tot_a = sum(x["a_recv"] for x in results)
    tot_b = sum(x["b_recv"] for x in results)
    wall_a = max(x["a_s"] for x in results)
    wall_b = max(x["b_s"] for x in results)
    ratio = tot_b / tot_a if tot_a else float("inf") if tot_b else 1.0
    print(f"total received: (a) {tot_a / mib:.1f} MiB, (b) {tot_b / mib:.1f} MiB, ratio b/a {ratio:.2f}; "
          f"wall (slowest rank, best of {args.repeats}): (a) {wall_a:.3f} s, (b) {wall_b:.3f} s")
    if megatron is None:
        print(f"(c) not run: {reason}")
    else:
        _print_megatron(megatron, args.repeats)
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps({"preset": args.preset, "src": str(src), "dst": str(dst), "world": args.world,
                                "dtype": args.dtype, "ranks": results, "megatron": megatron}) + "\n")
    ok = all(x["same_result"] for x in results)
    ok = ok and (megatron is None or all(x["megatron_equal"] and x["hybridmem_equal"] for x in megatron))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
