"""The LoRA plan ([Note: lora plan] in :mod:`hybridmem.planner.lora`) against PEFT's own adapters and against
what the manager moves.

References: the adapter tensors PEFT builds for the targets (their element counts), and the bytes a
ShardingManager's switch report says each offload step copied, on the embedded engine at TP 1.
"""

from __future__ import annotations

import pytest
import torch

from hybridmem import Direction, HybridConfig, ShardingManager
from hybridmem.engines.reference import ReferenceEngine
from hybridmem.planner.cluster import hf_buffer_nbytes
from hybridmem.planner.lora import LoraSetup, adapter_shapes, plan_lora
from hybridmem.reshard import ModelSpec
from hybridmem.weight_sync import LoadWeightsSync
from hybridmem.weight_sync.lora import merged_lora_weights, peft_base_weights
from tests.switch.test_lora_base import AdaptersOnly

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOKENS = torch.tensor([[1, 5, 9, 2, 7]])
QWEN2 = dict(model_type="qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, num_hidden_layers=2, vocab_size=100, max_position_embeddings=64)


def _peft(config: dict, targets: list[str], rank: int):
    cfg = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(0)
    return peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(cfg),
                               peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)), cfg


@pytest.mark.parametrize("config,targets", [
    (QWEN2, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    (dict(QWEN2, model_type="phi3", pad_token_id=0), ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]),
], ids=["qwen2", "phi3-fused"])
def test_adapter_shapes_are_the_ones_peft_builds(config, targets):
    model, _ = _peft(config, targets, rank=8)
    expected = sorted((n.removeprefix("base_model.model.").replace(".lora_A.default", "").replace(
        ".lora_B.default", ""), tuple(p.shape)) for n, p in model.named_parameters() if ".lora_" in n)
    got = sorted(x for name, (a, b) in adapter_shapes(ModelSpec.from_hf_config(config),
                                                       LoraSetup(rank=8, targets=tuple(targets))).items()
                 for x in ((name, a), (name, b)))
    assert got == expected


def test_a_target_the_model_lacks_is_named():
    with pytest.raises(ValueError, match=r"\['w9'\] name no linear weight"):
        adapter_shapes(ModelSpec.from_hf_config(QWEN2), LoraSetup(rank=4, targets=("q_proj", "w9")))


@pytest.mark.parametrize("route", ["merged", "engine_resident", "shared"])
def test_the_bytes_offloaded_per_switch_are_the_plans(route):
    targets = ["q_proj", "v_proj", "down_proj"]
    model, cfg = _peft(QWEN2, targets, rank=4)
    engine = ReferenceEngine(cfg.to_dict(), num_kv_blocks=8, block_size=8)
    engine.load_weights(peft_base_weights(model))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    # PEFT's lora_B starts at zero, so lora_A's first gradients are zero (released, not copied)
    for _ in range(2):
        opt.zero_grad()
        model(TOKENS, labels=TOKENS).loss.backward()
        opt.step()
    sync = (LoadWeightsSync(lambda: merged_lora_weights(model), engine) if route == "merged"
            else AdaptersOnly(model, engine))
    manager = ShardingManager(model, engine, optimizer=opt, weight_sync=sync,
                              config=HybridConfig(device="cpu", lora_base="shared" if route == "shared"
                                                  else "engine_resident"))
    with manager.inference():
        pass
    by_kind = manager.last_reports[Direction.TO_INFER].bytes_by_kind
    offloaded = sum(by_kind.get(k, 0) for k in ("param", "grad", "optimizer"))
    (plan,) = [p for p in plan_lora(ModelSpec.from_hf_config(QWEN2),
                                    LoraSetup(rank=4, targets=tuple(targets)),
                                    param_bytes=4, infer_bytes=4, device_nbytes=2**34, kv_nbytes=0,
                                    buffer_nbytes=hf_buffer_nbytes(QWEN2, 4)) if p.route == route]
    assert offloaded == plan.host_link_nbytes // 2


def test_the_routes_order_as_the_modes_promise():
    plans = {p.route: p for p in plan_lora(ModelSpec.from_hf_config(QWEN2), LoraSetup(rank=4), param_bytes=2,
                                           infer_bytes=2, device_nbytes=2**30, kv_nbytes=2**20)}
    merged, sleeps, resident, shared = (plans[r]
                                        for r in ("merged", "engine_sleeps", "engine_resident", "shared"))
    assert shared.host_link_nbytes == resident.host_link_nbytes < sleeps.host_link_nbytes
    assert resident.host_link_nbytes < merged.host_link_nbytes
    assert shared.engine_write_nbytes == resident.engine_write_nbytes < merged.engine_write_nbytes
    assert shared.train_nbytes < resident.train_nbytes and shared.infer_nbytes < resident.infer_nbytes
    assert shared.kv_room_nbytes > resident.kv_room_nbytes == sleeps.kv_room_nbytes


def test_hybridmem_plan_lora_prints_every_route_and_refuses_several_devices(tmp_path, capsys):
    import json

    from hybridmem.planner.command import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN2))
    assert main([str(config), "--world", "1", "--lora-rank", "4",
                 "--kv-cache-bytes", "0", "--json", "-"]) == 0
    routes = json.loads(capsys.readouterr().out)
    assert [r["route"] for r in routes] == ["merged", "engine_sleeps", "engine_resident", "shared"]
    spec = ModelSpec.from_hf_config(QWEN2)
    model, _ = _peft(QWEN2,
                     ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], rank=4)
    # fp32, as PEFT keeps them
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n) * 4
    assert {r["route"]: r["engine_write_nbytes"] for r in routes}["shared"] == adapters
    base = sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n)
    # The merged sync writes the whole model: its base in the engine's dtype (bf16), vocabulary padding on
    # top.
    assert base * 2 <= routes[0]["engine_write_nbytes"] < base * 2 * 1.1
    assert spec.vocab_size == 100
    with pytest.raises(SystemExit):
        main([str(config), "--world", "2", "--lora-rank", "4"])
    assert "--lora-rank plans one device" in capsys.readouterr().err
