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
