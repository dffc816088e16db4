"""LoRA into a real vLLM (the CPU build), run in its own process by test_vllm_lora.py.

``python _vllm_lora_tasks.py OUT.json`` trains a PEFT LoRA model (a tiny Qwen2 written with
``save_pretrained`` and loaded with ``from_pretrained``, adapters on q/k/v/o and gate/up/down) for three
optimizer steps through ShardingManager with the adapter sync, and writes what it saw: PEFT's greedy tokens
and vLLM's after every step, the bytes every switch moved, the adapters' and the base's bytes as the PEFT
model's own parameters count them, how often vLLM's ``reload_weights`` ran, and sums of the worker's base
tensors that its CPU backend keeps as loaded. Then a second PEFT model whose targets vLLM cannot serve
(``lm_head``) goes through the merged fallback on the same engine.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from _vllm_real_tasks import LLM_KWARGS, VLLM_ENV, hf_greedy, lm_step, vllm_greedy

os.environ.update(VLLM_ENV)

PROMPTS = [[2, 3, 4], [9, 8, 7, 6], [5, 17, 33, 2, 11], [(7 * i + 3) % 60 + 1 for i in range(40)]]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_checkpoint(path: str) -> None:
    """A tiny Qwen2 (head_dim 32, as vLLM's CPU attention needs), saved as users save it."""
    import torch
    import transformers

    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                                      vocab_size=64, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)


def base_sums(worker) -> dict:
    """In the worker: float64 sums of the parameters the CPU backend keeps as loaded (not repacked)."""
    from hybridmem.adapters.vllm.worker import worker_model

    return {n: float(p.double().sum()) for n, p in worker_model(worker).named_parameters()
            if p.numel() and "lora" not in n}


def peft_model(path: str, targets: list[str]):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    return get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                          LoraConfig(r=8, lora_alpha=16, target_modules=targets))


def nbytes(model, lora: bool) -> int:
    """The PEFT model's adapter bytes (lora_A/lora_B weights), or its other parameters' bytes."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if (".lora_A." in n or ".lora_B." in n) == lora)


def main(out_path: str) -> None:
    import torch

    from hybridmem import Direction, ShardingManager
    from hybridmem.adapters.vllm import VLLMEngine
    from hybridmem.weight_sync import LoraRoute, LoraSync

    path = tempfile.mkdtemp(prefix="hybridmem-lora-")
    write_checkpoint(path)
    torch.manual_seed(1)
    model = peft_model(path, TARGETS)
    engine = VLLMEngine.create(path, distributed_executor_backend=None, skip_tokenizer_init=True,
                               enable_lora=True, max_lora_rank=8, max_loras=1, **LLM_KWARGS)
    reloads = []
    rpc = engine.llm.collective_rpc

    def watched(method, *args, **kwargs):
        if method == "reload_weights":
            reloads.append(1)
        return rpc(method, *args, **kwargs)

    engine.llm.collective_rpc = watched
    (loaded_sums,) = engine.llm.collective_rpc(base_sums)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sync = LoraSync(model, engine)
    manager = ShardingManager(model, engine, optimizer=opt, weight_sync=sync)
    res = {"route": sync.route.value, "adapter_nbytes": nbytes(model, True),
           "base_nbytes": nbytes(model, False), "steps": []}
    for step in range(3):
        lm_step(model, opt, step, 64)
        model.eval()
        expected = hf_greedy(model, PROMPTS)
        with model.disable_adapter():
            base = hf_greedy(model, PROMPTS)
        model.train()
        reloads_before = len(reloads)
        manager.to_infer()
        got = vllm_greedy(engine, PROMPTS)
        report = manager.last_reports[Direction.TO_INFER]
        (sync_step,) = [s for s in report.steps if s.name == "weight sync"]
        planned = [p.estimate.transient_nbytes for p in (report.plan.steps if report.plan else ())
                   if p.name == "weight sync"]
        (sums,) = engine.llm.collective_rpc(base_sums)
        res["steps"].append({"expected": expected, "got": got, "base_greedy": base,
                             "synced_nbytes": sync_step.copied_nbytes, "planned_nbytes": planned,
                             "sync_s": sync_step.seconds, "route": sync_step.extra.get("route"),
                             "report_names_route": sync_step.extra["route"] in str(report),
                             "reloads": len(reloads) - reloads_before,
                             "base_sums_unchanged": sums == loaded_sums,
                             "lora_id": engine.lora_request.lora_int_id,
                             "coverage_checked": sync_step.extra["coverage_checked"]})
        manager.to_train()
        if step == 0:
            first_request = engine.lora_request

    # A request naming an older version is refused before vLLM sees it (the engine keeps serving).
    import vllm

    try:
        engine.llm.generate([{"prompt_token_ids": PROMPTS[0]}], vllm.SamplingParams(max_tokens=2),
                            lora_request=first_request)
        res["stale_request"] = "served"
    except ValueError as exc:
        res["stale_request"] = str(exc)

    # lora_base="engine_resident": the same model trains on under a new manager whose engine keeps its base
    # through TRAIN and whose trainer keeps its frozen base on the device; only the adapters move.
    from hybridmem import HybridConfig

    manager.close()
    resident = ShardingManager(model, engine, optimizer=opt,
                               weight_sync=LoraSync(model, engine, send_base=False),
                               config=HybridConfig(lora_base="engine_resident"))
    res["resident"] = {"step_names": [s.name for d in Direction for s in resident.steps(d)], "steps": []}
    for step in range(3, 5):
        lm_step(model, opt, step, 64)
        model.eval()
        expected = hf_greedy(model, PROMPTS)
        model.train()
        reloads_before = len(reloads)
        resident.to_infer()
        frozen = [p for p in model.parameters() if not p.requires_grad]
        trainable = [p for p in model.parameters() if p.requires_grad]
        placed = {"frozen_on_device": all(p.untyped_storage().nbytes() > 0 for p in frozen),
                  "adapters_offloaded": all(p.untyped_storage().nbytes() == 0 for p in trainable)}
        got = vllm_greedy(engine, PROMPTS)
        (sync_step,) = [s for s in resident.last_reports[Direction.TO_INFER].steps if s.name == "weight sync"]
        resident.to_train()
        res["resident"]["steps"].append({"expected": expected, "got": got,
                                         "synced_nbytes": sync_step.copied_nbytes,
                                         "reloads": len(reloads) - reloads_before, **placed})
    resident.close()

    # A target vLLM has no LoRA layer for: the merged weights, on the same engine.
    other = peft_model(path, ["q_proj", "lm_head"])
    with torch.no_grad():
        for n, p in other.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(7))
    other.eval()
    fallback = LoraSync(other, engine)
    engine.resume(["weights", "kv_cache"])
    stats = fallback.sync()
    res["fallback"] = {"route": fallback.route.value, "because": fallback.merged_because,
                       "stats_route": stats.route, "synced_nbytes": stats.received_nbytes,
                       "lora_request": engine.lora_request is not None,
                       "got": vllm_greedy(engine, PROMPTS), "expected": hf_greedy(other, PROMPTS),
                       "base_nbytes": nbytes(other, False)}
    assert fallback.route is LoraRoute.MERGED
    engine.close()
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(sys.argv[1])
