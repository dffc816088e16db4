"""TRAIN -> INFER with resharding, 4 gloo ranks: training weights in Megatron-core's layout at training
TP 1, 2 or 4 (the rest data parallel) are resharded by ShardingManager (``model_spec=``) into
ReferenceEngine replicas at inference TP 1, 2 and 4, whose greedy generation then equals HF's token for
token on every rank, before and after a training step (the second switch must carry the new weights)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from engine_cases import MAX_TOKENS, PROMPTS, build_hf, greedy

from hybridmem import HybridConfig, ShardingManager
from hybridmem.engines import ENGINE_TAGS, ReferenceEngine
from hybridmem.engines.nn.gpt import MegatronLayoutGPT
from hybridmem.reshard import ModelSpec, megatron_layout, shard, unshard
from hybridmem.testing.workers import WorkerPool

WORLD = 4


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(WORLD, timeout_s=300.0) as p:
        yield p


def _hf_greedy(name: str, full: dict[str, torch.Tensor]) -> list[list[int]]:
    """HF greedy generation with ``full`` loaded (independent of hybridmem's engine)."""
    _, model = build_hf(name)
    missing, unexpected = model.load_state_dict(full, strict=False)
    assert not unexpected and all("rotary" in m or m == "lm_head.weight" for m in missing), (
        missing, unexpected)
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            gen = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                        do_sample=False, pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


def task_switch(ctx, config_dict, full, train_tp, infer_tp):
    """Per rank: greedy tokens after the first and the second switch, and the full weights trained in
    between."""
    world, rank = ctx.world_size, ctx.rank
    train_groups = [dist.new_group(list(range(s, s + train_tp))) for s in range(0, world, train_tp)]
    infer_groups = [dist.new_group(list(range(s, s + infer_tp))) for s in range(0, world, infer_tp)]
    config = HybridConfig(device="cpu", tensor_model_parallel_size=train_tp,
                          infer_tensor_parallel_size=infer_tp)
    spec = ModelSpec.from_hf_config(config_dict)
    layout = megatron_layout(spec, config.train_layout, world)
    local = shard(full, layout, rank)
    model = MegatronLayoutGPT(spec, group=train_groups[rank // train_tp],
                              padded_vocab_size=local["embedding.word_embeddings.weight"].shape[0] * train_tp,
                              dtype=torch.float32, device="cpu")
    model.load_state_dict(local)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = ReferenceEngine(config_dict, group=infer_groups[rank // infer_tp], num_kv_blocks=32,
                             block_size=4)
    engine.release(list(ENGINE_TAGS))
    manager = ShardingManager(model, engine, optimizer=opt, config=config, model_spec=config_dict,
                              group=ctx.group)
    tokens = []
    for cycle in range(2):
        with manager.inference() as eng:
            tokens.append([o.token_ids for o in eng.generate(PROMPTS, greedy())])
        if cycle == 0:  # the same step on every rank (same batch), so data-parallel copies stay equal
            batch = torch.tensor([PROMPTS[0]])
            (-model.token_logprobs(batch).sum()).backward()
            opt.step()
            opt.zero_grad()
    manager.close()
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    return tokens, trained


@pytest.mark.slow
@pytest.mark.parametrize("name,train_tp,infer_tp", [
    ("qwen2_gqa_bias", 2, 1), ("qwen2_gqa_bias", 2, 4), ("qwen2_gqa_bias", 1, 2),  # bias; TP4 > kv heads
    ("llama_tied_mqa", 1, 4),  # one kv head: Megatron cannot split it, vLLM replicates it
    ("llama_even", 4, 2), ("llama_even", 4, 1), ("llama_even", 2, 4),
])
def test_resharded_engine_equals_hf_greedy(pool, name, train_tp, infer_tp):
    config, model = build_hf(name)
    config_dict = config.to_dict()
    full = {k: v.detach().clone() for k, v in model.state_dict().items() if "rotary" not in k}
    if config_dict.get("tie_word_embeddings"):
        full.pop("lm_head.weight", None)
    results = pool.run(task_switch, config_dict, full, train_tp, infer_tp, world_size=WORLD)
    before = _hf_greedy(name, full)
    spec = ModelSpec.from_hf_config(config_dict)
    trained_full = unshard([r[1] for r in results], megatron_layout(spec, HybridConfig(
        tensor_model_parallel_size=train_tp).train_layout, WORLD))
    after = _hf_greedy(name, trained_full)
    assert after != before, (
        "the training step did not change greedy generation; the test would miss a stale sync")
    for rank, (tokens, _) in enumerate(results):
        assert tokens[0] == before, f"rank {rank}: first switch, TP{train_tp} -> TP{infer_tp}"
        assert tokens[1] == after, (
            f"rank {rank}: second switch after a training step, TP{train_tp} -> TP{infer_tp}")
