"""A user reads the training state inside ``with manager.inference()``, where hybridmem has moved its bytes
to host memory: logging a parameter's norm, saving a checkpoint, reading a gradient or AdamW's moments,
printing a parameter. Each must end in one error naming the tensor, not a signal (before, each read
freed memory: SIGSEGV)."""

import io
import sys

import torch
from transformers import AutoModelForCausalLM

from hybridmem import ShardingManager
from hybridmem.engines import ReferenceEngine

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
ids = torch.tensor([[1, 2, 3, 4]])
model(input_ids=ids, labels=ids).loss.backward()
opt.step()  # AdamW's moments exist; the gradients are kept (no zero_grad)
manager = ShardingManager(model, ReferenceEngine(model.config), optimizer=opt)
reads = {
    "param_norm": lambda: sum(p.norm() for p in model.parameters()),
    "checkpoint": lambda: torch.save(model.state_dict(), io.BytesIO()),
    "grad": lambda: next(model.parameters()).grad.abs().max(),
    "optimizer": lambda: next(iter(opt.state.values()))["exp_avg"].sum(),
    "print": lambda: print(next(model.parameters())),
}
with manager.inference():
    print("shape", tuple(next(model.parameters()).shape))  # what reads no bytes still answers
    reads[sys.argv[2]]()
print("unreachable")
