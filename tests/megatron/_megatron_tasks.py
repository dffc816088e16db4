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
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))]


def _infer_checks(state: MegatronTrainingState, manager: ShardingManager) -> dict[str, Any]:
    buffers = ddp_buffers(state.model_chunks)
    params = [p for c in state.model_chunks for p in c.parameters()]
    # On CUDA, torch Adam keeps ``step`` on the CPU: only device tensors are offloaded.
    opt_tensors = [t for t in _optimizer_tensors(state.optimizer) if t.device.type == params[0].device.type]
    residency = manager.residency()
    return {
        "num_buffers": len(buffers),
        "buffer_storage_nbytes": [
            (0 if b.param_data is None else b.param_data.untyped_storage().nbytes(), b.grad_data.untyped_storage().nbytes())
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
    grad_storages = {b.grad_data.untyped_storage()._cdata: b.grad_data.untyped_storage().nbytes() for b in buffers}
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
            manager = ShardingManager(state, engine, config=HybridConfig(device=device))
            state.attach(manager)
        out: dict[str, Any] = {"losses": [], "infer": [], "round_trip_diffs": [], "expected": [], "reports": [], "workspace_before": []}
        out["optimizer_type"] = type(optimizer).__name__
        out["leaf_optimizers"] = [type(o).__name__ for o in leaf_optimizers(optimizer)]
        param_ids = [id(p) for c in model_chunks for p in c.parameters()]
        for step in range(num_steps):
            out["losses"].append(mm.train_step(model_chunks, optimizer, mm.make_batch(spec, step, device), spec))
            if not switch:
                continue
            if zero_grads:
                for chunk in model_chunks:
                    chunk.zero_grad_buffer()
                optimizer.zero_grad()
            # Make Megatron's global memory buffer hold something, as sequence parallelism would.
            parallel_state.get_global_memory_buffer().get_tensor((WORKSPACE_PROBE_NUMEL,), torch.float32, "probe")
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
                    n for n, ref in named_before.items() if not torch.equal(engine.module.get_parameter(n), ref)
                ]
            out["infer"].append(checks)
            report = manager.last_report
            out["reports"].append({s.name: (s.copied_nbytes, s.zero_nbytes, dict(s.extra)) for s in report.steps})
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
