"""Misuse guards: touching the training model or optimizer outside TRAIN raises PhaseError, no crash.

Each case runs in a subprocess, so a segfault (what these calls did before the guards) fails the test
instead of killing the test run; the subprocess prints one line per case.
"""

from __future__ import annotations

import gc
import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

from hybridmem import Phase, PhaseError, ShardingManager
from hybridmem.engines import TorchCopyEngine
from hybridmem.testing.tiny import TinyNet, make_batch, train_step

SCRIPT = textwrap.dedent(
    """
    import torch
    from hybridmem import PhaseError, ShardingManager
    from hybridmem.engines import TorchCopyEngine
    from hybridmem.testing.tiny import TinyNet, make_batch, train_step

    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt, 0)
    mgr = ShardingManager(model, TorchCopyEngine(model), optimizer=opt)
    tokens, targets = make_batch(1, "cpu")

    def attempt(name, fn):
        try:
            fn()
        except PhaseError as e:
            print(f"{name}: PhaseError: {e}", flush=True)
        else:
            print(f"{name}: no error", flush=True)

    with mgr.inference():
        attempt("opt.step in INFER", opt.step)
        attempt("opt.zero_grad in INFER", opt.zero_grad)
        attempt("model.zero_grad in INFER", model.zero_grad)
        attempt("forward in INFER", lambda: model(tokens))
        attempt("submodule forward in INFER", lambda: model.fc1(torch.zeros(1, 32)))

    # A loss computed in TRAIN, then a switch back that fails: FAILED, training state partly on the host.
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    mgr.to_infer()
    grads = mgr.offloaders[next(k for k in mgr.offloaders if k.value == "grad")]
    real_onload = grads.onload
    def failing_onload():
        raise torch.OutOfMemoryError("injected")
    grads.onload = failing_onload
    try:
        mgr.to_train()
    except Exception as e:
        print(f"switch back: {type(e).__name__}; phase {mgr.phase.name}", flush=True)
    attempt("backward in FAILED", loss.backward)
    attempt("forward in FAILED", lambda: model(tokens))
    attempt("opt.step in FAILED", opt.step)
    grads.onload = real_onload
    mgr.recover()
    loss.backward()  # the graph is valid again: its saved tensors are back
    opt.step()
    print(f"after recover: phase {mgr.phase.name}, step ok", flush=True)
    """
)


def test_three_misuse_cases_raise_phase_error_in_a_subprocess_without_crashing():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, (
        f"exit {proc.returncode} (negative: killed by a signal)\n{out}\n{proc.stderr[-3000:]}")
    lines = dict(line.split(": ", 1) for line in out.splitlines())
    for case in ("opt.step in INFER", "opt.zero_grad in INFER", "model.zero_grad in INFER",
                 "forward in INFER", "submodule forward in INFER"):
        assert lines[case].startswith("PhaseError"), (case, out)
        assert "phase INFER" in lines[case] and "manager.inference()" in lines[case], (case, lines[case])
    assert lines["switch back"] == "SwitchError; phase FAILED", out
    for case in ("backward in FAILED", "forward in FAILED", "opt.step in FAILED"):
        assert lines[case].startswith("PhaseError"), (case, out)
        assert "phase FAILED" in lines[case] and "recover()" in lines[case], (case, lines[case])
    assert lines["after recover"] == "phase TRAIN, step ok", out


def test_guards_are_gone_in_train_and_training_is_unchanged():
    """In TRAIN nothing is installed: no hooks on modules, params or the optimizer, autograd untouched,
    and a run with switches trains exactly as one without."""
    gc.collect()  # managers other tests dropped outside TRAIN take their guards with them
    # torch's own, even if a dropped guard's check is still in.
    backward_before = inspect.unwrap(torch.autograd.backward)

    def run(switch: bool) -> list[float]:
        torch.manual_seed(1)
        model = TinyNet()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mgr = ShardingManager(model, TorchCopyEngine(model), optimizer=opt)
        losses = []
        for step in range(3):
            if switch:
                with mgr.inference():
                    assert torch.autograd.backward is not backward_before
            assert mgr.phase is Phase.TRAIN
            assert not any(m._forward_pre_hooks for m in model.modules())
            assert not any(p._backward_hooks for p in model.parameters())
            assert (not opt._optimizer_step_pre_hooks and "zero_grad" not in vars(opt)
                    and "step" not in vars(opt))
            assert "zero_grad" not in vars(model)
            assert torch.autograd.backward is backward_before
            losses.append(train_step(model, opt, step))
        return losses

    assert run(True) == run(False)


def test_phase_error_names_the_phase_of_the_manager_in_process():
    torch.manual_seed(0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    train_step(model, opt, 0)
    mgr = ShardingManager(model, TorchCopyEngine(model), optimizer=opt)
    with mgr.inference():
        with pytest.raises(PhaseError,
                           match="step the training optimizer: the manager is in phase INFER") as info:
            opt.step()
        assert info.value.current is Phase.INFER
        other = torch.nn.Linear(2, 2)  # modules outside the training model are not guarded
        other(torch.zeros(1, 2)).sum().backward()
    train_step(model, opt, 1)
    tokens, _ = make_batch(0, "cpu")
    assert model(tokens).shape[-1] == 50
