"""Tensors on storages torch cannot resize, made the ways users' code makes them.

Each kind copies a tensor's values into a storage of that kind: a memory-mapped safetensors file (what
``from_pretrained`` leaves parameters on when it loads on the CPU), a NumPy array (``from_numpy``), a
Python buffer (``frombuffer``), a DLPack capsule, and CPU shared memory (``share_memory_``). Which
storages torch refuses to resize is checked by the tests against torch itself, not assumed here.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["KINDS", "foreign_copy", "rehost", "make_foreign"]

KINDS = ("safetensors-mmap", "numpy", "frombuffer", "dlpack", "shared-memory")


def foreign_copy(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """A tensor with ``tensor``'s values, shape and dtype on a storage of ``kind``."""
    src = tensor.detach().contiguous()
    if kind == "safetensors-mmap":
        path = os.path.join(tempfile.mkdtemp(prefix="hybridmem-foreign-"), "t.safetensors")
        save_file({"t": src.clone()}, path)
        with safe_open(path, "pt") as f:
            return f.get_tensor("t")
    if kind == "numpy":
        if src.dtype == torch.bfloat16:  # NumPy has no bfloat16: carry the bits
            return torch.from_numpy(src.view(torch.int16).numpy().copy()).view(torch.bfloat16)
        return torch.from_numpy(src.numpy().copy())
    if kind == "frombuffer":
        raw = bytearray(src.view(torch.uint8).reshape(-1).numpy().tobytes())
        return torch.frombuffer(raw, dtype=src.dtype).reshape(src.shape)
    if kind == "dlpack":
        return (torch.from_dlpack(np.array(src.view(torch.uint8).reshape(-1).numpy()))
                .view(src.dtype).reshape(src.shape))
    if kind == "shared-memory":
        return src.clone().share_memory_()
    raise ValueError(f"kind={kind!r}; known: {KINDS}")


def rehost(tensor: torch.Tensor, kind: str) -> None:
    """Put ``tensor`` (a parameter or buffer, kept as the same object) on a ``kind`` storage."""
    foreign = foreign_copy(tensor, kind)
    with torch.no_grad():
        tensor.set_(foreign.untyped_storage(), foreign.storage_offset(), foreign.shape, foreign.stride())


def rehost_together(tensors: list[torch.Tensor], kind: str) -> None:
    """Put ``tensors`` (one dtype) side by side on one storage of ``kind``, each kept as the same object."""
    flat = foreign_copy(torch.cat([t.detach().reshape(-1) for t in tensors]), kind)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.set_(flat.untyped_storage(), offset, t.shape, t.stride())
            offset += t.numel()


def make_foreign(model: torch.nn.Module, opt: torch.optim.Optimizer, kinds: tuple[str, ...] = KINDS) -> None:
    """Put every parameter, buffer and optimizer-state tensor (but the 0-d step counters) of ``model``
    and ``opt`` on foreign storages, cycling through ``kinds``; the first two parameters share one."""
    tensors = [*model.parameters(), *model.buffers()]  # a tied weight is one parameter: rehosted once
    rehost_together(tensors[:2], kinds[0])
    for i, t in enumerate(tensors[2:], start=1):
        rehost(t, kinds[i % len(kinds)])
    i = len(tensors)
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = foreign_copy(value, kinds[i % len(kinds)])
                i += 1
