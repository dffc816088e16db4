"""Test and benchmark only: megatron-core's own refit (``swap_model_weights``) next to hybridmem's plan.

megatron-core 0.16.x ships ``megatron.core.resharding.swap_model_weights(src_model, target_model,
refit_method)``, which copies the weights of one ``GPTModel`` into another built with a different
parallel layout in the same processes (Megatron layout -> Megatron layout only). This module builds such
a pair on CPU (gloo) under :func:`~hybridmem.testing.megatron_cpu.megatron_on_cpu`, fills the source from
seeded full tensors through hybridmem's Megatron layout, runs Megatron's refit, and runs hybridmem's
plan for the same layout pair, so that the two can be compared byte for byte:
``benchmarks/reshard.py`` reports it as case (c), and ``tests/megatron/test_reshard_vs_megatron_refit.py``
checks that both give the target layout's reference slices.

[Note: Megatron refit needs initialised embeddings]
``VocabParallelEmbedding`` marks its weight ``tensor_model_parallel`` only inside its initialiser, so a
model built with ``perform_initialization=False`` has an embedding that Megatron's refit planner takes for
a replicated tensor; the refit then fails copying e.g. 256 rows into 512 (TP4 -> TP2). The models here
are therefore built with ``perform_initialization=True``
(:func:`~hybridmem.testing.megatron_models.gpt_from_model_spec`) and overwritten afterwards.
"""

from __future__ import annotations

import hashlib
import math
import time
from typing import Any

import torch
import torch.distributed as dist

from hybridmem.accel.group import rank_and_size
from hybridmem.config import ParallelLayout
from hybridmem.reshard import ModelSpec, build_plan, megatron_layout
from hybridmem.reshard.conventions import MegatronConvention
from hybridmem.reshard.execute import run_plan
from hybridmem.reshard.transforms import build_local
from hybridmem.testing.megatron_cpu import megatron_on_cpu
from hybridmem.testing.megatron_models import gpt_from_model_spec

__all__ = ["SeededFull", "process_group_collection", "refit_padded_vocab", "compare_refits"]


class SeededFull(dict):
    """HF-full tensors made on first use from a seed derived from the name (the same on every rank)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype):
        super().__init__()
        self.shapes, self.dtype = spec.full_shapes(), dtype

    def __missing__(self, name: str) -> torch.Tensor:
        seed = int(hashlib.sha1(name.encode()).hexdigest()[:8], 16)
        t = torch.randn(self.shapes[name], generator=torch.Generator().manual_seed(seed)).to(self.dtype)
        self[name] = t
        return t


def refit_padded_vocab(spec: ModelSpec, src: ParallelLayout, dst: ParallelLayout,
                       divisible_by: int = 128) -> int:
    """One padded vocab for both models (a ``GPTModel`` takes the padded size): a multiple of
    ``divisible_by`` times the least common multiple of the two TP sizes."""
    unit = divisible_by * math.lcm(src.tp, dst.tp)
    return -(-spec.vocab_size // unit) * unit


def process_group_collection(tp: int, pp: int) -> Any:
    """A ``ProcessGroupCollection`` for a dense (tp, pp) layout in Megatron's default rank order (tp
    fastest, then dp, pp outermost), the order :func:`hybridmem.reshard.megatron_layout` assumes.

    Every rank of the default group must call this with the same arguments (group creation is collective).
    """
    from megatron.core import parallel_state  # noqa: PLC0415 - Megatron is optional
    from megatron.core.process_groups_config import (  # noqa: PLC0415 - Megatron is optional
        ProcessGroupCollection,
    )

    me, world = rank_and_size()
    dp = world // (tp * pp)
    if tp * pp * dp != world:
        raise ValueError(f"tp={tp} x pp={pp} does not divide world size {world}")

    def rank(p: int, d: int, t: int) -> int:
        return p * tp * dp + d * tp + t

    def make(rank_lists: list[list[int]]) -> Any:
        mine = None
        for ranks in rank_lists:
            group = dist.new_group(ranks=ranks)
            if me in ranks:
                mine = group
        return mine

    stages, replicas, tps = range(pp), range(dp), range(tp)
    tp_g = make([[rank(p, d, t) for t in tps] for p in stages for d in replicas])
    dp_g = make([[rank(p, d, t) for d in replicas] for p in stages for t in tps])
    pp_lists = [[rank(p, d, t) for p in stages] for d in replicas for t in tps]
    pp_g = make(pp_lists)
    single = make([[r] for r in range(world)])  # cp and ep of size 1
    mp_g = make([[rank(p, d, t) for p in stages for t in tps] for d in replicas])
    stage_g = make([[rank(p, d, t) for d in replicas for t in tps] for p in stages])
    embd = make([parallel_state.default_embedding_ranks(r) for r in pp_lists])
    pos_embd = make([parallel_state.default_position_embedding_ranks(r) for r in pp_lists])
    return ProcessGroupCollection(
        tp=tp_g, cp=single, pp=pp_g, ep=single, dp=dp_g, tp_cp=tp_g, mp=mp_g, expt_tp=tp_g, expt_dp=dp_g,
        tp_ep=tp_g, tp_ep_pp=mp_g, dp_cp=dp_g, tp_dp_cp=stage_g, embd=embd, pos_embd=pos_embd)


def compare_refits(ctx: Any, spec: ModelSpec, src: ParallelLayout, dst: ParallelLayout, *,
                   dtype: torch.dtype = torch.float32, repeats: int = 2) -> dict[str, Any]:
    """Worker task: Megatron's ``swap_model_weights`` (gloo) and hybridmem's plan, Megatron src ->
    Megatron dst.

    Runs on every rank of the worker pool's default group (dense specs only). Both targets are checked
    against :func:`~hybridmem.reshard.transforms.build_local` of the same seeded full tensors.

    Returns:
        This rank's figures: ``megatron_equal``/``hybridmem_equal`` (bool), ``megatron_recv``/
        ``hybridmem_recv`` (bytes received from other ranks), ``min_recv`` (the plan's minimum),
        ``megatron_first_s`` (plan + copy on the first call), ``megatron_s``/``hybridmem_s`` (best of
        ``repeats`` later calls), ``hybridmem_plan_s``.
    """
    from megatron.core import parallel_state  # noqa: PLC0415 - Megatron is optional
    from megatron.core.resharding.refit import (  # noqa: PLC0415 - Megatron is optional
        clear_service_cache,
        swap_model_weights,
    )
    from megatron.core.tensor_parallel import (  # noqa: PLC0415 - Megatron is optional
        model_parallel_cuda_manual_seed,
    )

    if spec.is_moe:
        raise ValueError(f"compare_refits takes dense specs; got num_experts={spec.num_experts}")
    padded = refit_padded_vocab(spec, src, dst)
    conv = MegatronConvention(padded_vocab_size=padded)
    src_layout = megatron_layout(spec, src, ctx.world_size, convention=conv)
    dst_layout = megatron_layout(spec, dst, ctx.world_size, convention=conv)
    with megatron_on_cpu():
        parallel_state.initialize_model_parallel(src.tp, src.pp)
        try:
            model_parallel_cuda_manual_seed(1234)
            models = [gpt_from_model_spec(spec, tp=layout.tp, pp=layout.pp, padded_vocab=padded, dtype=dtype,
                                          pg_collection=process_group_collection(layout.tp, layout.pp))
                      for layout in (src, dst)]
            full = SeededFull(spec, dtype)
            src_params, dst_params = (dict(m.named_parameters()) for m in models)
            src_local, dst_local = src_layout.tensors(ctx.rank), dst_layout.tensors(ctx.rank)
            for have, want, side in ((src_params, src_local, "source"), (dst_params, dst_local, "target")):
                if set(have) != set(want):
                    raise RuntimeError(f"rank {ctx.rank}: the {side} GPTModel's parameter names differ from "
                                       f"hybridmem's Megatron layout: {sorted(set(have) ^ set(want))}")
            with torch.no_grad():
                for name, p in src_params.items():
                    p.copy_(build_local(src_local[name], full, dtype=dtype))
            expected = {name: build_local(local, full, dtype=dtype) for name, local in dst_local.items()}

            def zero_target() -> None:
                with torch.no_grad():
                    for p in dst_params.values():
                        p.zero_()

            zero_target()
            dist.barrier()
            t0 = time.perf_counter()
            swap_model_weights([models[0]], [models[1]], refit_method="gloo")
            first_s = time.perf_counter() - t0
            megatron_equal = all(torch.equal(p, expected[n]) for n, p in dst_params.items())
            meg_times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                swap_model_weights([models[0]], [models[1]], refit_method="gloo")
                meg_times.append(time.perf_counter() - t0)
            megatron_plan = models[1]._cached_reshard_plan
            megatron_recv = sum(
                dst_params[op.param_name].data[op.my_slice].numel() * dst_params[op.param_name].element_size()
                for op in megatron_plan.recv_ops if op.peer_rank != ctx.rank)

            itemsize = dtype.itemsize
            t0 = time.perf_counter()
            plan = build_plan(src_layout, dst_layout, itemsize=itemsize, rank=ctx.rank)
            plan_s = time.perf_counter() - t0
            source = {n: p.detach() for n, p in src_params.items()}
            ours_times, stats = [], None
            for _ in range(repeats):
                zero_target()
                dist.barrier()
                t0 = time.perf_counter()
                target = {n: p.data for n, p in dst_params.items()}
                _, stats = run_plan(plan, rank=ctx.rank, src=source, dst=target, dtype=dtype)
                ours_times.append(time.perf_counter() - t0)
            hybridmem_equal = all(torch.equal(p, expected[n]) for n, p in dst_params.items())
            clear_service_cache()  # its gloo group belongs to this task's default group
            return {
                "megatron_equal": megatron_equal, "hybridmem_equal": hybridmem_equal,
                "megatron_recv": megatron_recv, "hybridmem_recv": stats.received_nbytes,
                "min_recv": plan.min_recv_nbytes(ctx.rank), "dst_nbytes": plan.dst_nbytes(ctx.rank),
                "megatron_first_s": first_s, "megatron_s": min(meg_times), "hybridmem_s": min(ours_times),
                "hybridmem_plan_s": plan_s,
            }
        finally:
            parallel_state.destroy_model_parallel()
