"""A training loop its user stops with Ctrl-C while a switch runs (``test_signals.py`` runs it).

``python _interrupted_program.py to_infer|to_train``: the engine is slow to take its weights back
(``to_infer``, as a large vLLM waking on a busy node) or to let them go (``to_train``). Inside that step it
prints ``switching`` and waits, at most 10 s, until the switch holds a SIGINT (the test's Ctrl-C). When the
``KeyboardInterrupt`` comes, the program checks what its user would (the phase, the training state bit for
bit against a copy taken before the switch, a next switch) and prints it, then lets the interrupt end it
with its traceback, as a program that does not catch it ends.
"""

from __future__ import annotations

import signal
import sys
import time

import torch

from hybridmem import ShardingManager
from hybridmem.engines import TorchCopyEngine
from hybridmem.testing.tiny import TinyNet, assert_bitwise_equal, snapshot, train_step


class SlowEngine(TorchCopyEngine):
    """A :class:`TorchCopyEngine` whose next resume (or release) takes until a SIGINT is held."""

    slow: str | None = None

    def resume(self, tags):
        self._wait("to_infer")
        super().resume(tags)

    def release(self, tags):
        self._wait("to_train")
        super().release(tags)

    def _wait(self, during: str) -> None:
        if self.slow != during:
            return
        self.slow = None
        print("switching", flush=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not getattr(signal.getsignal(signal.SIGINT), "__self__", None):
            time.sleep(0.01)  # the switch holds SIGINT from its start: the handler is its recorder
        recorder = signal.getsignal(signal.SIGINT).__self__
        while time.monotonic() < deadline and not recorder.pending:
            time.sleep(0.01)


def main(during: str) -> None:
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = SlowEngine(model, kv_cache_nbytes=1 << 16)
    manager = ShardingManager(model, engine, optimizer=optimizer)
    try:
        for step in range(3):
            train_step(model, optimizer, step)
            before = snapshot(model, optimizer)
            if step == 2 and during == "to_infer":
                engine.slow = "to_infer"
            with manager.inference() as served:
                served(torch.zeros(1, 4, dtype=torch.long))  # a rollout stands here
                if step == 2 and during == "to_train":
                    engine.slow = "to_train"
    except KeyboardInterrupt:
        assert_bitwise_equal(before, snapshot(model, optimizer))
        with manager.inference():
            pass
        assert_bitwise_equal(before, snapshot(model, optimizer))
        print(f"after Ctrl-C: phase {manager.phase.name}, training state bitwise as before the switch, the "
              "next switch went through", flush=True)
        raise


if __name__ == "__main__":
    main(sys.argv[1])
