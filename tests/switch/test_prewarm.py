"""Host arenas prewarmed in the background (see [Note: prewarmed arenas] in
:mod:`hybridmem.offload.host_pool`): the first switch of a plain user loop finds its arenas ready, and
prewarming never gets in the way of a switch.

The per-step timings live in ``benchmarks/switch_latency.py``; these tests check what was allocated where,
through the pool's own report and the arenas' identity.
"""

from __future__ import annotations

import logging
import threading

import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hybridmem import ShardingManager
from hybridmem.accel import get_accelerator
from hybridmem.accel.cpu import CpuAccelerator
from hybridmem.offload.host_pool import HostBufferPool
from hybridmem.testing.tiny import assert_bitwise_equal, snapshot


def _user_model(tmp_path):
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 vocab_size=256)).save_pretrained(tmp_path)
    return AutoModelForCausalLM.from_pretrained(tmp_path)


def _step(model, opt, seed):
    batch = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed))
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def test_the_first_switch_of_a_user_loop_copies_into_prewarmed_arenas(tmp_path):
    model = _user_model(tmp_path)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # no state yet: AdamW creates it on the first step
    manager = ShardingManager(model, optimizer=opt)
    manager.pool.wait_prewarmed()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    assert {(a.owner, a.nbytes) for a in manager.pool.report()} == {("param", sum(storages.values()))}
    _step(model, opt, 0)  # grads and AdamW state appear; the optimizer's step hook prewarms their arenas
    manager.pool.wait_prewarmed()
    ready = {(a.owner, a.dtype): a for a in manager.pool.report()}
    assert {k[0] for k in ready} == {"param", "grad", "optimizer"}
    before = snapshot(model, opt)
    with manager.inference():
        pass
    after = {(a.owner, a.dtype): a for a in manager.pool.report()}
    assert after == ready  # same arenas, same sizes, no growth: the switch allocated no host memory
    assert all(a.num_grows == 1 for a in after.values())
    assert_bitwise_equal(before, snapshot(model, opt))


def test_a_switch_waits_for_the_arena_being_prewarmed_and_takes_it():
    release = threading.Event()

    class Slow(CpuAccelerator):
        def alloc_host(self, numel, dtype, *, pin):
            if threading.current_thread().name == "hybridmem-prewarm":  # only the prewarm is slow
                release.wait(5)
            return super().alloc_host(numel, dtype, pin=pin)

    pool = HostBufferPool(Slow())
    assert pool.prewarm([("param", torch.float32, 1000)]) == 4000
    got = []
    taker = threading.Thread(target=lambda: got.append(pool.arena("param", torch.float32, 1000)))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive()  # waiting for the key being prewarmed
    release.set()
    taker.join(5)
    assert got and got[0].numel() == 1000 and pool.report()[0].num_grows == 1
    assert not got[0].any()  # its pages were written (zeroed) by the prewarm


def test_prewarming_skips_what_it_must_not_do():
    pool = HostBufferPool(get_accelerator("cpu"), budget_nbytes=1000)
    # 4000 bytes over the budget: left to the switch
    assert pool.prewarm([("param", torch.float32, 1000)]) == 0
    pool.arena("grad", torch.float32, 10)
    pool.hold("grad")
    assert pool.prewarm([("grad", torch.float32, 100)]) == 0  # a held arena holds the only copy of some bytes
    assert pool.prewarm([("grad", torch.float32, 5)]) == 0  # large enough already
    assert pool.held_nbytes() == 40


def test_a_failed_prewarm_is_logged_and_the_switch_allocates(caplog):
    class Broken(CpuAccelerator):
        calls = 0

        def alloc_host(self, numel, dtype, *, pin):
            Broken.calls += 1
            if Broken.calls == 1:
                raise MemoryError("no host memory for the prewarm")
            return super().alloc_host(numel, dtype, pin=pin)

    pool = HostBufferPool(Broken())
    with caplog.at_level(logging.WARNING, logger="hybridmem.offload.host_pool"):
        pool.prewarm([("param", torch.float32, 10)])
        assert pool.wait_prewarmed(5)
    assert "prewarming host arena param/torch.float32 failed" in caplog.text
    assert pool.report() == []
    assert pool.arena("param", torch.float32, 10).numel() == 10
