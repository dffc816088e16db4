"""docs/vllm.md's plain-process program with vLLM's defaults, run by test_vllm_real_defaults.py in a process
of its own: ``python _vllm_defaults_tasks.py OUT.json``.

The checkpoint is ``save_pretrained``'s (no tokenizer), ``VLLMEngine.create`` gets neither ``max_model_len``
nor a KV-cache size, and ``VLLM_CPU_KVCACHE_SPACE`` is not set: what a new user runs. It reports the KV
cache vLLM built, the greedy tokens of vLLM and transformers after each training step, the rotary cache
around the syncs, and a load that leaves out one tensor; its output (vLLM logs to stdout) goes to the test.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from _vllm_real_tasks import hf_greedy, vllm_greedy

NUM_STEPS = 2


def kv_cache_nbytes(worker) -> int:
    """Bytes of the KV-cache tensors vLLM allocated in the worker (distinct storages)."""
    seen = {}
    for t in worker.model_runner.kv_caches:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def rope_caches(worker) -> list:
    """A copy of every rotary embedding's ``cos_sin_cache``."""
    from hybridmem.adapters.vllm.worker import worker_model

    return [m.cos_sin_cache.clone() for m in worker_model(worker).modules() if hasattr(m, "cos_sin_cache")]


def main(out_path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from hybridmem import ShardingManager
    from hybridmem.adapters.vllm import VLLMEngine

    path = os.path.join(tempfile.mkdtemp(), "my-policy")
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 vocab_size=512)).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = VLLMEngine.create(path, dtype="float32", skip_tokenizer_init=True, enforce_eager=True, seed=0)
    config = engine.llm.llm_engine.vllm_config
    res = {"max_model_len": config.model_config.max_model_len,
           "max_num_seqs": config.scheduler_config.max_num_seqs,
           "num_blocks": config.cache_config.num_gpu_blocks, "block_size": config.cache_config.block_size,
           "kv_cache_memory_bytes": config.cache_config.kv_cache_memory_bytes,
           "kv_allocated_nbytes": engine.llm.collective_rpc(kv_cache_nbytes)[0],
           "buffer_only_modules": list(engine.worker_info.buffer_only_modules), "steps": []}
    (rope_before,) = engine.llm.collective_rpc(rope_caches)
    manager = ShardingManager(model, engine, optimizer=optimizer)
    for step in range(NUM_STEPS):
        expected = hf_greedy(model)
        print(f"=== switch {step} ===", file=sys.stderr, flush=True)
        with manager.inference() as e:
            got = vllm_greedy(e)
        print(f"=== switch {step} done ===", file=sys.stderr, flush=True)
        res["steps"].append({"expected": expected, "got": got})
        for out in got:  # the docs' likelihood step stands in for an RL loss
            ids = torch.tensor([out])
            model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    (rope_after,) = engine.llm.collective_rpc(rope_caches)
    res["rope_caches"] = len(rope_before)
    res["rope_kept"] = len(rope_before) == len(rope_after) and all(
        torch.equal(a, b) for a, b in zip(rope_before, rope_after))
    # A load that leaves out the final norm: vLLM must still say so, for a module that has parameters.
    expected = hf_greedy(model)
    # In INFER the training parameters are offloaded: the load takes copies made before the switch.
    weights = [(n, p.detach().clone()) for n, p in model.named_parameters() if n != "model.norm.weight"]
    print("=== partial load ===", file=sys.stderr, flush=True)
    with manager.inference() as e:
        e.load_weights(iter(weights))
        res["partial"] = {"expected": expected, "got": vllm_greedy(e)}
    print("=== partial load done ===", file=sys.stderr, flush=True)
    engine.close()
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
