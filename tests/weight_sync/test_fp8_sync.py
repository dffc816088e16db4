"""A trainer in bf16/fp32 switched into an engine that serves the model in FP8 with 128x128 block scales
([Note: fp8 sync] in :mod:`hybridmem.weight_sync.fp8`).

The engine is a stand-in that holds a Qwen3 as vLLM's classes built with ``quantization="fp8"`` hold it: each
quantized linear weight ``float8_e4m3fn`` beside its float32 ``weight_scale_inv``, the rest bf16; it takes its
layout as a stream and refuses a tensor of another name, shape or dtype. After every training step the switch
must leave it holding, bit for bit, what vLLM's own quantizer (``per_block_cast_to_fp8``, its eager body, as
tests/reshard/test_vllm_fp8.py runs it) makes of the full training weights, fused and cut by hand; the switch
report counts the FP8 bytes it handed, and the sync's transient memory stays within its estimate. vLLM's own
FP8 classes loading such shards at TP 1/2/4 and PP 2 are tests/reshard/test_vllm_fp8.py's.
"""

from __future__ import annotations

import pytest
import torch

from hybridmem import HybridConfig, ShardingManager
from hybridmem.config import ParallelLayout
from hybridmem.contract.engine import EngineCapabilities
from hybridmem.reshard import ModelSpec, iter_shard, vllm_layout
from hybridmem.reshard.conventions import VLLMConvention
from hybridmem.weight_sync import ReshardRoute, ReshardSync
from hybridmem.weight_sync.fp8 import Fp8Target
from tests.weight_sync._fp8_engine import (
    CONFIG,
    FP8,
    Fp8CheckpointEngine,
    Fp8Engine,
    checkpoint_reference,
    full_weights,
    reference,
    same,
    train_step,
    vllm_quantizer,
)

transformers = pytest.importorskip("transformers")



def _model(dtype: torch.dtype):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**CONFIG)
    return transformers.Qwen3ForCausalLM(config).to(dtype), config


# The FP8 bytes the engine is handed, from the shapes (hidden 256, q 4x128, kv 2x128, MLP 512, vocab 256):
# per layer the e4m3 weights (one byte an element) of qkv [1024, 256], o [256, 512], gate_up [1024, 256] and
# down [256, 512], their float32 scales (four bytes a 128x128 block: 8x2, 2x4, 8x2, 2x4), and four bf16
# norms (256, 256, 128, 128); then bf16 embedding and head [256, 256] and the final norm.
LAYER_NBYTES = ((1024 * 256 + 256 * 512 + 1024 * 256 + 256 * 512) + 4 * (16 + 8 + 16 + 8)
                + 2 * (256 * 2 + 128 * 2))
ENGINE_NBYTES = 2 * LAYER_NBYTES + 2 * (256 * 256) * 2 + 2 * 256


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_every_switch_hands_the_engine_vllms_fp8_shard_of_the_trained_weights(dtype):
    model, _ = _model(dtype)
    engine = Fp8Engine(reference(full_weights(model)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # the fp32 run also compares the plan's per-slice checksums (verify_weight_sync)
    config = HybridConfig(device="cpu", verify_weight_sync=dtype == torch.float32)
    manager = ShardingManager(model, engine, optimizer=opt, config=config)
    sync = manager.weight_sync
    assert isinstance(sync, ReshardSync) and sync.route is ReshardRoute.LAYOUT_STREAM and sync.fp8 is not None
    for step in range(2):
        want = train_step(model, opt)
        report = manager.to_infer()
        assert engine.params.keys() == want.keys() and not engine.unwritten_weights()
        wrong = [n for n, t in want.items() if not same(engine.params[n], t)]
        assert not wrong, (step, wrong)
        synced = next(s for s in report.steps if s.name == "weight sync").extra
        assert synced["engine_nbytes"] == ENGINE_NBYTES == 1_838_976
        assert synced["num_tensors"] == len(want) == 3 + 2 * 12 and synced["coverage_checked"] is True
        assert synced["note"].startswith("weights quantized: trainer -> engine float8_e4m3fn, 128x128 block")
        # an fp32 trainer's unquantized tensors reach the bf16 engine cast, and the note says so
        assert ("trainer float32 -> engine bfloat16" in synced["note"]) == (dtype == torch.float32)
        manager.to_train()
    manager.close()


def test_an_engine_taking_checkpoint_tensors_is_handed_vllms_fp8_checkpoint_of_the_trained_weights():
    """An engine that takes full HF-named tensors through ``load_weights`` and reports FP8 (vLLM in the
    trainer's process, whose post-load processing may re-lay what it holds): after every training step it is
    handed, by the checkpoint's names, what vLLM's quantizer makes of the full weights, bit for bit: each
    projection's e4m3 values and ``weight_scale_inv``, the rest in the trainer's dtype. So vLLM loads it as
    it loads the FP8 checkpoint (tests/reshard/test_vllm_fp8.py: its classes load that checkpoint)."""
    model, _ = _model(torch.bfloat16)
    engine = Fp8CheckpointEngine()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = ShardingManager(model, engine, optimizer=opt,
                              config=HybridConfig(device="cpu", verify_weight_sync=True))
    assert manager.weight_sync.route is ReshardRoute.HF_STREAM
    for step in range(2):
        train_step(model, opt)
        want = checkpoint_reference(full_weights(model))
        report = manager.to_infer()
        assert engine.handed.keys() == want.keys()
        assert not [n for n, t in want.items() if not same(engine.handed[n], t)], step
        synced = next(s for s in report.steps if s.name == "weight sync").extra
        # the FP8 checkpoint of the tiny Qwen3: ENGINE_NBYTES's weights and scales, unfused
        assert synced["engine_nbytes"] == ENGINE_NBYTES
        manager.to_train()
    manager.close()


def test_a_rank_of_a_tp2_engine_gets_its_hand_cut_fp8_shard():
    """The quantizing part on rank 1 of TP 2 (each rank's shard of every weight is whole blocks): from the
    rank's unquantized shards, the rank's tensors equal vLLM's quantizer's full tensors cut by hand."""
    model, config = _model(torch.bfloat16)
    full = full_weights(model)
    spec = ModelSpec.from_hf_config(config)
    fp8 = VLLMConvention(weight_block_size=(128, 128))
    layout = vllm_layout(spec, ParallelLayout(tp=2), 2, convention=fp8)
    target = Fp8Target(layout, 1, torch.bfloat16)
    got = dict(target.stream(iter_shard(full.items(), target.plan_layout(), 1)))
    want = reference(full, rank=1, tp=2)
    assert got.keys() == want.keys()
    assert not [n for n, t in want.items() if not same(got[n], t)]


def test_what_cannot_be_synced_into_fp8_is_refused_when_the_manager_is_built():
    model, _ = _model(torch.bfloat16)
    like = reference(full_weights(model))
    build = lambda m, e: ShardingManager(m, e, config=HybridConfig(device="cpu"))  # noqa: E731
    with pytest.raises(ValueError, match="quant_method='awq'"):
        build(model, Fp8Engine(like, {"quant_method": "awq"}))
    with pytest.raises(ValueError, match=r"weight_block_size=\[64, 64\]"):
        build(model, Fp8Engine(like, dict(FP8, weight_block_size=[64, 64])))
    with pytest.raises(ValueError, match=r"training dtype torch.float64: Fp8Engine serves FP8.*quantizer"):
        build(model.to(torch.float64), Fp8Engine(like))
    # an engine written in place is handed the FP8 checkpoint's tensors instead (its processing re-run)
    in_place = Fp8Engine(like)
    in_place.capabilities = EngineCapabilities(writes_in_place=True, reports_quantization=True)
    in_place.named_parameters = lambda: iter(())
    assert build(model.to(torch.bfloat16), in_place).weight_sync.route is ReshardRoute.HF_STREAM
    copy = Fp8Engine(like)  # a copy of the training module would be handed its names, unquantized
    copy.capabilities = EngineCapabilities(loads_training_names=True, reports_quantization=True)
    with pytest.raises(ValueError, match="Fp8Engine serves FP8 with 128x128 blocks, which only the "
                                         "resharding sync makes.*the training model's own names"):
        build(model, copy)
    # an engine that could also be written in place takes FP8 as a stream
    both = Fp8Engine(like)
    both.capabilities = EngineCapabilities(writes_in_place=True, streams_layout=True,
                                           reports_quantization=True)
    both.named_parameters = lambda: iter(())
    assert build(model, both).weight_sync.route is ReshardRoute.LAYOUT_STREAM
    qwen2 = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        hidden_size=256, num_attention_heads=2, num_key_value_heads=2, intermediate_size=512,
        num_hidden_layers=1, vocab_size=256, max_position_embeddings=64))
    with pytest.raises(ValueError, match="family='qwen2': no FP8 layout"):
        build(qwen2, Fp8Engine(like))


@pytest.mark.parametrize("verify", [False, True], ids=["plain", "verify"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_syncs_transient_memory_stays_within_its_estimate(dtype, verify):
    """What one sync allocates and has not yet freed, measured by torch's profiler (each op's own
    allocations, then the frees), never exceeds ``temp_nbytes()``, the figure the memory plan reserves, with
    the checks (``verify``) and without; and it holds at least the largest tensor handed (qkv: 1024 x 256
    e4m3 bytes)."""
    from torch.profiler import ProfilerActivity, profile

    spec = ModelSpec.from_hf_config(dict(CONFIG, model_type="qwen3"))
    torch.manual_seed(0)
    full = {n: torch.randn(shape, dtype=dtype) for n, shape in spec.full_shapes().items()}
    engine = Fp8Engine(reference(full))
    sync = ReshardSync(spec, ParallelLayout(), ParallelLayout(), None, lambda: full, engine, verify=verify)
    engine.resume(["weights"])
    sync.sync()  # the checksum's cached weight vectors and the plan's caches outlive a sync: fill them first
    engine.resume(["weights"])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        sync.sync()
    frees = [(e.time_range.start, e.cpu_memory_usage) for e in prof.events() if e.name == "[memory]"]
    allocs = [(e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()
              if e.name != "[memory]" and e.self_cpu_memory_usage > 0]
    changes = sorted(frees + allocs)
    alive = peak = 0
    for _, change in changes:
        alive += change
        peak = max(peak, alive)
    # with the checks, the sync keeps a few bytes of its last comparison (a flag per rank)
    assert not engine.unwritten_weights() and alive <= (64 if verify else 0)
    assert 1024 * 256 <= peak <= sync.temp_nbytes(), (peak, sync.temp_nbytes())


def test_a_qwen3_moe_rank_gets_its_experts_stacked_in_fp8_and_its_router_in_bf16():
    """Rank 1 of a Qwen3-MoE engine at TP 2 with EP 2 (experts 2 and 3, whole): vLLM's fused-MoE tensors
    are each expert's quantized gate and up rows stacked (w13) and its quantized down (w2), scales alike; the
    router stays bf16. From bf16 full tensors, by hand with vLLM's quantizer (names of the fused-MoE tensors
    as vLLM's loaders are checked to take them in tests/reshard/test_vllm_fp8.py)."""
    quantize = vllm_quantizer()
    config = dict(CONFIG, model_type="qwen3_moe", num_hidden_layers=1, moe_intermediate_size=256,
                  num_experts=4, num_experts_per_tok=2)
    spec = ModelSpec.from_hf_config(config)
    torch.manual_seed(2)
    full = {n: torch.randn(s).to(torch.bfloat16) for n, s in spec.full_shapes().items()}
    layout = vllm_layout(spec, ParallelLayout(tp=2, ep=2), 2,
                         convention=VLLMConvention(weight_block_size=(128, 128)))
    target = Fp8Target(layout, 1, torch.bfloat16)
    got = dict(target.stream(iter_shard(full.items(), target.plan_layout(), 1)))
    p = "model.layers.0.mlp."
    parts = {(e, n): quantize(full[f"{p}experts.{e}.{n}_proj.weight"], [128, 128])
             for e in (2, 3) for n in ("gate", "up", "down")}
    want = {
        "w13_weight": torch.stack([torch.cat([parts[e, "gate"][0].view(torch.uint8),
                                              parts[e, "up"][0].view(torch.uint8)]) for e in (2, 3)]),
        "w13_weight_scale_inv": torch.stack([torch.cat([parts[e, "gate"][1], parts[e, "up"][1]])
                                             for e in (2, 3)]),
        "w2_weight": torch.stack([parts[e, "down"][0].view(torch.uint8) for e in (2, 3)]),
        "w2_weight_scale_inv": torch.stack([parts[e, "down"][1] for e in (2, 3)]),
    }
    for suffix, tensor in want.items():
        name = next(n for n in got if n.startswith(p + "experts.") and n.endswith("." + suffix))
        mine = got[name].view(torch.uint8) if got[name].dtype == torch.float8_e4m3fn else got[name]
        assert got[name].dtype == (torch.float32 if "scale" in suffix else torch.float8_e4m3fn), name
        assert torch.equal(mine, tensor), name
    assert got[p + "gate.weight"].dtype == torch.bfloat16 and torch.equal(got[p + "gate.weight"],
                                                                          full[p + "gate.weight"])
