"""Within one switch each offloader finds its storages once per state ([Note: discovery within a switch] in
:mod:`hybridmem.offload.base`): fewer walks over the training tensors, and figures that still follow the
tensors, across switches (the training loop changes grads between them) and within a switch after a step
that may change them."""

from __future__ import annotations

import torch

from hybridmem import Direction, HybridConfig, ShardingManager
from hybridmem.offload import base
from hybridmem.switch.steps import StepEstimate, StepResult, SwitchStep, ToTrainOrder

LAYERS, DIM = 40, 32
WEIGHT = DIM * DIM * 4  # bytes of one fp32 weight, and of its grad
BIAS = DIM * 4


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(DIM, DIM) for _ in range(LAYERS)))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no state: params and grads only
    return model, opt


class _DropGrads(SwitchStep):
    """A step from outside (it does not say it leaves the training tensors alone) that drops every grad."""

    name = "drop grads"
    kind = None

    def __init__(self, model):
        self.model = model

    def estimate(self) -> StepEstimate:
        return StepEstimate()

    def run(self) -> StepResult:
        for p in self.model.parameters():
            p.grad = None
        return StepResult()


def test_a_switch_walks_each_offloaders_tensors_far_fewer_times(monkeypatch):
    model, opt = _model()
    manager = ShardingManager(model, optimizer=opt, config=HybridConfig(skip_zero_grads=False))
    walks = []
    real = base.Offloader._device_tensors
    monkeypatch.setattr(base.Offloader, "_device_tensors",
                        lambda self: walks.append(self.owner) or real(self))
    manager.to_infer()
    # each offloader (SGD's state one too, empty): once for the figures before its offload, once by the
    # offload itself (each figure walked them again before they were kept within a switch)
    assert sorted(walks) == sorted(["grad", "param", "optimizer"] * 2), walks
    walks.clear()
    manager.to_train()
    assert sorted(walks) == sorted(["grad", "param", "optimizer"]), walks  # after each onload
    manager.close()


def test_figures_follow_grads_dropped_between_switches_and_by_a_step_within_one():
    model, opt = _model()
    manager = ShardingManager(model, optimizer=opt, config=HybridConfig(skip_zero_grads=False))
    grads = LAYERS * (WEIGHT + BIAS)  # as many bytes as the params
    manager.to_infer()
    manager.to_train()
    for p in model.parameters():  # the training loop, between switches
        p.grad = None
    free = {s.name: s.estimate.free_nbytes for s in manager.plan(Direction.TO_INFER).steps}
    assert free["offload grad"] == 0 and free["offload param"] == grads
    report = manager.to_infer()
    assert report.copied_nbytes == grads  # the params alone
    manager.to_train()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    manager.register_step(Direction.TO_TRAIN, _DropGrads(model), order=ToTrainOrder.OPTIMIZER + 1)
    manager.to_infer()
    report = manager.to_train()
    after = {s.name: s.allocated_after_nbytes for s in report.steps}
    assert after["onload grad"] - after["drop grads"] == grads, after
    manager.close()
