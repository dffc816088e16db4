"""Module-level tasks run in WorkerPool processes by test_distributed.py (must be importable by spawn)."""

from __future__ import annotations

import torch

from hybridmem.contract.engine import EngineCapabilities
from hybridmem.reshard import build_plan, hf_layout, megatron_layout, vllm_layout
from hybridmem.reshard.execute import iter_full_tensors, run_plan
from hybridmem.weight_sync import ReshardSync
from tests.reshard.reference import megatron_shard, random_full


def _train(spec, src, world, rank, dtype=torch.float32):
    full = random_full(spec, dtype=dtype)
    return full, megatron_shard(full, spec, tp=src.tp, pp=src.pp, ep=src.ep, world=world, rank=rank)


def run_plan_task(ctx, spec, src, dst, bucket):
    _, train = _train(spec, src, ctx.world_size, ctx.rank)
    plan = build_plan(megatron_layout(spec, src, ctx.world_size), vllm_layout(spec, dst, ctx.world_size),
                      itemsize=4, bucket_nbytes=bucket, rank=ctx.rank)
    out, stats = run_plan(plan, rank=ctx.rank, src=train, group=ctx.group)
    return out, stats


def stream_task(ctx, spec, src, dst, bucket):
    full, train = _train(spec, src, ctx.world_size, ctx.rank)
    plan = build_plan(megatron_layout(spec, src, ctx.world_size), hf_layout(spec, dst, ctx.world_size),
                      itemsize=4, bucket_nbytes=bucket, rank=ctx.rank)
    stats = []
    names, ok = [], True
    for name, tensor in iter_full_tensors(plan, rank=ctx.rank, src=train, group=ctx.group, stats=stats):
        names.append(name)
        ok = ok and torch.equal(tensor, full[name])
    return names, ok, stats[0], sorted(plan.dst.tensors(ctx.rank))


class ParamEngine:
    """An engine exposing its weights (vLLM names and shapes) through named_parameters()."""

    def __init__(self, tensors):
        self.tensors = {k: torch.full_like(v, float("nan")) for k, v in tensors.items()}

    def named_parameters(self):
        return iter(self.tensors.items())

    def load_weights(self, weights):
        raise AssertionError("in-place sync must not call load_weights")

    def release(self, tags):
        pass

    def resume(self, tags):
        pass


class LoadOnlyEngine:
    def __init__(self):
        self.loaded = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()

    def release(self, tags):
        pass

    def resume(self, tags):
        pass


class LayoutStreamEngine:
    """An engine that takes its own (vLLM) layout's tensors as a stream and keeps copies of them."""

    capabilities = EngineCapabilities(streams_layout=True)

    def __init__(self):
        self.loaded = {}

    def load_layout_weights(self, weights):
        for name, tensor in weights:
            assert name not in self.loaded, name
            self.loaded[name] = tensor.clone()

    def load_weights(self, weights):
        raise AssertionError("an engine streaming its own layout must not get HF tensors")

    def release(self, tags):
        pass

    def resume(self, tags):
        pass


def sync_engine(route, layout, rank, **kwargs):
    """The engine of a ``route``: ``"in_place"``, ``"layout"`` (its own layout streamed) or ``"hf"``."""
    if route == "in_place":
        return ParamEngine({n: torch.zeros(t.shape, **kwargs) for n, t in layout.tensors(rank).items()})
    return LayoutStreamEngine() if route == "layout" else LoadOnlyEngine()


def sync_task(ctx, spec, src, dst, *, route, corrupt_rank=None):
    import hybridmem.reshard.execute as execute

    full, train = _train(spec, src, ctx.world_size, ctx.rank)
    layout = vllm_layout(spec, dst, ctx.world_size)
    engine = sync_engine(route, layout, ctx.rank)
    if corrupt_rank == ctx.rank:
        original = execute._unpack

        def corrupting(arrived, dst_tensors, *rest):
            for _, (values, *_) in arrived[:1]:
                values.view(-1)[0] += 1.0  # one flipped value in transit
            original(arrived, dst_tensors, *rest)

        execute._unpack = corrupting
    sync = ReshardSync(spec, src, dst, ctx.group, lambda: train, engine, bucket_nbytes=256, verify=True,
                       dtype=torch.float32)
    try:
        stats = sync.sync()
        error = None
    except Exception as exc:  # the test inspects it
        stats, error = None, f"{type(exc).__name__}: {exc}"
    finally:
        if corrupt_rank == ctx.rank:
            execute._unpack = original
    got = engine.tensors if route == "in_place" else engine.loaded
    return got, stats, error, sync.temp_nbytes()


def bf16_wire_with_fp32_bias_task(ctx, spec, src, dst, bucket):
    """bf16 weights and fp32 router biases (as Megatron holds them) over a bf16 wire, in place and as an
    HF stream. The biases hold values bf16 cannot represent; returns what arrived and the figures."""
    full = random_full(spec)
    for name in full:
        if spec.keeps_fp32(name):
            full[name] = full[name] / 3.0 + 1e-3  # not representable in bf16
        else:
            full[name] = full[name].to(torch.bfloat16)
    train = megatron_shard(full, spec, tp=src.tp, pp=src.pp, ep=src.ep, world=ctx.world_size, rank=ctx.rank)
    layout = vllm_layout(spec, dst, ctx.world_size)
    plan = build_plan(megatron_layout(spec, src, ctx.world_size), layout, itemsize=2, bucket_nbytes=bucket,
                      rank=ctx.rank)
    engine = {n: torch.zeros(t.shape, dtype=torch.float32 if spec.keeps_fp32(t.pieces[0].hf_name)
                             else torch.bfloat16)
              for n, t in layout.tensors(ctx.rank).items()}
    out, stats = run_plan(plan, rank=ctx.rank, src=train, group=ctx.group, dst=engine, dtype=torch.bfloat16)
    hf = build_plan(megatron_layout(spec, src, ctx.world_size), hf_layout(spec, dst, ctx.world_size),
                    itemsize=2, bucket_nbytes=bucket, rank=ctx.rank)
    streamed = dict(iter_full_tensors(hf, rank=ctx.rank, src=train, group=ctx.group, dtype=torch.bfloat16))
    return full, out, stats, plan.min_recv_nbytes(ctx.rank), streamed
