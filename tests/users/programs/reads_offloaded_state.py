"""A user reads the training state inside ``with manager.inference()``, where hybridmem has moved its bytes
to host memory: logging a parameter's norm, saving a checkpoint, reading a gradient or AdamW's moments,
printing a parameter. Each must end in one error naming the tensor, not a signal (before, each read
freed memory: SIGSEGV).

``python reads_offloaded_state.py POLICY READ [fsdp]``: with ``fsdp`` the model is sharded with
``fully_shard`` (one rank, as torchrun would start it), so the parameters, gradients and AdamW's moments are
DTensors whose local shards hybridmem moved (before they were guarded too, the norm, the gradient and the
moment read freed memory: SIGSEGV, and the checkpoint saved freed memory without a word)."""

import io
import os
import socket
import sys

import torch
from transformers import AutoModelForCausalLM

from hybridmem import ShardingManager
from hybridmem.engines import ReferenceEngine

fsdp = sys.argv[3:] == ["fsdp"]
if fsdp:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    with socket.socket() as s:  # torchrun's variables for a world of one
        s.bind(("127.0.0.1", 0))
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(s.getsockname()[1]))
    dist.init_process_group("gloo")
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
if fsdp:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
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
