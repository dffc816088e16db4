"""Real signals at random moments of switches: held until the step ends, rolled back or finished, re-raised.

A subprocess switches a larger model back and forth while a thread waits for a switch to start (TRAIN->INFER
and INFER->TRAIN in turn, so both are hit whatever the machine's speed) and sends SIGINT (``os.kill`` to
its own process) after a random delay. Whatever moment the signal lands
at, the phase after the switch is TRAIN and the training state is bitwise what it was; the
``KeyboardInterrupt`` comes out of the switch (not from inside a step). A second script checks SIGTERM
with a handler of the program's own (a graceful-shutdown flag): the switch is stopped, rolled back,
and the handler runs once. A user's loop stopped with Ctrl-C in either switch (``_interrupted_program.py``)
ends in the interrupt's traceback, under one line saying what became of the switch and the training state.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SIGINT_SCRIPT = textwrap.dedent(
    """
    import os, random, signal, threading, time
    import torch
    from hybridmem import Phase, ShardingManager
    from hybridmem.engines import TorchCopyEngine
    from hybridmem.testing.tiny import assert_bitwise_equal, snapshot

    # Python's own SIGINT handler even where this process inherited SIGINT ignored (a background job of
    # a non-interactive shell): Python then installs none, and the signals below would raise nothing.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(384, 384) for _ in range(12)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 384)).sum().backward()
    opt.step()
    before = snapshot(model, opt)
    mgr = ShardingManager(model, TorchCopyEngine(model, kv_cache_nbytes=1 << 20), optimizer=opt)
    rng = random.Random(1234)
    counts = {"to_infer": 0, "to_train": 0, "outside": 0}

    def killer(target, delay):
        # Wait for the switch of this iteration's direction, whatever the machine's speed, then a random
        # moment inside it (or, if it ends first, just after it).
        deadline = time.monotonic() + 5.0
        while mgr.phase is not target and time.monotonic() < deadline:
            time.sleep(0.0001)
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGINT)

    for i in range(int(os.environ["NUM_ITERS"])):
        target = Phase.TO_INFER if i % 2 == 0 else Phase.TO_TRAIN
        t = threading.Thread(target=killer, args=(target, rng.uniform(0.0, 0.004)))
        t.start()
        where = "to_infer"
        try:
            mgr.to_infer()
            assert mgr.phase is Phase.INFER
            where = "outside"
            time.sleep(0.001)  # between the switches: a KeyboardInterrupt here is the program's to handle
            where = "to_train"
            mgr.to_train()
            where = "outside"
            t.join()
            time.sleep(0.05)  # a signal sent after the switches is raised here
        except KeyboardInterrupt:
            counts[where] += 1
        t.join()
        if where == "to_infer":  # interrupted TRAIN->INFER: rolled back
            assert mgr.phase is Phase.TRAIN, (i, mgr.phase)
        if mgr.phase is Phase.INFER:  # the interrupt came between the switches
            mgr.to_train()
        assert mgr.phase is Phase.TRAIN, (i, mgr.phase)
        assert_bitwise_equal(before, snapshot(model, opt))
    print("COUNTS", counts, flush=True)
    """
)

SIGTERM_SCRIPT = textwrap.dedent(
    """
    import os, signal, threading, time
    import torch
    from hybridmem import Phase, ShardingManager, SwitchError
    from hybridmem.engines import TorchCopyEngine
    from hybridmem.testing.tiny import assert_bitwise_equal, snapshot

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    before = snapshot(model, opt)
    mgr = ShardingManager(model, TorchCopyEngine(model), optimizer=opt)
    seen = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    real_offload = mgr.offloaders[next(iter(mgr.offloaders))].__class__.offload

    def offload_then_signal(self):
        stats = real_offload(self)
        os.kill(os.getpid(), signal.SIGTERM)  # arrives inside the first step
        time.sleep(0.01)
        return stats

    type(mgr.offloaders[next(iter(mgr.offloaders))]).offload = offload_then_signal
    try:
        mgr.to_infer()
    except SwitchError as e:
        print("SwitchError", e.step, mgr.phase.name, flush=True)
    type(mgr.offloaders[next(iter(mgr.offloaders))]).offload = real_offload
    print("handler calls", seen, flush=True)
    assert mgr.phase is Phase.TRAIN
    assert_bitwise_equal(before, snapshot(model, opt))
    print("state intact", flush=True)
    """
)


def _run(script: str, **env: str) -> str:
    import os

    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_sigint_at_random_moments_of_large_switches_loses_nothing():
    out = _run(SIGINT_SCRIPT, NUM_ITERS="40")
    counts = eval(out.split("COUNTS ", 1)[1])  # our own subprocess's dict literal
    # Signals really landed inside switches in both directions (not only between them).
    print("signals landed in", counts)
    assert counts["to_infer"] >= 3 and counts["to_train"] >= 3, counts
    assert sum(counts.values()) == 40, counts  # every signal surfaced exactly once


def test_sigterm_with_a_program_handler_stops_the_switch_and_runs_the_handler_once():
    out = _run(SIGTERM_SCRIPT)
    assert "SwitchError (between steps) TRAIN" in out, out
    assert "handler calls [15]" in out, out
    assert "state intact" in out, out


INTERRUPTED = Path(__file__).with_name("_interrupted_program.py")
SAID = {
    "to_infer": "hybridmem: Ctrl-C (SIGINT) during the switch to INFER: it was rolled back; phase TRAIN, the "
                "training state is intact on the device",
    "to_train": "hybridmem: Ctrl-C (SIGINT) during the switch to TRAIN: it finished first; phase TRAIN, the "
                "training state is intact on the device",
}


@pytest.mark.parametrize("during", ["to_infer", "to_train"])
def test_ctrl_c_during_a_switch_says_in_one_line_what_became_of_it_before_the_traceback(during):
    """A user's training loop, its own process, Ctrl-C (SIGINT to it) while a switch runs: it ends with the
    interrupt's traceback and exit status, and the one line above the traceback says the switch was rolled
    back (or finished) and the training state is intact, which the program then checks bit for bit."""
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen([sys.executable, str(INTERRUPTED), during], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": root},
                            # Python's own SIGINT handling, even under a runner that ignores SIGINT
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline() == "switching\n", proc.stderr.read()[-3000:]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGINT, (proc.returncode, err[-3000:])
    lines = err.splitlines()
    assert [line for line in lines if line.startswith("hybridmem:")] == [SAID[during]], err[-3000:]
    assert lines.index(SAID[during]) < lines.index("Traceback (most recent call last):"), err[-3000:]
    assert lines[-1] == "KeyboardInterrupt", err[-3000:]
    assert ("after Ctrl-C: phase TRAIN, training state bitwise as before the switch, the next switch went "
            "through") in out, (out, err[-3000:])
