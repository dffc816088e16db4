"""Module-level tasks run in WorkerPool processes by test_layout_stream.py (must be importable by spawn), and
the allocation spy they measure with."""

from __future__ import annotations

import itertools
import weakref

import torch

from hybridmem.reshard import build_plan, hf_layout, megatron_layout, vllm_layout
from hybridmem.reshard.execute import iter_full_tensors, iter_layout_tensors
from tests.reshard.reference import megatron_shard, random_full


class AllocationSpy:
    """Every tensor ``torch.empty`` / ``torch.zeros`` make while it is active: when it was made and freed.

    Which of them are destination tensors is known only once they are yielded (:meth:`mark`); the peak is
    then replayed over those alone (:meth:`peak_nbytes`), so staging buffers do not count.
    """

    def __init__(self):
        self._ids = itertools.count()
        self._token_of: dict[int, int] = {}
        self.events: list[tuple[str, int, int]] = []
        self.marked: set[int] = set()

    def __enter__(self) -> AllocationSpy:
        self._real = torch.empty, torch.zeros
        torch.empty, torch.zeros = (self._spying(f) for f in self._real)
        return self

    def __exit__(self, *exc) -> None:
        torch.empty, torch.zeros = self._real

    def _spying(self, make):
        def spied(*args, **kwargs):
            tensor = make(*args, **kwargs)
            token = next(self._ids)
            self._token_of[id(tensor)] = token
            self.events.append(("alloc", token, tensor.numel() * tensor.element_size()))
            weakref.finalize(tensor, self._freed, id(tensor), token)
            return tensor
        return spied

    def _freed(self, key: int, token: int) -> None:
        self.events.append(("free", token, 0))
        if self._token_of.get(key) == token:
            del self._token_of[key]

    def mark(self, tensor: torch.Tensor) -> None:
        """``tensor`` (alive now) is a destination tensor."""
        self.marked.add(self._token_of[id(tensor)])

    def peak_nbytes(self) -> int:
        """The most bytes of marked tensors alive at once."""
        alive, peak, sizes = 0, 0, {}
        for kind, token, nbytes in self.events:
            if token not in self.marked:
                continue
            if kind == "alloc":
                sizes[token] = nbytes
                alive += nbytes
            else:
                alive -= sizes.pop(token)
            peak = max(peak, alive)
        return peak


def stream(spec, src, dst, *, rank, world, group, bucket, hf=False, out_dtype=None, seed=0, borrow=False):
    """Run the stream of ``rank``'s destination tensors of ``dst`` (vLLM's layout, or HF's with ``hf``) from
    the reference Megatron shards of ``src``; returns ``(full, names in order, {name: copy}, peak bytes of
    destination tensors alive at once)``, with ``borrow`` also the names of the tensors yielded as a training
    tensor itself. The copies are ``clone()``s, which the spy does not see; nothing
    keeps a yielded tensor once the next is asked for."""
    full = random_full(spec, seed=seed)
    train = megatron_shard(full, spec, tp=src.tp, pp=src.pp, ep=src.ep, world=world, rank=rank)
    layout = (hf_layout if hf else vllm_layout)(spec, dst, world)
    plan = build_plan(megatron_layout(spec, src, world), layout, itemsize=4, bucket_nbytes=bucket,
                      rank=rank)
    names, got, lent = [], {}, []
    with AllocationSpy() as spy:
        if hf:
            tensors = iter_full_tensors(plan, rank=rank, src=train, group=group, dtype=torch.float32)
        else:
            tensors = iter_layout_tensors(plan, rank=rank, src=train, group=group, dtype=torch.float32,
                                          out_dtype=out_dtype, borrow=borrow)
        sources = {t.data_ptr() for t in train.values()}
        for name, tensor in tensors:
            if tensor.data_ptr() in sources:  # lent (borrow): the training tensor itself, never allocated
                lent.append(name)
            else:
                spy.mark(tensor)
            names.append(name)
            got[name] = tensor.clone()
            del tensor
        del tensors
    return (full, names, got, spy.peak_nbytes(), lent) if borrow else (full, names, got, spy.peak_nbytes())


def stream_task(ctx, spec, src, dst, bucket, **kwargs):
    return stream(spec, src, dst, rank=ctx.rank, world=ctx.world_size, group=ctx.group, bucket=bucket,
                  **kwargs)
