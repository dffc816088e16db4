"""Worker task of the Megatron fault-injection test (module level so spawned workers can unpickle it).

One actor (GPTModel in Megatron's DDP with its optimizer, a TorchCopyEngine, the workspace step) serves
every injection point: the training state is restored in place from a snapshot before each point (every
DDP param/grad buffer, every main param and optimizer-state tensor), which is cheaper than rebuilding
Megatron hundreds of times and also checks that a point leaves no damage the next one would trip on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from _faults import (
    TORCH_SEAMS,
    FaultInjector,
    Injected,
    engine_seams,
    inject,
    leftovers,
    sample_points,
)
from _megatron_tasks import _copy_engine, _optimizer_tensors, megatron_worker

from hybridmem import HybridConfig, Phase, ShardingManager
from hybridmem.adapters.megatron import (
    MegatronTrainingState,
    ddp_buffers,
    leaf_optimizers,
    unwrap_model,
)
from hybridmem.testing import megatron_models as mm

EXCEPTIONS: dict[str, Callable[[], BaseException]] = {
    "exception": lambda: Injected("injected"),
    "keyboard-interrupt": KeyboardInterrupt,
}


def _live(model_chunks: list[Any], optimizer: Any) -> dict[str, torch.Tensor]:
    """Every training tensor by a stable name (the objects themselves, not copies)."""
    live = {}
    for i, buf in enumerate(ddp_buffers(model_chunks)):
        if buf.param_data is not None:
            live[f"buffer{i}.param_data"] = buf.param_data
        for j, p in enumerate(buf.params):
            live[f"buffer{i}.param{j}"] = p.data
        live[f"buffer{i}.grad_data"] = buf.grad_data
    for i, t in enumerate(_optimizer_tensors(optimizer)):
        live[f"optimizer{i}"] = t
    return live


def _diffs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    if a.keys() != b.keys():
        return [f"keys differ: {sorted(set(a) ^ set(b))}"]
    out = []
    for k in a:
        x, y = a[k], b[k]
        if x.untyped_storage().nbytes() == 0:
            out.append(f"{k} has 0 bytes")
        elif x.dtype != y.dtype or not torch.equal(x.reshape(-1).view(torch.uint8),
                                                   y.reshape(-1).view(torch.uint8)):
            out.append(k)
    return out


class _Actor:
    def __init__(self, spec: mm.TinyGPTSpec):
        self.spec = spec
        self.chunks, self.optimizer = mm.build_megatron_gpt(spec)
        for step in range(2):
            mm.train_step(self.chunks, self.optimizer, mm.make_batch(spec, step), spec)
        self.state = MegatronTrainingState(self.chunks, self.optimizer)
        self.engine = _copy_engine(unwrap_model(self.chunks[0]))
        self.manager = ShardingManager(self.state, self.engine, config=HybridConfig())
        self.state.attach(self.manager)
        self.injector = FaultInjector(TORCH_SEAMS + engine_seams(self.engine))
        self.snapshot = {k: v.clone() for k, v in _live(self.chunks, self.optimizer).items()}
        # One switch cycle first: it sizes the host arenas, so every later switch makes the same calls
        # (the first switch's arena allocations are covered by the plain-PyTorch test, fresh each point).
        self.manager.to_infer()
        self.manager.to_train()

    def restore(self) -> None:
        with torch.no_grad():
            for k, v in _live(self.chunks, self.optimizer).items():
                v.copy_(self.snapshot[k])

    def next_losses(self) -> list[float]:
        return [mm.train_step(self.chunks, self.optimizer, mm.make_batch(self.spec, s), self.spec)
                for s in (2, 3)]

    def prepare(self, direction: str, fail_at: int | None) -> Callable[[], Any]:
        if direction == "to_infer":
            return self.manager.to_infer
        self.manager.to_infer()
        if direction == "to_train":
            return self.manager.to_train
        with self.injector.active(target=fail_at, exc=lambda: Injected("first failure")):
            try:
                self.manager.to_train()
            except Exception as e:  # the SwitchError of the first failure
                if not isinstance(e.__cause__, Injected):
                    raise
        if self.manager.phase is not Phase.FAILED:
            raise AssertionError(f"the first failure left phase {self.manager.phase.name}")
        return self.manager.recover

    def check(self, direction: str, point: int, exc: Callable[[], BaseException], reference: list[float],
              fail_at: int | None) -> str | None:
        self.restore()
        switch = self.prepare(direction, fail_at)
        fired, raised = inject(self.injector, point, exc, switch)
        where = f"point {point} ({fired})"
        if fired is None or raised is None:
            return f"{where}: fired={fired} raised={raised!r}"
        if self.manager.phase is Phase.FAILED:
            self.manager.recover()
        if self.manager.phase is not Phase.TRAIN:
            return f"{where}: phase {self.manager.phase.name}"
        diffs = _diffs(_live(self.chunks, self.optimizer), self.snapshot)
        if diffs:
            return f"{where}: differs: {diffs[:5]}"
        left = leftovers(self.manager, self.engine)
        if left is not None:
            return f"{where}: {left}"
        losses = self.next_losses()
        if losses != reference:
            return f"{where}: next losses {losses} != uninterrupted {reference}"
        return None


def _misuse(actor: _Actor) -> dict[str, str]:
    """What a Megatron step, zero_grad and forward say inside INFER (the misuse guards)."""
    from hybridmem.errors import PhaseError

    mb = mm.make_batch(actor.spec, 0)[0]
    calls = {
        "step": lambda: actor.optimizer.step(),
        "zero_grad": lambda: actor.optimizer.zero_grad(),
        "zero_grad_buffer": lambda: actor.chunks[0].zero_grad_buffer(),
        "forward": lambda: actor.chunks[0](mb["tokens"], mb["position_ids"], None, labels=mb["labels"]),
    }
    out = {}
    actor.manager.to_infer()
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except PhaseError as e:
            out[name] = f"PhaseError: {e}"
    actor.manager.to_train()
    return out


def inject_everywhere(ctx, spec: mm.TinyGPTSpec, directions: tuple[str, ...], full: bool) -> dict:
    """For each direction: dry-run the switch, then inject both exception kinds at each point (all of
    them with ``full``, else the CI sample); returns the counts and the problems found."""
    del ctx
    import _faults

    _faults.FULL = full
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    with megatron_worker(spec):
        actor = _Actor(spec)
        reference = actor.next_losses()
        actor.restore()
        again = actor.next_losses()  # the restore is complete: the reference repeats
        if again != reference:
            raise AssertionError(f"restoring the snapshot does not reproduce the losses: {again} "
                                 f"!= {reference}")
        out["reference"] = reference
        out["leaf_optimizers"] = [type(o).__name__ for o in leaf_optimizers(actor.optimizer)]
        out["misuse"] = _misuse(actor)
        for direction in directions:
            fail_at = None
            if direction == "recover":
                actor.restore()
                actor.manager.to_infer()
                fail_at = len(actor.injector.count_calls(actor.manager.to_train)) // 2
            actor.restore()
            switch = actor.prepare(direction, fail_at)
            labels = actor.injector.count_calls(switch)
            if actor.manager.phase is Phase.INFER:
                actor.manager.to_train()
            if actor.manager.phase is not Phase.TRAIN:
                raise AssertionError(f"the dry run of {direction} ended in {actor.manager.phase.name}")
            problems, runs = [], 0
            for point in sample_points(labels):
                for kind, exc in EXCEPTIONS.items():
                    runs += 1
                    problem = actor.check(direction, point, exc, reference, fail_at)
                    if problem is not None:
                        problems.append(f"{direction} {kind} {problem}")
                        if actor.manager.phase is not Phase.TRAIN or len(problems) > 5:
                            break
            out[direction] = {"points": len(labels), "runs": runs, "problems": problems,
                              "kinds": sorted(set(labels))}
    return out
