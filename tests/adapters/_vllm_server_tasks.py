"""Scenarios with vLLM's engine in its own process (an AsyncLLM, or ``vllm serve``), each run in a process of
its own by test_vllm_server.py: ``python _vllm_server_tasks.py SCENARIO OUT.json [ARGS]`` writes its
findings as JSON. References are transformers' models on the trained weights.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

VLLM_ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": "1800",  # a loaded 2-core machine can take minutes for a step
}
ENGINE_ARGS = {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 256, "max_num_seqs": 16,
               "enforce_eager": True, "seed": 0}
# The last prompt spans full KV blocks, which vLLM's prefix cache keeps across requests: an update without a
# prefix-cache reset would reuse KV computed with the old weights.
PROMPTS = [[1, 2, 3, 4], [9, 8, 7], [5, 17, 33, 2, 11], [(7 * i + 3) % 200 + 1 for i in range(40)]]
MAX_TOKENS = 8


def save_policy(directory: str) -> str:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=256, tie_word_embeddings=False)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(directory)
    return directory


def hf_greedy(model) -> list[list[int]]:
    import torch

    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(ids[0, len(p):].tolist())
    return out


def lm_step(model, optimizer, step: int, vocab: int) -> float:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    batch = torch.randint(0, vocab, (4, 12), generator=g)
    loss = model(input_ids=batch, labels=batch).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss)


def train_and_switch(engine, model_dir: str, steps: int) -> dict:
    """The user's loop: ``from_pretrained``, AdamW, a manager with defaults; per step a switch, greedy tokens,
    the engine's weight version, a training step."""
    import torch
    import transformers

    from hybridmem import Direction, ShardingManager
    from hybridmem.engines import SamplingParams

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    manager = ShardingManager(model, engine, optimizer=opt)
    res = {"steps": [], "vllm_layout_nbytes": sum(e.nbytes for e in engine.staging.entries)}
    for step in range(steps):
        with manager.inference() as e:
            got = [o.token_ids
                   for o in e.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))]
            version = e.weight_version()
        sync = next(s for s in manager.last_reports[Direction.TO_INFER].steps if s.name == "weight sync")
        res["steps"].append({"got": got, "expected": hf_greedy(model), "version": version,
                             "sync": dict(sync.extra)})
        lm_step(model, opt, step, model.config.vocab_size)
    manager.close()
    return res


def async_tp1(out: str, steps: str = "3") -> dict:
    """An AsyncLLM (engine core and worker in processes of their own) with hybridmem's backend."""
    from hybridmem.adapters.vllm.server import VLLMServerEngine

    model_dir = save_policy(tempfile.mkdtemp(prefix="policy-"))
    engine = VLLMServerEngine.start_async(model_dir, **ENGINE_ARGS)
    try:
        res = train_and_switch(engine, model_dir, int(steps))
    finally:
        engine.close()
    res["left_in_staging_directory"] = (sorted(os.listdir(engine.directory))
                                        if os.path.exists(engine.directory) else None)
    return res


SCENARIOS = {"async_tp1": async_tp1}

if __name__ == "__main__":
    os.environ.update(VLLM_ENV)
    name, out_path, *rest = sys.argv[1:]
    result = SCENARIOS[name](out_path, *rest)
    with open(out_path, "w") as f:
        json.dump(result, f)
