"""Every hybridmem error survives pickling ([Note: errors cross processes] in :mod:`hybridmem.errors`): a
worker process (a Ray actor, a spawned worker) hands the caller the same class with the same message and
attributes."""

from __future__ import annotations

import inspect
import pickle

import pytest

from hybridmem import errors
from hybridmem.switch.memplan import StepEstimate, plan_switch
from hybridmem.switch.phase import Direction, Phase


def _plan(host_budget: int | None):
    step = StepEstimate(alloc_nbytes=10, host_alloc_nbytes=100)
    return plan_switch(Direction.TO_INFER, 0, [("offload param", step)],
                       budget_nbytes=5 if host_budget is None else 100, budget_source="test",
                       host_budget_nbytes=host_budget)


BUDGET = errors.HostMemoryBudgetError(key="offload param", requested_nbytes=10, held_nbytes=5,
                                      budget_nbytes=12)
TIMEOUT = errors.CollectiveTimeoutError("exchange", peers=(1, 3), deadline_s=6.0, elapsed_s=6.5,
                                        cause="peer gone")
EXAMPLES = {
    errors.HybridMemError: lambda: errors.HybridMemError("something hybridmem refused"),
    errors.ConfigError: lambda: errors.ConfigError("device", "gpu", "one of ['cpu']", source="job.yaml"),
    errors.PhaseError: lambda: errors.PhaseError("generate", Phase.TRAIN, "use inference()"),
    errors.OffloadedTensorError: lambda: errors.OffloadedTensorError("read", kind="param", shape=(2, 3),
                                                                     dtype="fp32"),
    errors.SwitchError: lambda: errors.SwitchError("failed", direction="to_infer", step="weight sync",
                                                   phase_after=Phase.TRAIN),
    errors.RollbackError: lambda: errors.RollbackError("undo failed", direction="to_infer",
                                                       step="offload param", phase_after=Phase.FAILED),
    errors.MemoryPlanError: lambda: errors.MemoryPlanError(_plan(None)),
    errors.HostMemoryPlanError: lambda: errors.MemoryPlanError(_plan(50)),
    errors.HostMemoryBudgetError: lambda: BUDGET,
    errors.WeightSyncError: lambda: errors.WeightSyncError("checksum differs"),
    errors.WeightCoverageError: lambda: errors.WeightCoverageError(["model.norm.weight"], engine="vLLM"),
    errors.CollectiveTimeoutError: lambda: TIMEOUT,
    errors.EngineProcessError: lambda: errors.EngineProcessError(
        "wake_up", where="http://127.0.0.1:8000", deadline_s=5.0, elapsed_s=5.2, cause="timed out",
        fault=errors.EngineFault.STALLED),
    errors.EngineSetupError: lambda: errors.EngineSetupError(
        "the vLLM server at http://127.0.0.1:8000 was started without VLLM_SERVER_DEV_MODE=1",
        where="http://127.0.0.1:8000", missing="VLLM_SERVER_DEV_MODE=1"),
    errors.PeerAbortError: lambda: errors.PeerAbortError((2,), rank=0),
    errors.KVStateError: lambda: errors.KVStateError("resume", "released", allocator="torch"),
    errors.KVResumeError: lambda: errors.KVResumeError("no room", requested_nbytes=10, mapped_nbytes=4,
                                                       step="kv"),
    errors.UnsupportedLibraryError: lambda: errors.UnsupportedLibraryError(
        "trl", "1.17.0", ">=1.16,<1.17", read_from="1.16.0", in_range=False,
        missing=["trl.generation.vllm_generation.VLLMGeneration.generate"]),
}
for _cause_cls, _cls in errors._SWITCH_CLASSES:
    EXAMPLES[_cls] = (lambda cause_cls=_cause_cls: errors.switch_error(
        "a step failed", direction="to_infer", step="weight sync", phase_after=Phase.TRAIN,
        cause=EXAMPLES[cause_cls]()))

CLASSES = sorted((c for _, c in inspect.getmembers(errors, inspect.isclass)
                  if issubclass(c, errors.HybridMemError) and not c.__name__.startswith("_")),
                 key=lambda c: c.__name__)


def test_every_error_class_has_an_example():
    assert set(CLASSES) <= set(EXAMPLES), sorted(c.__name__ for c in set(CLASSES) - set(EXAMPLES))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_an_error_comes_back_from_pickle_as_itself(cls):
    error = EXAMPLES[cls]()
    assert type(error) is cls
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is cls and str(back) == str(error) and back.args == error.args
    mine = {k: v for k, v in vars(error).items() if not k.startswith("_")}
    theirs = {k: v for k, v in vars(back).items() if not k.startswith("_")}
    assert set(theirs) == set(mine)
    for key, value in mine.items():
        if isinstance(value, BaseException):
            assert type(theirs[key]) is type(value) and str(theirs[key]) == str(value), key
        else:
            assert theirs[key] == value, key
