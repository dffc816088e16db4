"""Worker tasks for the Megatron tests (module-level so spawned workers can unpickle them).

Each task initialises Megatron's parallel_state inside the worker, runs under the CPU harness (on
"cpu"; on "cuda" Megatron runs as is, one GPU per rank over nccl), and destroys parallel_state at the
end so the pooled worker can serve the next test.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from hybridmem import HybridConfig, ShardingManager
from hybridmem.adapters.megatron import (
    WORKSPACE_OWNER,
    MegatronTrainingState,
    ddp_buffers,
    leaf_optimizers,
    main_param_tensors,
    unwrap_model,
)
from hybridmem.engines import TorchCopyEngine
from hybridmem.testing import megatron_models as mm
from hybridmem.testing.megatron_cpu import megatron_on_cpu

WORKSPACE_PROBE_NUMEL = 4096


@contextlib.contextmanager
def megatron_worker(spec: mm.TinyGPTSpec, device: str = "cpu"):
    """Harness (on CPU) + parallel_state for one task."""
    with megatron_on_cpu() if device == "cpu" else contextlib.nullcontext():
        mm.init_megatron_parallel(spec)
        try:
            yield
        finally:
            mm.destroy_megatron_parallel()


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """Main params and inner state tensors, found independently of the adapter's offloader."""
    out = list(main_param_tensors(optimizer))
    for leaf in leaf_optimizers(optimizer):
        for state in leaf.optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def _snapshot(model_chunks: list[Any], optimizer: Any) -> dict[str, torch.Tensor]:
    snap = {}
    for i, buf in enumerate(ddp_buffers(model_chunks)):
        if buf.param_data is not None:
            snap[f"buffer{i}.param_data"] = buf.param_data.clone()
        for j, p in enumerate(buf.params):
            snap[f"buffer{i}.param{j}"] = p.detach().clone()
        snap[f"buffer{i}.grad_data"] = buf.grad_data.clone()
    for i, t in enumerate(_optimizer_tensors(optimizer)):
        snap[f"optimizer{i}"] = t.clone()
    return snap


def _bitwise_diffs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    if a.keys() != b.keys():
        return [f"keys differ: {sorted(set(a) ^ set(b))}"]
    return [k for k in a if a[k].dtype != b[k].dtype
            or not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))]


def _infer_checks(state: MegatronTrainingState, manager: ShardingManager) -> dict[str, Any]:
    buffers = ddp_buffers(state.model_chunks)
    params = [p for c in state.model_chunks for p in c.parameters()]
    # On CUDA, torch Adam keeps ``step`` on the CPU: only device tensors are offloaded.
    opt_tensors = [t for t in _optimizer_tensors(state.optimizer) if t.device.type == params[0].device.type]
    residency = manager.residency()
    return {
        "num_buffers": len(buffers),
        "buffer_storage_nbytes": [
            (0 if b.param_data is None else b.param_data.untyped_storage().nbytes(),
             b.grad_data.untyped_storage().nbytes())
            for b in buffers
        ],
        "has_param_data": [b.param_data is not None for b in buffers],
        "max_param_storage_nbytes": max(p.untyped_storage().nbytes() for p in params),
        "num_optimizer_tensors": len(opt_tensors),
        "max_optimizer_storage_nbytes": max((t.untyped_storage().nbytes() for t in opt_tensors), default=0),
        "residency_by_owner": dict(residency.by_owner),
        "leftovers": residency.leftovers,
        "phase": manager.phase.name,
    }


def _param_storages(buffers: list[Any]) -> set[int]:
    return {p.untyped_storage()._cdata for b in buffers for p in b.params}


def _expected_nbytes(state: MegatronTrainingState) -> dict[str, int]:
    """Device bytes by kind computed from Megatron's own objects (the formula the report must match)."""
    buffers = ddp_buffers(state.model_chunks)
    # Without the distributed optimizer there is no param_data: each param has its own storage.
    param = sum(
        b.param_data.numel() * b.param_data.element_size()
        if b.param_data is not None
        else sum(p.numel() * p.element_size() for p in b.params)
        for b in buffers
    )
    grad_storages = {b.grad_data.untyped_storage()._cdata: b.grad_data.untyped_storage().nbytes()
                     for b in buffers}
    for p in main_param_tensors(state.optimizer):
        if p.grad is not None:  # a view of grad_data (fp32 grads) or its own tensor (cast copies)
            grad_storages[p.grad.untyped_storage()._cdata] = p.grad.untyped_storage().nbytes()
    grad = sum(grad_storages.values())
    seen, opt = set(), 0
    device_type = buffers[0].grad_data.device.type
    for t in _optimizer_tensors(state.optimizer):
        if t.device.type != device_type:
            continue
        s = t.untyped_storage()
        if s._cdata not in seen and s._cdata not in _param_storages(buffers):
            seen.add(s._cdata)
            opt += s.nbytes()
    return {"train param": param, "train grad": grad, "optimizer": opt}


def _copy_engine(model: Any) -> TorchCopyEngine:
    """A TorchCopyEngine of a GPTModel. Its modules hold process groups, which cannot be deep-copied;
    the copy shares them (only for the duration of the copy)."""
    import copy

    pg_type = torch.distributed.ProcessGroup
    saved = copy._deepcopy_dispatch.get(pg_type)
    copy._deepcopy_dispatch[pg_type] = lambda pg, memo: pg
    try:
        return TorchCopyEngine(model)
    finally:
        if saved is None:
            copy._deepcopy_dispatch.pop(pg_type, None)
        else:
            copy._deepcopy_dispatch[pg_type] = saved


def train_with_switches(
    ctx,
    spec: mm.TinyGPTSpec,
    num_steps: int,
    switch: bool,
    use_engine: bool = False,
    zero_grads: bool = False,
    device: str = "cpu",
) -> dict:
    """Train ``num_steps``; with ``switch``, do to_infer()/to_train() after every step and check the
    INFER state and the bitwise round trip. ``use_engine``: a TorchCopyEngine of the GPTModel receives
    the weights by Megatron name. ``zero_grads``: zero the grad buffers before switching (as the next
    step would), so the grad offload must release them without a copy."""
    del ctx
    from megatron.core import parallel_state

    with megatron_worker(spec, device):
        model_chunks, optimizer = mm.build_megatron_gpt(spec, device=device)
        state = MegatronTrainingState(model_chunks, optimizer)
        manager = None
        engine = None
        if switch:
            if use_engine:
                engine = _copy_engine(unwrap_model(model_chunks[0]))
            # attaches the state itself
            manager = ShardingManager(state, engine, config=HybridConfig(device=device))
        out: dict[str, Any] = {"losses": [], "infer": [], "round_trip_diffs": [], "expected": [],
                               "reports": [], "workspace_before": []}
        out["optimizer_type"] = type(optimizer).__name__
        out["leaf_optimizers"] = [type(o).__name__ for o in leaf_optimizers(optimizer)]
        param_ids = [id(p) for c in model_chunks for p in c.parameters()]
        for step in range(num_steps):
            out["losses"].append(mm.train_step(model_chunks, optimizer,
                                               mm.make_batch(spec, step, device), spec))
            if not switch:
                continue
            if zero_grads:
                for chunk in model_chunks:
                    chunk.zero_grad_buffer()
                optimizer.zero_grad()
            # Make Megatron's global memory buffer hold something, as sequence parallelism would.
            parallel_state.get_global_memory_buffer().get_tensor((WORKSPACE_PROBE_NUMEL,), torch.float32,
                                                                 "probe")
            if device != "cpu":
                torch.cuda.synchronize()
            out["workspace_before"].append(manager.residency().by_owner[WORKSPACE_OWNER])
            out["expected"].append(_expected_nbytes(state))
            before = _snapshot(model_chunks, optimizer)
            named_before = {n: p.detach().clone() for n, p in state.named_weights()}
            manager.to_infer()
            checks = _infer_checks(state, manager)
            if engine is not None:
                checks["engine_diffs"] = [
                    n for n, ref in named_before.items()
                    if not torch.equal(engine.module.get_parameter(n), ref)
                ]
            out["infer"].append(checks)
            report = manager.last_report
            out["reports"].append({s.name: (s.copied_nbytes, s.zero_nbytes, dict(s.extra))
                                   for s in report.steps})
            manager.to_train()
            out["round_trip_diffs"].append(_bitwise_diffs(before, _snapshot(model_chunks, optimizer)))
        out["same_param_objects"] = param_ids == [id(p) for c in model_chunks for p in c.parameters()]
        return out


def collect_weights(ctx, spec: mm.TinyGPTSpec) -> dict:
    """This rank's named weights, shard specs, source layout and model spec dict (no training)."""
    del ctx
    with megatron_worker(spec):
        model_chunks, optimizer = mm.build_megatron_gpt(spec)
        state = MegatronTrainingState(model_chunks, optimizer)
        return {
            "weights": {n: p.detach().clone() for n, p in state.named_weights()},
            "specs": state.shard_specs(),
            "layout": state.source_layout(),
            "model_spec": state.model_spec_dict(),
        }


class _VLLMLayoutHolder:
    """A test engine holding vLLM-layout tensors of given shapes (for MoE, which ReferenceEngine lacks):
    ReshardSync writes into ``named_parameters()``; release/resume are bookkeeping only."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, model_type: str | None = None):
        self.params = {n: torch.full(s, float("nan"), dtype=dtype) for n, s in shapes.items()}
        self.model_type = model_type
        """The family the engine serves, as vLLM's engine reports it (its HF config's ``model_type``)."""

    def named_parameters(self):
        return iter(self.params.items())

    def load_weights(self, weights):
        raise AssertionError("ReshardSync must write in place into named_parameters()")

    def release(self, tags=None):
        return 0

    def resume(self, tags=None):
        return 0


def _reference_module():
    """tests/reshard/reference.py: the independent slicing the resharding engine is tested against."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "reshard" / "reference.py"
    module_spec = importlib.util.spec_from_file_location("hybridmem_tests_reshard_reference", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _vocab_name(name: str) -> bool:
    return any(k in name for k in ("word_embeddings", "output_layer", "embed_tokens", "lm_head"))


def _shard_diffs(want: dict[str, torch.Tensor], have: dict[str, torch.Tensor], *, tp_rank: int, vocab: int,
                 cast: bool = False) -> list[str]:
    """Names whose tensors differ; vocab tensors are compared on their real (unpadded) rows only, the
    padding rows being each side's own. ``cast``: ``want`` is first cast to ``have``'s dtype (the engine
    holds every tensor in its own dtype; Megatron keeps some norms in fp32 beside bf16 weights)."""
    diffs = ([f"missing {n}" for n in want.keys() - have.keys()]
             + [f"unexpected {n}" for n in have.keys() - want.keys()])
    for n in want.keys() & have.keys():
        a, b = want[n], have[n]
        if cast:
            a = a.to(b.dtype)
        if _vocab_name(n):
            k = max(0, min(a.shape[0], vocab - tp_rank * a.shape[0]))
            a, b = (a[:k], b[:k]) if a.shape == b.shape else (a, b)
        if a.shape != b.shape or not torch.equal(a, b):
            diffs.append(n)
    return sorted(diffs)


_MIXTRAL_NAMES = (
    # Mixtral's checkpoint and vLLM names against the Llama/Qwen ones the reference slicer reads, written
    # from Mixtral's checkpoints (block_sparse_moe; w1 = gate, w3 = up, w2 = down) for this test.
    ("block_sparse_moe.gate.", "mlp.gate."),
    ("block_sparse_moe.experts.routed_experts.", "mlp.experts.routed_experts."),
    (".w1.weight", ".gate_proj.weight"),
    (".w3.weight", ".up_proj.weight"),
    (".w2.weight", ".down_proj.weight"),
    ("block_sparse_moe.experts.", "mlp.experts."),
)


def _renamed(tensors: dict[str, torch.Tensor], pairs, *, reverse: bool = False) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        for a, b in pairs:
            name = name.replace(b, a) if reverse else name.replace(a, b)
        out[name] = t
    return out


def reshard_into_engine(ctx, spec: mm.TinyGPTSpec, infer_tp: int, num_steps: int, vocab_size: int,
                        engine_model_type: str | None = None) -> dict:
    """Train with a TRAIN->INFER switch after every step into an engine at inference TP ``infer_tp``
    (ShardingManager's default weight sync, spec and vocab padding derived from the Megatron model), and
    compare every engine tensor with the reference vLLM slice of the full weights.

    The full HF weights are rebuilt from all ranks' Megatron tensors by ``hybridmem.reshard.unshard``
    and then checked independently: the reference Megatron slicing of them must reproduce every rank's
    actual Megatron tensors exactly, so they are the weights Megatron trains.
    """
    from hybridmem.engines import ENGINE_TAGS, ReferenceEngine
    from hybridmem.reshard import ModelSpec, megatron_layout, unshard, vllm_layout

    ref = _reference_module()
    world, rank = ctx.world_size, ctx.rank
    infer_groups = [torch.distributed.new_group(list(range(s, s + infer_tp)))
                    for s in range(0, world, infer_tp)]
    with megatron_worker(spec):
        model_chunks, optimizer = mm.build_megatron_gpt(spec)
        state = MegatronTrainingState(model_chunks, optimizer, vocab_size=vocab_size)
        model_spec = ModelSpec.from_hf_config(state.model_spec_dict(model_type=engine_model_type))
        names = _MIXTRAL_NAMES if engine_model_type == "mixtral" else ()
        config = HybridConfig(
            device="cpu", tensor_model_parallel_size=spec.tp, pipeline_model_parallel_size=spec.pp,
            expert_model_parallel_size=spec.ep, infer_tensor_parallel_size=infer_tp,
            infer_expert_parallel_size=1, verify_weight_sync=True,
        )
        convention = state.megatron_convention()
        if model_spec.is_moe:
            shapes = {n: t.shape
                      for n, t in vllm_layout(model_spec, config.infer_layout, world).tensors(rank).items()}
            engine = _VLLMLayoutHolder({n: tuple(s) for n, s in shapes.items()}, spec.params_dtype,
                                       engine_model_type)
        else:
            engine = ReferenceEngine(state.model_spec_dict(), group=infer_groups[rank // infer_tp],
                                     num_kv_blocks=4, block_size=4, dtype=spec.params_dtype)
            engine.release(list(ENGINE_TAGS))
        manager = ShardingManager(state, engine, config=config)
        state.attach(manager)
        out: dict[str, Any] = {"diffs": [], "megatron_diffs": [], "received": [], "min_received": [],
                               "losses": [], "num_tensors": []}
        for step in range(num_steps):
            out["losses"].append(mm.train_step(model_chunks, optimizer, mm.make_batch(spec, step), spec))
            local = {n: p.detach().clone() for n, p in state.named_weights()}
            every: list[Any] = [None] * world
            torch.distributed.all_gather_object(every, local)
            full = _renamed(unshard(every, megatron_layout(model_spec, config.train_layout, world,
                                                           convention=convention)),
                            names)
            for r, theirs in enumerate(every):
                mine = ref.megatron_shard(full, model_spec, tp=spec.tp, pp=spec.pp, ep=spec.ep,
                                          world=world, rank=r,
                                          divisible_by=convention.padded_vocab_size // spec.tp)
                out["megatron_diffs"] += [f"rank {r}: {d}"
                                          for d in _shard_diffs(mine, theirs, tp_rank=r % spec.tp,
                                                                vocab=model_spec.vocab_size)]
            manager.to_infer()
            expected = _renamed(ref.vllm_shard(full, model_spec, tp=infer_tp, pp=1, ep=1, world=world,
                                               rank=rank),
                                names[:2], reverse=True)
            diffs = _shard_diffs(expected, dict(engine.named_parameters()), tp_rank=rank % infer_tp,
                                 vocab=model_spec.vocab_size, cast=True)
            out["diffs"].append(diffs)
            out["num_tensors"].append(len(expected))
            report = manager.last_report
            sync = [s for s in report.steps if s.extra.get("received_nbytes") is not None]
            out["received"].append(sync[0].extra["received_nbytes"] if sync else None)
            out["min_received"].append(sync[0].extra.get("min_received_nbytes") if sync else None)
            manager.to_train()
        manager.close()
        return out
