"""ReferenceEngine in one process (TP1): memory tags and byte counts, errors, KV block scheduling,
stop tokens, scoring; CUDA variants skip without a GPU."""

from __future__ import annotations

import os

import pytest
import torch
from engine_cases import MAX_TOKENS, PROMPTS, build_hf, greedy, hf_logprobs

from hybridmem.accel import get_accelerator
from hybridmem.accel.base import MemoryFigures
from hybridmem.engines import ReferenceEngine, SamplingParams
from hybridmem.engines.reference import KVBlocksExhaustedError, param_shapes
from hybridmem.errors import PhaseError

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def qwen():
    return build_hf("qwen2_gqa_bias")


def _engine(config, model, **kwargs) -> ReferenceEngine:
    kwargs.setdefault("num_kv_blocks", 32)
    kwargs.setdefault("block_size", 4)
    engine = ReferenceEngine(config, **kwargs)
    engine.load_weights(model.state_dict().items())
    return engine


def _hf_greedy(model, prompt, n=MAX_TOKENS):
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_byte_counts_follow_the_formulas(qwen):
    config, model = qwen
    engine = _engine(config, model, num_kv_blocks=10, block_size=8)
    c = config
    d = c.hidden_size // c.num_attention_heads
    kv_nbytes = c.num_hidden_layers * 2 * 10 * 8 * c.num_key_value_heads * d * 4
    weight_nbytes = 4 * sum(torch.Size(s).numel() for s in param_shapes(engine.shard).values())
    assert engine.planned_nbytes("kv_cache") == engine.resident_nbytes("kv_cache") == kv_nbytes
    assert engine.planned_nbytes("weights") == engine.resident_nbytes("weights") == weight_nbytes
    # The HF model minus the padding: vocab 250 padded to 256 rows, embedding and LM head.
    hf_nbytes = sum(p.numel() for p in model.parameters()) * 4
    assert weight_nbytes == hf_nbytes + 2 * (256 - 250) * c.hidden_size * 4
    engine.release(["kv_cache"])
    assert engine.resident_nbytes("kv_cache") == 0 and engine.kv_allocator.resident_nbytes() == 0
    assert engine.resident_nbytes("weights") == weight_nbytes
    engine.release(["weights"])
    engine.release(["weights"])  # a second release is a no-op
    assert engine.resident_nbytes("weights") == 0
    engine.resume(["weights", "kv_cache"])
    assert engine.resident_nbytes("weights") == weight_nbytes
    assert engine.resident_nbytes("kv_cache") == kv_nbytes


def test_generate_when_released_names_the_state(qwen):
    config, model = qwen
    engine = _engine(config, model)
    engine.release(["weights"])
    with pytest.raises(PhaseError, match="RELEASED.*'weights'"):
        engine.generate(PROMPTS, greedy())
    with pytest.raises(PhaseError, match="RELEASED"):
        engine.load_weights(model.state_dict().items())
    engine.resume(["weights"])
    engine.release(["kv_cache"])
    with pytest.raises(PhaseError, match="RELEASED.*'kv_cache'"):
        engine.generate(PROMPTS, greedy())


def test_bad_tags_are_refused(qwen):
    engine = _engine(*qwen)
    with pytest.raises(ValueError, match="'optimizer'"):
        engine.release(["optimizer"])
    with pytest.raises(TypeError, match="string"):
        engine.resume("weights")


def test_weights_resume_failure_releases_again(qwen, monkeypatch):
    engine = _engine(*qwen)
    engine.release(["weights", "kv_cache"])

    def fail():
        raise MemoryError("no room for the KV pool")

    monkeypatch.setattr(engine.kv_allocator, "resume", fail)
    with pytest.raises(MemoryError, match="no room"):
        engine.resume(["weights", "kv_cache"])
    assert engine.resident_nbytes("weights") == 0 and engine.state("weights").name == "RELEASED"


def test_kv_exhaustion_names_needed_and_available(qwen):
    engine = _engine(*qwen, num_kv_blocks=3, block_size=4)
    # 19 prompt tokens + 10 generated - 1 = 28 tokens -> 7 blocks of 4.
    with pytest.raises(KVBlocksExhaustedError, match="needs 7 KV blocks.*only 3") as info:
        engine.generate([PROMPTS[2]], greedy())
    assert (info.value.needed_blocks, info.value.num_blocks) == (7, 3)
    assert engine.blocks.num_free_blocks == 3  # nothing leaked


def test_small_cache_runs_prompts_in_waves(qwen):
    config, model = qwen
    roomy = _engine(config, model, num_kv_blocks=64).generate(PROMPTS, greedy())
    # 7 blocks fit the longest sequence alone; the others wait for its blocks.
    tight_engine = _engine(config, model, num_kv_blocks=7)
    tight = tight_engine.generate(PROMPTS, greedy())
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert [o.token_ids for o in roomy] == [_hf_greedy(model, p) for p in PROMPTS]
    assert tight_engine.blocks.num_free_blocks == 7


def test_stop_token_ends_a_sequence(qwen):
    config, model = qwen
    engine = _engine(config, model)
    full = engine.generate([PROMPTS[0]], greedy())[0].token_ids
    stop = full[3]
    first = full.index(stop)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[stop])
    out = engine.generate([PROMPTS[0]], params)
    assert out[0].token_ids == full[: first + 1]
    assert out[0].logprobs is None and out[0].prompt_ids == PROMPTS[0]


def test_compute_logprobs_equals_hf_forward(qwen):
    config, model = qwen
    engine = _engine(config, model, num_kv_blocks=8)
    got = engine.compute_logprobs(PROMPTS)
    for seq, lp in zip(PROMPTS, got):
        ref = hf_logprobs(model, seq[:1], seq[1:])
        assert len(lp) == len(seq) - 1
        torch.testing.assert_close(torch.tensor(lp, dtype=torch.float64),
                                   torch.tensor(ref, dtype=torch.float64), atol=2e-4, rtol=0)


BOUNDARY_PROMPT = [3, 17, 42, 99, 5, 8, 13, 21]  # 8 tokens: exactly two blocks of 4


@pytest.mark.parametrize(
    "max_tokens, num_kv_blocks",
    [
        (1, 2),  # KV holds the 8 prompt tokens only (the sampled token is never fed back): 2 blocks
        (2, 3),  # the first generated token is written at position 8, the first of a third block
        (5, 3),  # positions 8..11 fill the third block exactly
    ],
)
def test_prompt_ending_exactly_on_a_block_boundary(qwen, max_tokens, num_kv_blocks):
    # The cache has exactly the blocks the sequence needs: one more token reserved raises
    # KVBlocksExhaustedError, one fewer writes outside the sequence's block table.
    config, model = qwen
    engine = _engine(config, model, num_kv_blocks=num_kv_blocks, block_size=4)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    out = engine.generate([BOUNDARY_PROMPT], params)
    assert out[0].token_ids == _hf_greedy(model, BOUNDARY_PROMPT, n=max_tokens)
    assert engine.blocks.num_free_blocks == num_kv_blocks


@pytest.mark.parametrize("length, num_kv_blocks", [(8, 2), (9, 3)])
def test_scoring_a_sequence_on_and_just_past_a_block_boundary(qwen, length, num_kv_blocks):
    config, model = qwen
    seq = (BOUNDARY_PROMPT + [7])[:length]
    engine = _engine(config, model, num_kv_blocks=num_kv_blocks, block_size=4)
    (got,) = engine.compute_logprobs([seq])
    ref = hf_logprobs(model, seq[:1], seq[1:])
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                               atol=2e-4, rtol=0)
    with pytest.raises(KVBlocksExhaustedError, match=f"needs {num_kv_blocks} KV blocks"):
        _engine(config, model, num_kv_blocks=num_kv_blocks - 1, block_size=4).compute_logprobs([seq])


def test_bad_prompts_are_refused(qwen):
    engine = _engine(*qwen)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], greedy())
    with pytest.raises(ValueError, match=r"\[250\] outside \[0, vocab_size=250\)"):
        engine.generate([[1, 250]], greedy())


def test_kv_utilization_sizes_the_pool(qwen, monkeypatch):
    # Fixed figures: the machine's own free memory varies, and a pool of all of it may not be allocatable.
    total, free = 64 * 2**20, 60 * 2**20
    figures = MemoryFigures(allocated_nbytes=0, reserved_nbytes=0, free_nbytes=free, total_nbytes=total)
    monkeypatch.setattr(type(get_accelerator("cpu")), "memory_figures",
                        lambda self, tracked_nbytes=0: figures)
    config, model = qwen
    engine = ReferenceEngine(config, kv_utilization=0.5, block_size=4)
    block_nbytes = engine.kv_allocator.block_nbytes
    # On the CPU: half of what is free, not of the total.
    assert engine.num_kv_blocks == (free // 2) // block_nbytes
    assert engine.kv_allocator.nbytes == engine.num_kv_blocks * block_nbytes
    with pytest.raises(ValueError, match="kv_utilization=1e-06 leaves no room"):
        ReferenceEngine(config, kv_utilization=1e-6, block_size=4)
    with pytest.raises(ValueError, match="at most one"):
        ReferenceEngine(config, kv_utilization=0.5, num_kv_blocks=4)
    too_many = free // block_nbytes + 1
    with pytest.raises(ValueError, match=rf"num_blocks={too_many} .* is {too_many * block_nbytes} bytes, "
                                         rf"more than the {free} bytes free"):
        ReferenceEngine(config, num_kv_blocks=too_many, block_size=4)


def _mem_available_nbytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads the OS's MemAvailable")
def test_kv_utilization_on_the_cpu_is_a_share_of_what_the_os_says_is_free(qwen):
    config, _ = qwen
    before = _mem_available_nbytes()
    engine = ReferenceEngine(config, kv_utilization=0.002, block_size=4)
    after = _mem_available_nbytes()
    pool = engine.num_kv_blocks * engine.kv_allocator.block_nbytes
    low, high = sorted((before, after + pool))  # the figure was read between the two readings here
    # Within one block of 0.2% of free memory, allowing for what other programs did between the readings.
    assert 0.002 * low * 0.9 - engine.kv_allocator.block_nbytes <= pool <= 0.002 * high * 1.1


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("allocator", ["torch", "cuda-vmm"])
def test_cuda_greedy_and_release(allocator):
    config, model = build_hf("llama_tied_mqa")
    model = model.cuda()
    engine = _engine(config, model, device="cuda", kv_allocator=allocator)
    before = [o.token_ids for o in engine.generate(PROMPTS, greedy())]
    assert before == [_hf_greedy(model, p) for p in PROMPTS]
    ptr = engine.kv_cache.data_ptr()
    for _ in range(3):
        torch.cuda.synchronize()
        free_before, _ = torch.cuda.mem_get_info()
        engine.release(["weights", "kv_cache"])
        torch.cuda.empty_cache()
        free_after, _ = torch.cuda.mem_get_info()
        assert engine.resident_nbytes("weights") == engine.resident_nbytes("kv_cache") == 0
        if engine.kv_allocator.preserves_addresses:
            # VMM unmaps its own physical memory; the torch pool's small blocks may share caching-allocator
            # segments with other tensors, so only the allocator's accounting is checked for it.
            assert free_after - free_before >= engine.planned_nbytes("kv_cache")
        engine.resume(["weights", "kv_cache"])
        engine.load_weights(model.state_dict().items())
        assert [o.token_ids for o in engine.generate(PROMPTS, greedy())] == before
        if engine.kv_allocator.preserves_addresses:
            assert engine.kv_cache.data_ptr() == ptr
