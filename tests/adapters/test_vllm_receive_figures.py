"""The worker's check of a received tensor: the figures its copies took on the way
(:func:`~hybridmem.reshard.checksum.copy_checksum`) stand for the tensor only while the module holds the
memory they wrote; where it holds other memory, what it holds is read again. The trainer's figures are
:func:`~hybridmem.reshard.checksum.tensor_checksum` of the tensor it sent; a bucket damaged after they were
taken, or a module holding rows in other places, is refused naming the tensor.

:class:`StreamUpdate` driven by hand (steps 2 and 3 of [Note: vllm transfer backend] in
:mod:`hybridmem.adapters.vllm.server.transfer`), with and without the one-pass CPU kernel.
"""

from __future__ import annotations

import pytest
import torch

from hybridmem.adapters.vllm.server.receive import StreamUpdate
from hybridmem.reshard import fused_checksum
from hybridmem.reshard.checksum import tensor_checksum

LAYOUT = {"w": ((6, 40), torch.float32)}
SENT = torch.randint(-50, 50, (6, 40), generator=torch.Generator().manual_seed(4)).to(torch.float32)
"""Whole numbers: exchanged rows leave the plain sum exactly as it was."""


class _Remade(StreamUpdate):
    """A destination whose module holds other memory than its copies wrote into (a module re-made between
    its last copy and its check)."""

    def __init__(self, holds: torch.Tensor):
        super().__init__(LAYOUT, run="r", verify=True, who="vLLM worker rank 0",
                         tensors={"w": torch.empty(6, 40)})
        self.holds = holds

    def held(self, name: str) -> torch.Tensor:
        return self.holds


def _receive(update: StreamUpdate, bucket_values: torch.Tensor, split: int = 100) -> None:
    """Two bucket messages carrying ``bucket_values`` (split at element ``split``), each copied then checked
    with the figures the trainer took of :data:`SENT`."""
    flat = bucket_values.reshape(-1)
    figures = {"w": list(tensor_checksum(SENT))}
    for lo, hi in ((0, split), (split, flat.numel())):
        bucket = torch.zeros(4096, dtype=torch.uint8)
        bucket[:(hi - lo) * 4].view(torch.float32).copy_(flat[lo:hi])
        entries = [{"name": "w", "dtype": "float32", "shape": [6, 40], "start": lo * 4, "end": hi * 4,
                    "offset": 0}]
        update.copy(bucket, entries)
        update.completed(entries, figures if hi == flat.numel() else {})


@pytest.fixture(params=["one-pass", "copy-then-read"])
def kernel(request, monkeypatch):
    if request.param == "one-pass":
        pytest.importorskip("numba")
    else:
        monkeypatch.setattr(fused_checksum, "_kernel", lambda: None)


def test_what_was_sent_is_taken(kernel):
    dest = {"w": torch.empty(6, 40)}
    update = StreamUpdate(LAYOUT, run="r", verify=True, who="vLLM worker rank 0", tensors=dest)
    _receive(update, SENT)
    assert update.complete == ["w"] and torch.equal(dest["w"], SENT)
    assert update.checksum_s == 0.0  # taken by the copies: no read of their own


def test_a_bucket_damaged_after_the_figures_is_refused(kernel):
    damaged = SENT.clone()
    damaged[3, 7] += 1
    update = StreamUpdate(LAYOUT, run="r", verify=True, who="vLLM worker rank 0",
                          tensors={"w": torch.empty(6, 40)})
    with pytest.raises(ValueError, match=r"staged tensor w reads \(sum, weighted\)"):
        _receive(update, damaged)


def test_a_module_holding_other_memory_is_read_again(kernel):
    update = _Remade(SENT.clone())  # other memory, the same values: taken, after a read of its own
    _receive(update, SENT)
    assert update.complete == ["w"] and update.checksum_s > 0.0
    exchanged = SENT.clone()
    exchanged[[1, 2]] = exchanged[[2, 1]]
    update = _Remade(exchanged)  # other memory, two rows exchanged: the copies' own figures would pass
    with pytest.raises(ValueError, match=r"staged tensor w reads \(sum, weighted\)"):
        _receive(update, SENT)
