"""A second manager on the model and optimizer a live manager holds, then a switch of each: the second
must be refused at construction (before, the second switch read storages the first had freed: SIGSEGV)."""

import sys

import torch
from transformers import AutoModelForCausalLM

from hybridmem import ShardingManager
from hybridmem.engines import ReferenceEngine

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
m1 = ShardingManager(model, ReferenceEngine(model.config), optimizer=opt)
m2 = ShardingManager(model, ReferenceEngine(model.config), optimizer=opt)
m1.to_infer()
m2.to_infer()
print("both switched")
