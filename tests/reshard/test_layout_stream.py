"""iter_layout_tensors: each rank's tensors of the engine's own (vLLM) layout, complete and once each, equal
to the independent reference shards; and only the tensors in flight are alive, measured by a spy on the
allocations (1 rank in this process, 2 and 4 over a gloo pool)."""

from __future__ import annotations

import pytest
import torch

from hybridmem.config import ParallelLayout
from hybridmem.reshard import (
    ModelSpec,
    build_plan,
    hf_layout,
    megatron_layout,
    stream_peak_nbytes,
    vllm_layout,
)
from hybridmem.testing.workers import WorkerPool
from tests.reshard import _stream_tasks
from tests.reshard.reference import vllm_shard

BUCKET = 256

QWEN2 = ModelSpec(family="qwen2", hidden_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=2,
                  intermediate_size=16, num_hidden_layers=2, vocab_size=70, qkv_bias=True)
QWEN3_TIED = ModelSpec(family="qwen3", hidden_size=8, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=4, intermediate_size=16, num_hidden_layers=3, vocab_size=33, qk_norm=True,
                       tie_word_embeddings=True)
MOE = ModelSpec(family="qwen2_moe", hidden_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=2,
                intermediate_size=0, num_hidden_layers=2, vocab_size=70, qkv_bias=True, num_experts=8,
                moe_intermediate_size=4, shared_expert_intermediate_size=8)
DEEPSEEK = ModelSpec(family="deepseek_v3", hidden_size=8, num_attention_heads=4, num_key_value_heads=4,
                     head_dim=6, intermediate_size=8, num_hidden_layers=2, vocab_size=70, num_experts=4,
                     moe_intermediate_size=4, shared_expert_intermediate_size=8, first_k_dense_replace=1,
                     q_lora_rank=4, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)

CASES = {
    # id: (spec, training layout, inference layout, world)
    "qwen2-1rank": (QWEN2, ParallelLayout(), ParallelLayout(), 1),
    "qwen3-tied-1rank": (QWEN3_TIED, ParallelLayout(), ParallelLayout(), 1),
    "deepseek-1rank": (DEEPSEEK, ParallelLayout(), ParallelLayout(), 1),
    "qwen2-tp2-to-tp1": (QWEN2, ParallelLayout(tp=2), ParallelLayout(tp=1), 2),
    "qwen2-pp2-to-tp2": (QWEN2, ParallelLayout(pp=2), ParallelLayout(tp=2), 2),
    "moe-ep4-to-tp4": (MOE, ParallelLayout(ep=4), ParallelLayout(tp=4), 4),
    "moe-tp2ep2-to-ep4": (MOE, ParallelLayout(tp=2, ep=2), ParallelLayout(tp=1, ep=4), 4),
    "deepseek-tp2pp2-to-ep4": (DEEPSEEK, ParallelLayout(tp=2, pp=2), ParallelLayout(tp=1, ep=4), 4),
    "qwen3-tied-tp2-to-tp2pp2": (QWEN3_TIED, ParallelLayout(tp=2), ParallelLayout(tp=2, pp=2), 4),
}


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(4, timeout_s=300) as p:
        yield p


def _run(pool, spec, src, dst, world, **kwargs):
    """Per rank: ``(full, names in order, {name: tensor}, peak bytes alive)``."""
    if world == 1:
        return [_stream_tasks.stream(spec, src, dst, rank=0, world=1, group=None, bucket=BUCKET, **kwargs)]
    return pool.run(_stream_tasks.stream_task, spec, src, dst, BUCKET, world_size=world, **kwargs)


@pytest.mark.parametrize("case", CASES)
def test_the_stream_is_the_reference_vllm_shard_each_tensor_once(pool, case):
    spec, src, dst, world = CASES[case]
    for rank, (full, names, got, _) in enumerate(_run(pool, spec, src, dst, world)):
        ref = vllm_shard(full, spec, tp=dst.tp, pp=dst.pp, ep=dst.ep, world=world, rank=rank)
        assert len(names) == len(set(names)) and set(names) == set(ref), (rank, set(names) ^ set(ref))
        for name, tensor in ref.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), (rank, name)


@pytest.mark.parametrize("case", ["qwen2-1rank", "deepseek-1rank", "qwen2-tp2-to-tp1", "moe-tp2ep2-to-ep4"])
def test_a_borrowing_stream_lends_whole_training_tensors_and_is_still_the_reference(pool, case):
    """``borrow``: a tensor that one training tensor holds whole, in the same order, is yielded as that
    tensor (the norms at least; never a fused q/k/v, a padded vocabulary or a TP-split weight); every tensor
    still equals the reference shard."""
    spec, src, dst, world = CASES[case]
    for rank, (full, names, got, _, lent) in enumerate(_run(pool, spec, src, dst, world, borrow=True)):
        ref = vllm_shard(full, spec, tp=dst.tp, pp=dst.pp, ep=dst.ep, world=world, rank=rank)
        assert len(names) == len(set(names)) and set(names) == set(ref), (rank, set(names) ^ set(ref))
        for name, tensor in ref.items():
            assert torch.equal(got[name], tensor), (rank, name)
        assert any(n.endswith("input_layernorm.weight") for n in lent), (rank, lent)
        assert not any(n.endswith(("qkv_proj.weight", "embed_tokens.weight")) for n in lent), (rank, lent)


def test_one_rank_streams_in_the_layouts_order():
    full, names, _, _ = _run(None, QWEN3_TIED, ParallelLayout(), ParallelLayout(), 1)[0]
    assert names == list(vllm_layout(QWEN3_TIED, ParallelLayout(), 1).tensors(0))


def test_the_stream_casts_to_the_engines_dtype_but_keeps_fp32_tensors(pool):
    """An fp32 wire into a bf16 engine: every tensor arrives in bf16 but DeepSeek's router bias, which vLLM
    keeps in fp32 (PP2 -> TP2 moves layer 1, the bias among it, over the wire to rank 0)."""
    src, dst = ParallelLayout(pp=2), ParallelLayout(tp=2)
    results = _run(pool, DEEPSEEK, src, dst, 2, out_dtype=torch.bfloat16)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    for rank, (full, _, got, _) in enumerate(results):
        ref = vllm_shard(full, DEEPSEEK, tp=2, pp=1, ep=1, world=2, rank=rank)
        for name, tensor in ref.items():
            want = tensor if name == bias else tensor.to(torch.bfloat16)
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), (rank, name)


def _plan(spec, src, dst, world, rank, hf=False):
    layout = (hf_layout if hf else vllm_layout)(spec, dst, world)
    return build_plan(megatron_layout(spec, src, world), layout, itemsize=4, bucket_nbytes=BUCKET, rank=rank)


def _bucket_bound(plan, rank) -> tuple[int, int]:
    """``(the bound, every destination tensor's bytes)``: the larger of the largest tensor no bucket brings a
    cell to, and, per bucket, the tensors that bucket or an earlier one brought cells to and that bucket or a
    later one still brings cells to (fp32 here, 4 bytes an element)."""
    nbytes = {name: local.numel * 4 for name, local in plan.dst.tensors(rank).items()}
    brought = [{t.dst_name for t in bucket if t.dst_rank == rank} for bucket in plan.buckets]
    bound = max((n for name, n in nbytes.items() if not any(name in b for b in brought)), default=0)
    for i in range(len(brought)):
        open_ = set().union(*brought[:i + 1]) & set().union(*brought[i:])
        bound = max(bound, sum(nbytes[name] for name in open_))
    return bound, sum(nbytes.values())


@pytest.mark.parametrize("hf", [False, True], ids=["vllm", "hf"])
def test_one_rank_holds_one_tensor_at_a_time(hf):
    """Every cell is local: the stream holds the tensor it yields, nothing else (the old order copied every
    local cell first, into a whole copy of the model)."""
    _, _, got, peak = _stream_tasks.stream(QWEN2, ParallelLayout(), ParallelLayout(), rank=0, world=1,
                                           group=None, bucket=BUCKET, hf=hf)
    largest = max(t.numel() * t.element_size() for t in got.values())
    assert 0 < peak <= largest < sum(t.numel() * t.element_size() for t in got.values())
    plan = _plan(QWEN2, ParallelLayout(), ParallelLayout(), 1, 0, hf=hf)
    assert stream_peak_nbytes(plan, 0, torch.float32) == largest


@pytest.mark.parametrize("case", ["qwen2-tp2-to-tp1", "moe-tp2ep2-to-ep4", "deepseek-tp2pp2-to-ep4"])
def test_ranks_hold_only_what_the_buckets_have_open(pool, case):
    """Each rank's peak of destination bytes alive is at most what the plan's buckets have touched and not
    completed (never every tensor with a local cell at once), and the plan figure says so."""
    spec, src, dst, world = CASES[case]
    results = _run(pool, spec, src, dst, world)
    below_total = []
    for rank, (_, _, _, peak) in enumerate(results):
        plan = _plan(spec, src, dst, world, rank)
        bound, total = _bucket_bound(plan, rank)
        assert 0 < peak <= bound, (rank, peak, bound)
        assert stream_peak_nbytes(plan, rank, torch.float32) == bound
        below_total.append(bound < total)
    assert all(below_total), below_total  # the cases are ones where the bound bites


def test_a_megatron_tp2_trainer_syncs_into_an_fp8_tp2_engine(pool):
    """Into an engine serving FP8 ([Note: fp8 sync] in :mod:`hybridmem.weight_sync.fp8`) from bf16 Megatron
    shards at TP 2: each rank's engine holds, bit for bit, vLLM's quantizer's full tensors cut by hand for it
    (tests/weight_sync/_fp8_engine.py), and the sync counts its FP8 bytes: per layer e4m3 qkv [512, 256],
    o [256, 256], gate_up [512, 256] and down [256, 256], float32 scales of 4x2, 2x2, 4x2 and 2x2 blocks and
    bf16 norms of 256, 256, 128 and 128; then half the bf16 embedding and head rows and the final norm. Each
    rank's Megatron shard is whole 128-blocks of its engine shard, which it quantizes itself: no byte moves
    between the ranks (the sync gathered the full tensors on each rank before, half of them received)."""
    fp8 = pytest.importorskip("tests.weight_sync._fp8_engine")
    spec = ModelSpec.from_hf_config(dict(fp8.CONFIG, model_type="qwen3"))
    torch.manual_seed(3)
    full = {n: torch.randn(s).to(torch.bfloat16) for n, s in spec.full_shapes().items()}
    want = [fp8.reference(full, rank=r, tp=2) for r in range(2)]
    results = pool.run(fp8.sync_task, full, want, 2, world_size=2)
    layer = (512 * 256 + 256 * 256 + 512 * 256 + 256 * 256) + 4 * (8 + 4 + 8 + 4) + 2 * (256 * 2 + 128 * 2)
    for rank, (held, engine_nbytes, sent, received) in enumerate(results):
        assert held.keys() == want[rank].keys()
        assert not [n for n, t in want[rank].items() if not fp8.same(held[n], t)], rank
        assert engine_nbytes == 2 * layer + 2 * (128 * 256) * 2 + 2 * 256 == 921_280
        assert sent == received == 0, (rank, sent, received)


def test_a_megatron_tp2_trainer_sends_quantized_halves_into_fp8_tp1_engines(pool):
    """Into two TP 1 FP8 engines (one a rank) from bf16 Megatron TP 2: each rank lacks the other half of every
    weight, whole 128-blocks of it, which its holder quantizes and sends as e4m3 bytes and float32 block
    scales ([Note: quantized cells] in :mod:`hybridmem.reshard.plan`). Each engine holds vLLM's quantizer's
    full tensors bit for bit, the checksums of every slice agree, and each rank receives, counted by hand:
    per layer the other half of q (256x256, 2x2 blocks), k and v (128x256, 1x2 each), o's other columns
    (256x256, 2x2), of gate and up (256x256, 2x2 each) and down's (256x256, 2x2), one byte an element and
    four a block; then the other half of the bf16 embedding and head rows (128x256, two bytes an element).
    In bf16, as the sync moved them before, the weights alone were 786,432 bytes a layer."""
    fp8 = pytest.importorskip("tests.weight_sync._fp8_engine")
    spec = ModelSpec.from_hf_config(dict(fp8.CONFIG, model_type="qwen3"))
    torch.manual_seed(4)
    full = {n: torch.randn(s).to(torch.bfloat16) for n, s in spec.full_shapes().items()}
    want = fp8.reference(full)
    results = pool.run(fp8.sync_task, full, [want, want], 2, 1, None, True, world_size=2)
    layer = ((256 * 256 + 2 * 128 * 256 + 256 * 256 + 2 * 256 * 256 + 256 * 256)
             + 4 * (4 + 2 * 2 + 4 + 2 * 4 + 4))
    for rank, (held, _, sent, received) in enumerate(results):
        assert not [n for n, t in want.items() if not fp8.same(held[n], t)], rank
        assert received == sent == 2 * layer + 2 * (128 * 256) * 2 == 917_696, (rank, received)


def test_cells_cut_inside_a_block_move_unquantized_and_their_blocks_are_quantized_where_they_land(pool):
    """A Qwen3 with 64-dim heads: Megatron TP 2 holds its k and v heads in 64-row halves, cut inside a
    128-block, while its q (two heads a rank) and MLP halves are whole blocks. Into two TP 1 FP8 engines the
    k and v halves travel in bf16 and the receiver quantizes their blocks once both halves are there; the
    rest travels quantized. Each engine holds vLLM's quantizer's tensors bit for bit and the checksums agree;
    per layer each rank receives, by hand: q's other 128x256 (1x2 blocks) and o's other 256x128 columns
    (2x1), quantized; k's and v's other 64x256 in bf16; gate's and up's other 256x256 and down's other
    256x256 columns (2x2 each), quantized; then half the bf16 embedding and head rows."""
    fp8 = pytest.importorskip("tests.weight_sync._fp8_engine")
    config = dict(fp8.CONFIG, head_dim=64)
    spec = ModelSpec.from_hf_config(dict(config, model_type="qwen3"))
    torch.manual_seed(5)
    full = {n: torch.randn(s).to(torch.bfloat16) for n, s in spec.full_shapes().items()}
    want = fp8.reference(full)
    results = pool.run(fp8.sync_task, full, [want, want], 2, 1, config, True, world_size=2)
    layer = ((128 * 256 + 4 * 2) + (256 * 128 + 4 * 2) + 2 * (64 * 256 * 2)
             + 3 * (256 * 256 + 4 * 4))
    for rank, (held, _, sent, received) in enumerate(results):
        assert not [n for n, t in want.items() if not fp8.same(held[n], t)], rank
        assert received == sent == 2 * layer + 2 * (128 * 256) * 2, (rank, received)


def test_an_engine_taking_checkpoint_tensors_gets_the_fp8_checkpoint_from_quantized_halves(pool):
    """Into two TP 1 engines that take full HF tensors through ``load_weights`` and report FP8 (vLLM in the
    trainer's process): the halves move quantized as into a streamed layout (917,696 bytes a rank, by hand as
    above), and each engine is handed, under the checkpoint's names, what vLLM's quantizer makes of the full
    weights, bit for bit, the checksums of every slice agreeing."""
    fp8 = pytest.importorskip("tests.weight_sync._fp8_engine")
    spec = ModelSpec.from_hf_config(dict(fp8.CONFIG, model_type="qwen3"))
    torch.manual_seed(6)
    full = {n: torch.randn(s).to(torch.bfloat16) for n, s in spec.full_shapes().items()}
    want = fp8.checkpoint_reference(full)
    results = pool.run(fp8.sync_task, full, None, 2, 1, None, True, world_size=2)
    for rank, (handed, engine_nbytes, sent, received) in enumerate(results):
        assert handed.keys() == want.keys()
        assert not [n for n, t in want.items() if not fp8.same(handed[n], t)], rank
        assert received == sent == 917_696, (rank, received)
        assert engine_nbytes == 1_838_976  # the whole FP8 checkpoint (tests/weight_sync/test_fp8_sync.py)
