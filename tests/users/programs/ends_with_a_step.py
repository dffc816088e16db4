"""A training script whose last statements are a switch and an optimizer step (the step schedules the
host arenas' prewarming in the background): it must exit 0 after its last line."""

import sys

import torch
from transformers import AutoModelForCausalLM

from hybridmem import ShardingManager
from hybridmem.engines import ReferenceEngine, SamplingParams

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
manager = ShardingManager(model, ReferenceEngine(model.config), optimizer=opt)
with manager.inference() as engine:
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
ids = torch.tensor([out[0].prompt_ids + out[0].token_ids])
model(input_ids=ids, labels=ids).loss.backward()
opt.step()
print("last line")
