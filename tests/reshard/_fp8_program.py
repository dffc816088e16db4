"""Program for test_vllm_fp8.py: hybridmem's FP8 vLLM layout against vLLM's own FP8 classes and loaders.

``python -m tests.reshard._fp8_program REPORT.json`` under a Python whose vLLM is the release to check. For a
dense Qwen3 and a Qwen3-MoE (dims multiples of 128, random bf16 values, transformers' ``save_pretrained``
names), vLLM's own block quantizer (``per_block_cast_to_fp8``) makes the FP8 checkpoint, with
``quantization_config`` as the Hub's FP8 checkpoints have it; four workers build the model with vLLM's classes
and ``quantization="fp8"`` (:mod:`tests.reshard._fp8_tasks`: only the ScaledMM kernel choice is a stand-in)
at each (tp, pp, ep) and load it with ``load_weights``. Every rank's parameters must equal, bit for bit, what
a sync from the bf16 weights gives that rank: hybridmem's quantizer over the bf16 stream
(:func:`~hybridmem.reshard.fp8.quantize_stream`) cut by the FP8 vLLM layout
(:func:`~hybridmem.reshard.iter_shard`).
The dense model's parameters after vLLM's ``process_weights_after_loading`` (the block kernels' base
processing) must be those it loaded. Exits 1 on any difference; writes the report either way.
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch

DENSE = dict(model_type="qwen3", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
             intermediate_size=512, num_hidden_layers=2, vocab_size=256, tie_word_embeddings=False,
             max_position_embeddings=128)
MOE = dict(DENSE, model_type="qwen3_moe", moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2)
CASES = [("qwen3", DENSE, (1, 1, 1)), ("qwen3", DENSE, (2, 1, 1)), ("qwen3", DENSE, (4, 1, 1)),
         ("qwen3", DENSE, (1, 2, 1)), ("qwen3_moe", MOE, (1, 1, 1)), ("qwen3_moe", MOE, (2, 1, 1)),
         ("qwen3_moe", MOE, (2, 1, 2)), ("qwen3_moe", MOE, (1, 2, 1))]
WORLD = 4
KV_CACHE_SCALES = (".attn.q_scale", ".attn.k_scale", ".attn.v_scale", ".attn.prob_scale")
"""Parameters of vLLM's ``Fp8KVCacheMethod`` on every attention layer: no checkpoint tensor and no synced
weight (they scale an FP8 KV cache, which these engines do not use); they keep vLLM's "not loaded" value, -1
(``BaseKVCacheMethod``, vllm/model_executor/layers/quantization/kv_cache.py)."""


def _checkpoint(root: str, kw: dict) -> tuple[str, dict, tuple]:
    import safetensors.torch
    import transformers

    from hybridmem.reshard import ModelSpec
    from hybridmem.reshard.layouts import fp8_quantized_names
    from tests.reshard import _fp8_tasks
    from tests.reshard.families import take_checkpoint

    kw = dict(kw)
    model_type = kw.pop("model_type")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(model_type, **kw, torch_dtype="bfloat16"))
    path = tempfile.mkdtemp(prefix=f"fp8-{model_type}-", dir=root)
    model.save_pretrained(path)
    bf16 = {n: torch.randn(t.shape, dtype=torch.bfloat16) for n, t in take_checkpoint(path).items()}
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    quantized = fp8_quantized_names(ModelSpec.from_hf_config(config))
    safetensors.torch.save_file(_fp8_tasks.quantize_with_vllm(bf16, list(quantized)),
                                f"{path}/model.safetensors")
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if model_type == "qwen3_moe":  # the routers stay bf16, as the Hub's Qwen3-MoE FP8 checkpoints list them
        quant["modules_to_not_convert"] = ["lm_head", *(f"model.layers.{i}.mlp.gate"
                                                          for i in range(config["num_hidden_layers"]))]
    config["quantization_config"] = quant
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    return path, bf16, quantized


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def main(report_path: str) -> int:
    import vllm

    import hybridmem
    from hybridmem.config import ParallelLayout
    from hybridmem.reshard import ModelSpec, iter_shard, vllm_layout
    from hybridmem.reshard.conventions import VLLMConvention
    from hybridmem.reshard.fp8 import block_from_hf_config, quantize_stream
    from hybridmem.testing.workers import WorkerPool
    from tests.reshard import _fp8_tasks

    report: dict = {"vllm": vllm.__version__, "hybridmem": hybridmem.__file__, "cases": [], "failures": []}
    root = tempfile.mkdtemp(prefix="hybridmem-fp8-")
    made = {family: _checkpoint(root, kw) for family, kw in (("qwen3", DENSE), ("qwen3_moe", MOE))}
    with WorkerPool(WORLD, timeout_s=900) as pool:
        for family, _, (tp, pp, ep) in CASES:
            path, bf16, quantized = made[family]
            with open(f"{path}/config.json") as f:
                config = json.load(f)
            spec = ModelSpec.from_hf_config(config)
            conv = VLLMConvention(weight_block_size=block_from_hf_config(config))
            layout = vllm_layout(spec, ParallelLayout(tp=tp, pp=pp, ep=ep), WORLD, convention=conv)
            got = pool.run(_fp8_tasks.fp8_loaded_parameters, path, tp, pp, ep, world_size=WORLD)
            case = {"family": family, "tp": tp, "pp": pp, "ep": ep, "ranks": []}
            for rank in range(WORLD):
                theirs = got[rank]["loaded"]
                ours = dict(iter_shard(quantize_stream(bf16.items(), quantized), layout, rank))
                synced = {n: t for n, t in theirs.items() if not n.endswith(KV_CACHE_SCALES)}
                bad = sorted(set(ours) ^ set(synced))
                for name, tensor in synced.items():
                    if name not in ours:
                        continue
                    mine = ours[name]
                    if mine.dtype != torch.float8_e4m3fn:
                        mine = mine.to(tensor.dtype)  # bf16 -> vLLM's CPU dtype (float32): exact
                    if mine.shape != tensor.shape or mine.dtype != tensor.dtype or not torch.equal(
                            _bits(mine), _bits(tensor)):
                        bad.append(name)
                kv = [n for n in theirs if n.endswith(KV_CACHE_SCALES)]
                if any(float(theirs[n]) != -1.0 for n in kv):
                    bad.append("kv-cache scales not at vLLM's 'not loaded' -1")
                processed = got[rank]["processed"]
                if family == "qwen3":
                    changed = [n for n, t in processed.items() if not torch.equal(_bits(t), _bits(theirs[n]))]
                    bad += [f"processed: {n}" for n in changed]
                fp8_bytes = sum(t.numel() * t.element_size() for t in ours.values())
                bf16_bytes = sum(t.numel() * 2 for n, t in ours.items() if not n.endswith("_scale_inv"))
                case["ranks"].append({
                    "rank": rank, "tensors": len(ours), "compared": len(synced), "differ": bad,
                    "fp8_tensors": sum(t.dtype == torch.float8_e4m3fn for t in ours.values()),
                    "scales": sum(n.endswith("_scale_inv") for n in ours),
                    "fp8_nbytes": fp8_bytes, "bf16_nbytes": bf16_bytes,
                    "kernels": sorted(set(got[rank]["kernels"].values())),
                    "processed": "error" if "error" in processed else len(processed),
                    "processing_error": processed.get("error") if "error" in processed else None})
                if bad:
                    report["failures"].append(f"{family} tp={tp} pp={pp} ep={ep} rank {rank}: {bad[:5]}")
            report["cases"].append(case)
            print(json.dumps({k: case[k] for k in ("family", "tp", "pp", "ep")}),
                  [(r["rank"], r["fp8_nbytes"], r["bf16_nbytes"], len(r["differ"])) for r in case["ranks"]],
                  flush=True)
    with open(report_path, "w") as f:
        json.dump(report, f, indent=1)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
