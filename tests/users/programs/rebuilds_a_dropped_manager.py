"""A manager the user dropped (built inside a function that returned) lets its model go to the next one,
while another thread of the program collects garbage, as a logger, a data loader or an engine's output
thread does. On CPython 3.11 the main thread's gc.collect() is a no-op while that thread's collection runs
finalizers; the dropped manager, in reference cycles, waits for a collection."""

import gc
import sys
import threading
import weakref

import torch
from transformers import AutoModelForCausalLM

from hybridmem import ShardingManager
from hybridmem.engines import ReferenceEngine, SamplingParams


class _Record:
    pass


def _finalize() -> None:
    sum(range(5_000))  # Python code: the interpreter may hand the GIL over mid-collection


stop = threading.Event()


def background() -> None:
    while not stop.is_set():
        a, b = _Record(), _Record()
        a.b, b.a = b, a
        weakref.finalize(a, _finalize)
        del a, b
        gc.collect(0)


model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
engine = ReferenceEngine(model.config)


def rollout() -> list[int]:
    manager = ShardingManager(model, engine, optimizer=opt)
    with manager.inference():
        return engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids


thread = threading.Thread(target=background, daemon=True)
thread.start()
tokens = [rollout() for _ in range(2)]
stop.set()
thread.join()
assert tokens[0] == tokens[1], tokens
print("two managers, one after another")
