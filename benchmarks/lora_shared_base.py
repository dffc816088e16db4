"""LoRA on one GPU with vLLM: the base kept resident in the engine, then shared with the trainer (the GPU
suite's ``lora``).

    python benchmarks/lora_shared_base.py --device cuda --json lora.json

A small Qwen2 checkpoint (bf16, ``save_pretrained``) is served by vLLM with LoRA (``enable_lora``) at TP 1,
and a PEFT LoRA model of the same checkpoint (adapters on q/k/v/o and gate/up/down) trains for three optimizer
steps under a ShardingManager with the adapter sync (``LoraSync``), first with ``lora_base="engine_resident"``
(two copies of the base on the device), then, with a fresh PEFT model on the same engine, with
``lora_base="shared"`` (the trainer's base as views of vLLM's weights, one copy; [Note: shared base] in
:mod:`hybridmem.weight_sync.shared_base`). After every step it records the bytes the weight sync moved (the
adapters' after the first switch), the switch times, the device memory in use in TRAIN and in INFER
(``torch.cuda.mem_get_info``: vLLM's pools included), and whether vLLM's greedy tokens with the adapter equal
PEFT's. Figures are reported, not asserted; ``ok`` says whether the adapter bytes and the one copy held.

Without a CUDA device or without vLLM the script writes ``{"skipped": why}`` and prints why (exit status 0).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=1024,
              tie_word_embeddings=False)
PROMPTS = [[2, 3, 4, 5], [9, 8, 7, 6, 5, 4], [(7 * i + 3) % 31000 + 1 for i in range(48)]]
MAX_TOKENS = 8


def why_skipped(device: str) -> str | None:
    """Why this machine cannot run the check, or ``None``."""
    if device != "cuda":
        return "needs --device cuda (the shared base needs vLLM's GPU layout; its CPU build repacks weights)"
    import torch

    if not torch.cuda.is_available():
        return f"needs a CUDA device (torch.cuda.is_available() is False, torch {torch.__version__})"
    try:
        import peft  # noqa: F401
        import vllm
    except Exception as exc:  # absent, or a build that fails to load beside this torch
        return f"needs vLLM and PEFT ({type(exc).__name__}: {exc})"
    return None if vllm.__version__ else "vLLM reports no version"


def _used() -> int:
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def _peft_model(path: str):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    torch.manual_seed(1)
    return get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))


def _greedy_hf(model) -> list[list[int]]:
    import torch

    model.eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(ids[0, len(p):].tolist())
    model.train()
    return out


def _greedy_vllm(engine) -> list[list[int]]:
    from hybridmem.engines import SamplingParams

    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=False))
    return [o.token_ids for o in outs]


def _step(model, opt, step: int) -> None:
    import torch

    batch = torch.randint(0, CONFIG["vocab_size"], (4, 64),
                          generator=torch.Generator().manual_seed(step)).cuda()
    opt.zero_grad()
    model(input_ids=batch, labels=batch).loss.backward()
    opt.step()


def run_mode(path: str, engine, mode: str) -> dict:
    """Three steps under ``lora_base=mode``; the figures of each switch."""
    import torch

    from hybridmem import Direction, HybridConfig, ShardingManager
    from hybridmem.weight_sync import LoraSync

    model = _peft_model(path)
    adapters = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".lora_" in n)
    base = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".lora_" not in n)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sync = LoraSync(model, engine)
    manager = ShardingManager(model, engine, optimizer=opt, weight_sync=sync,
                              config=HybridConfig(device="cuda", lora_base=mode))
    out = {"mode": mode, "route": sync.route.value, "adapter_nbytes": adapters, "base_nbytes": base,
           "shared_tensors": len(manager.shared_base.names) if manager.shared_base else 0, "steps": []}
    for step in range(3):
        _step(model, opt, step)
        expected = _greedy_hf(model)
        train_used = _used()
        manager.to_infer()
        infer_used = _used()
        got = _greedy_vllm(engine)
        report = manager.last_reports[Direction.TO_INFER]
        (sync_step,) = [s for s in report.steps if s.name == "weight sync"]
        manager.to_train()
        back = manager.last_reports[Direction.TO_TRAIN]
        out["steps"].append({"synced_nbytes": sync_step.copied_nbytes, "to_infer_s": report.seconds,
                             "to_train_s": back.seconds, "train_used_nbytes": train_used,
                             "infer_used_nbytes": infer_used, "greedy_equal": got == expected,
                             "greedy_agree": sum(a == b for g, e in zip(got, expected, strict=False)
                                                 for a, b in zip(g, e, strict=False))
                             / (len(PROMPTS) * MAX_TOKENS)})
    manager.close()
    del manager, model, opt, sync
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    skipped = why_skipped(args.device)
    if skipped:
        print(f"lora_shared_base: skipped: {skipped}")
        Path(args.json).write_text(json.dumps({"skipped": skipped}))
        return 0
    sys.path.insert(0, str(ROOT))
    import gc

    import torch
    import transformers
    import vllm

    from hybridmem.adapters.vllm import VLLMEngine

    path = tempfile.mkdtemp(prefix="hybridmem-lora-gpu-")
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**CONFIG)).to(torch.bfloat16).save_pretrained(path)
    start = time.perf_counter()
    engine = VLLMEngine.create(path, gpu_memory_utilization=0.3, distributed_executor_backend=None,
                               skip_tokenizer_init=True, enable_lora=True, max_lora_rank=16, max_loras=1,
                               dtype="bfloat16", enforce_eager=True, max_model_len=512, seed=0)
    result = {"vllm": vllm.__version__, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
              "engine_build_s": time.perf_counter() - start, "modes": []}
    for mode in ("engine_resident", "shared"):
        result["modes"].append(run_mode(path, engine, mode))
        gc.collect()
        torch.cuda.empty_cache()
    resident, shared = result["modes"]
    later = [s for m in result["modes"] for s in m["steps"][1:]]
    saved = resident["steps"][-1]["train_used_nbytes"] - shared["steps"][-1]["train_used_nbytes"]
    result["shared_saves_nbytes"] = saved
    result["ok"] = {
        "adapters_only_after_the_first_switch": all(s["synced_nbytes"] == resident["adapter_nbytes"]
                                                    for s in later),
        "shared_holds_one_copy": shared["shared_tensors"] > 0 and saved >= 0.9 * shared["base_nbytes"],
        "greedy_equal": all(s["greedy_equal"] for m in result["modes"] for s in m["steps"]),
    }
    engine.close()
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["ok"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
