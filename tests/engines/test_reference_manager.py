"""ReferenceEngine under ShardingManager (TP1, CPU): every TRAIN->INFER switch syncs the trained weights,
generation equals HF greedy on the current weights, and KV and weight memory is released on every exit."""

from __future__ import annotations

import torch
from engine_cases import MAX_TOKENS, PROMPTS, build_hf, greedy

from hybridmem import HybridConfig, Phase, ShardingManager
from hybridmem.engines import ENGINE_TAGS, ReferenceEngine


def _hf_greedy(model):
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


def test_five_train_infer_cycles_follow_training():
    config, model = build_hf("qwen2_gqa_bias")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = ReferenceEngine(config, num_kv_blocks=32, block_size=4)
    engine.release(list(ENGINE_TAGS))  # the manager starts in TRAIN with engine memory released
    manager = ShardingManager(model, engine, optimizer=opt, config=HybridConfig())
    batch = torch.tensor([PROMPTS[2]])
    first = None
    for cycle in range(5):
        expected = _hf_greedy(model.eval())
        with manager.inference() as eng:
            assert manager.phase is Phase.INFER
            got = [o.token_ids for o in eng.generate(PROMPTS, greedy())]
        assert got == expected, f"cycle {cycle}"
        assert engine.resident_nbytes("weights") == engine.resident_nbytes("kv_cache") == 0
        assert engine.kv_allocator.resident_nbytes() == 0
        first = got if first is None else first
        if cycle < 3:  # train: the next switch must carry new weights
            model.train()
            loss = model(batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert got != first, "training did not change generation; the test would not notice a stale sync"
    manager.close()


def test_gpu_memory_utilization_of_the_config_is_the_engines_kv_share(monkeypatch):
    from pathlib import Path

    import pytest

    from hybridmem import ConfigError
    from hybridmem.accel import MemoryFigures, get_accelerator

    total, free = 64 * 2**20, 60 * 2**20
    figures = MemoryFigures(allocated_nbytes=0, reserved_nbytes=0, free_nbytes=free, total_nbytes=total)
    monkeypatch.setattr(type(get_accelerator("cpu")), "memory_figures",
                        lambda self, tracked_nbytes=0: figures)
    hf_config, model = build_hf("qwen2_gqa_bias")
    cfg = HybridConfig.from_yaml(Path(__file__).parents[1] / "data" / "grpo_qwen25_7b_A3.yaml").replace(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, infer_tensor_parallel_size=1,
        device="cpu")
    assert cfg.gpu_memory_utilization == 0.4

    def engine(**kv):
        e = ReferenceEngine(hf_config, block_size=4, **kv)
        e.release(list(ENGINE_TAGS))
        return e

    ok = engine(kv_utilization=0.4)
    ShardingManager(model, ok, config=cfg)
    # On the CPU: a share of what is free.
    assert ok.num_kv_blocks == int(free * 0.4) // ok.kv_allocator.block_nbytes
    with pytest.raises(ConfigError,
                       match=r"gpu_memory_utilization=0\.4 .*expected 0\.5, the share the ReferenceEngine"):
        ShardingManager(model, engine(kv_utilization=0.5), config=cfg)
    with pytest.raises(ConfigError,
                       match=r"gpu_memory_utilization=0\.4 .*sized its KV pool by a block count"):
        ShardingManager(model, engine(num_kv_blocks=8), config=cfg)
    ShardingManager(model, engine(num_kv_blocks=8), config=cfg.replace(gpu_memory_utilization=None))
