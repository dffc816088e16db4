"""Tensors built right in their transfer bucket: the stream of a weight sync (``iter_layout_tensors`` with
``target``) builds each tensor of local cells alone in the bucket bytes :meth:`BucketWriter.reserve` gives,
and the writer sends it from there without a copy; a tensor larger than a bucket that is one training tensor
as it lies is handed over as that tensor (``borrow``); what the worker writes is still the reference shard.

The real pieces of the transport in one process, without vLLM (``tests/adapters/_transport.py``), and the
trainer rank's :class:`BucketWriter`. The
reference is ``tests.reshard.reference.vllm_shard`` of the same random HF-full tensors (written apart from
the plan code).
"""

from __future__ import annotations

import pytest
import torch

from hybridmem.adapters.vllm.server.packing import BucketWriter
from hybridmem.config import ParallelLayout
from hybridmem.reshard import ModelSpec, build_plan, megatron_layout, vllm_layout
from hybridmem.reshard.execute import iter_layout_tensors
from tests.adapters._transport import start_transport
from tests.reshard.reference import megatron_shard, random_full, vllm_shard

RUN = "hybridmem-run-packing"
WAIT_S = 20.0
SPEC = ModelSpec(family="qwen2", hidden_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                 intermediate_size=48, num_hidden_layers=2, vocab_size=128, qkv_bias=True)
BUCKET_NBYTES = 4096
"""Larger than every norm, bias and the fused q/k/v (16 x 32 fp32: 2 KiB), smaller than the embedding and
the head (128 x 16: 8 KiB, no padding rows: each one training tensor as it lies) and the fused gate/up
(96 x 16: 6 KiB, two training tensors)."""


def test_tensors_built_in_their_bucket_reach_the_worker_as_the_reference_shard(shm_directory):
    full = random_full(SPEC, seed=3)
    src = megatron_shard(full, SPEC, tp=1, pp=1, ep=1, world=1, rank=0)
    want = vllm_shard(full, SPEC, tp=1, pp=1, ep=1, world=1, rank=0)
    plan = build_plan(megatron_layout(SPEC, ParallelLayout(), 1), vllm_layout(SPEC, ParallelLayout(), 1),
                      itemsize=4, bucket_nbytes=1 << 20, rank=0)
    layout = {name: (tuple(t.shape), t.dtype) for name, t in want.items()}
    dest = {name: torch.full(shape, -7.0, dtype=dtype) for name, (shape, dtype) in layout.items()}
    transport = start_transport(shm_directory, layout, dest, run=RUN, bucket_nbytes=BUCKET_NBYTES,
                                wait_s=WAIT_S)
    buckets, raised = transport.buckets, transport.raised
    try:
        conn = transport.listener.accept(timeout_s=WAIT_S)
        writer = BucketWriter(buckets, conn, layout, run=RUN, verify=True, ack_timeout_s=WAIT_S)
        yielded = {}
        for name, tensor in iter_layout_tensors(plan, rank=0, src=src, target=writer.reserve, borrow=True):
            yielded[name] = tensor.data_ptr()
            writer.put(name, tensor)
        stats = writer.finish()
        transport.thread.join(WAIT_S)
        bucket_spans = [(v.data_ptr(), v.data_ptr() + BUCKET_NBYTES) for v in buckets.views]
    finally:
        transport.close()
    assert not raised, raised
    for name, tensor in want.items():
        assert torch.equal(dest[name], tensor), name
    fits = {name for name, t in want.items() if t.numel() * t.element_size() <= BUCKET_NBYTES}
    assert {"model.embed_tokens.weight", "model.layers.0.mlp.gate_up_proj.weight"}.isdisjoint(fits)
    assert "model.layers.0.self_attn.qkv_proj.weight" in fits
    assert stats.num_in_place == len(fits) and stats.num_tensors == len(want)
    in_a_bucket = {n for n, ptr in yielded.items() if any(lo <= ptr < hi for lo, hi in bucket_spans)}
    assert in_a_bucket == fits
    lent = {n for n, ptr in yielded.items() if ptr in {t.data_ptr() for t in src.values()}}
    assert lent == {"model.embed_tokens.weight", "lm_head.weight"}


def test_a_reserved_tensor_must_be_the_next_one_given(shm_directory):
    layout = {"a": ((8,), torch.float32), "b": ((8,), torch.float32)}
    dest = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in layout.items()}
    transport = start_transport(shm_directory, layout, dest, run=RUN, bucket_nbytes=BUCKET_NBYTES,
                                wait_s=WAIT_S)
    try:
        conn = transport.listener.accept(timeout_s=WAIT_S)
        writer = BucketWriter(transport.buckets, conn, layout, run=RUN, verify=False, ack_timeout_s=WAIT_S)
        assert writer.reserve("a", (8,), torch.float64) is None  # another dtype: built elsewhere
        assert writer.reserve("a", (9,), torch.float32) is None  # another shape
        assert writer.reserve("c", (8,), torch.float32) is None  # not in the layout
        writer.reserve("a", (8,), torch.float32).fill_(1.0)
        with pytest.raises(RuntimeError, match="reserved bucket bytes for a and then gave b"):
            writer.put("b", torch.ones(8))
        writer.abandon()
        transport.thread.join(WAIT_S)
    finally:
        transport.close()
    assert transport.update.complete == [] and all(torch.equal(t, torch.zeros(8)) for t in dest.values())
