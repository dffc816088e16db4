"""Independent references for HF-named sources: FSDP2's row split (``torch.chunk``), transformers 5's
fused experts (plain indexing), and the bytes each rank lacks, counted from element ids.

Written without hybridmem.reshard's pieces or plan.
"""

from __future__ import annotations

import torch

from tests.reshard.reference import vllm_shard


def chunk_rows(n: int, shards: int) -> list[tuple[int, int]]:
    """Rows of each shard as ``torch.chunk`` (FSDP2's ``_chunk_with_empty``) cuts them, padded with empty."""
    out, start = [], 0
    for c in torch.arange(n).chunk(shards):
        out.append((start, start + len(c)))
        start += len(c)
    return out + [(n, n)] * (shards - len(out))


def fsdp_local(t: torch.Tensor, shard: int, shards: int) -> torch.Tensor:
    """What FSDP2 leaves on mesh coordinate ``shard`` of ``t`` (a full tensor)."""
    lo, hi = chunk_rows(t.shape[0], shards)[shard]
    return t[lo:hi]


def unfused(module: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused experts (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) as per-expert
    checkpoint tensors; other tensors unchanged."""
    full = {}
    for name, t in module.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, half = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                full[f"{prefix}{e}.gate_proj.weight"] = t[e, :half]
                full[f"{prefix}{e}.up_proj.weight"] = t[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                full[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            full[name] = t
    return full


def fused(full: dict[str, torch.Tensor], module_names) -> dict[str, torch.Tensor]:
    """The inverse of :func:`unfused` for the module tensor names ``module_names``."""
    out = {}
    for name in module_names:
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            prefix = name.rsplit(".", 1)[0] + "."
            num = len([k for k in full if k.startswith(prefix) and k.endswith(".down_proj.weight")])
            if name.endswith("gate_up_proj"):
                out[name] = torch.stack([torch.cat([full[f"{prefix}{e}.gate_proj.weight"],
                                                    full[f"{prefix}{e}.up_proj.weight"]])
                                         for e in range(num)])
            else:
                out[name] = torch.stack([full[f"{prefix}{e}.down_proj.weight"] for e in range(num)])
        else:
            out[name] = full[name]
    return out


def element_ids(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Every element of the model a distinct float64 id from 1 (0 marks padding)."""
    out, start = {}, 1
    for name, shape in shapes.items():
        n = torch.Size(shape).numel()
        out[name] = torch.arange(start, start + n, dtype=torch.float64).reshape(shape)
        start += n
    return out


def fsdp_to_vllm_lacking(spec, module_names, *, world: int, shards: int, tp: int,
                         replicated=frozenset()) -> list[int]:
    """Per rank, the elements of its vLLM TP ``tp`` shards it does not hold under FSDP2 over ``shards``
    ranks (``replicated`` module tensors whole everywhere)."""
    ids = element_ids(spec.full_shapes())
    module_ids = fused(ids, module_names)
    out = []
    for rank in range(world):
        held = set()
        for name, t in module_ids.items():
            mine = t if name in replicated else fsdp_local(t, rank % shards, shards)
            held.update(mine.flatten().tolist())
        want = vllm_shard(ids, spec, tp=tp, pp=1, ep=1, world=world, rank=rank)
        need = {v for t in want.values() for v in t.flatten().tolist()} - {0.0}
        out.append(len(need - held))
    return out
