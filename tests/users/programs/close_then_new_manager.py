"""The way to a second manager: close the first (in TRAIN); the first refuses to switch afterwards, the new
one switches, and greedy tokens follow the model."""

import sys

import torch
from transformers import AutoModelForCausalLM

from hybridmem import PhaseError, ShardingManager
from hybridmem.engines import ReferenceEngine, SamplingParams

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
engine = ReferenceEngine(model.config)
first = ShardingManager(model, engine, optimizer=opt)
with first.inference():
    a = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids
first.close()
second = ShardingManager(model, engine, optimizer=opt)
with second.inference():
    b = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids
assert a == b, (a, b)
try:
    first.to_infer()
except PhaseError as exc:
    print(exc)
