"""Program for test_vllm_fp8.py: hybridmem's FP8 vLLM layout against vLLM's own FP8 classes and loaders.

``python -m tests.reshard._fp8_program REPORT.json [MODEL ...]`` under a Python whose vLLM is the release to
check (the models of :data:`MODELS` named, default all). For each model (dims multiples of 128, random bf16
values, transformers' ``save_pretrained`` names), vLLM's own block quantizer (``per_block_cast_to_fp8``) makes
the FP8 checkpoint, with ``quantization_config`` as the Hub's FP8 checkpoints have it; four workers build the
model with vLLM's classes and ``quantization="fp8"`` (:mod:`tests.reshard._fp8_tasks`: only the ScaledMM
kernel choice is a stand-in) at each (tp, pp, ep) of :data:`CASES` and load it with ``load_weights``. Every
rank's parameters must equal, bit for bit, what a sync from the bf16 weights gives that rank
(:class:`~hybridmem.weight_sync.fp8.Fp8Target`: the rank's unquantized shards quantized piece by piece), what
the sync's stream hands it over the four ranks from FSDP2-sharded bf16 weights (cells moving quantized, or in
bf16 where a row split falls inside a block: :func:`tests.reshard._fp8_tasks.fp8_streamed`), and
what hybridmem's quantizer over the bf16 stream (:func:`~hybridmem.reshard.fp8.quantize_stream`) cut by the
FP8 vLLM layout (:func:`~hybridmem.reshard.iter_shard`) gives offline.
The dense models' parameters after vLLM's ``process_weights_after_loading`` (the block kernels' base
processing) must be those they loaded. Each layout of :data:`REFUSED` must be refused twice: by hybridmem's
``vllm_layout``, by name, and by vLLM building the model or loading the checkpoint. Exits 1 on any
difference; writes the report either way.
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
# GLM-4.5: q/k/v biases, layer 0 dense (first_k_dense_replace), a shared expert, a float32 router and its
# correction bias; three layers, as vLLM's GLM-4.5 refuses a pipeline stage without a MoE layer.
GLM4_MOE = dict(DENSE, model_type="glm4_moe", num_hidden_layers=3, attention_bias=True,
                moe_intermediate_size=256, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                first_k_dense_replace=1, n_group=1, topk_group=1)
# DeepSeek-V3's MLA: fused_qkv_a_proj is [q_a (256 rows); kv_a (128 + 64 rows)], 448 rows, its last block
# half full as DeepSeek-V3's 2112 rows are; q_b_proj 4 * 192 rows (whole blocks at TP 2, not at TP 4),
# kv_b_proj 4 * 256. Without q_lora_rank (Moonlight's config): kv_a_proj_with_mqa alone, 192 rows, and
# q_proj.
DEEPSEEK_V3 = dict(DENSE, model_type="deepseek_v3", num_key_value_heads=4, moe_intermediate_size=256,
                   n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                   n_group=1, topk_group=1, topk_method="noaux_tc", q_lora_rank=256, kv_lora_rank=128,
                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
# DeepSeek-V3.2: DeepSeek-V3's MLA and MoE with an indexer in every layer; its wq_b [2 x 128, 256] quantized,
# wk and weights_proj (fused by vLLM, unquantized) and k_norm not. GLM-5: the same under GLM's names.
DEEPSEEK_V32 = dict(DEEPSEEK_V3, model_type="deepseek_v32", index_n_heads=2, index_head_dim=128, index_topk=8)
MODELS = {"qwen3": DENSE, "qwen3_moe": MOE, "llama": dict(DENSE, model_type="llama"),
          "mistral": dict(DENSE, model_type="mistral"), "glm4_moe": GLM4_MOE, "deepseek_v3": DEEPSEEK_V3,
          "deepseek_v3_no_q_lora": dict(DEEPSEEK_V3, q_lora_rank=None),
          "deepseek_v3_q_lora_192": dict(DEEPSEEK_V3, q_lora_rank=192),
          "qwen3_moe_wide": dict(MOE, moe_intermediate_size=512), "deepseek_v32": DEEPSEEK_V32,
          "glm5": dict(DEEPSEEK_V32, model_type="glm_moe_dsa")}
"""Mistral's configs are read as Llama's (one family); vLLM builds them with its own MistralForCausalLM."""
DENSE_MODELS = ("qwen3", "llama", "mistral")
"""Models whose every FP8 layer is a linear one: vLLM's processing after loading runs on CPU for them."""
CASES = [(model, layout) for models, layouts in (
    (("qwen3", "llama"), ((1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 1))),
    (("qwen3_moe", "glm4_moe", "deepseek_v3"), ((1, 1, 1), (2, 1, 1), (2, 1, 2), (1, 2, 1))),
    (("mistral",), ((4, 1, 1),)), (("deepseek_v3_no_q_lora",), ((2, 1, 1),)),
    (("qwen3_moe_wide",), ((4, 1, 1), (4, 1, 4))), (("deepseek_v32",), ((2, 1, 1), (2, 1, 2), (1, 2, 1))),
    (("glm5",), ((2, 1, 2),)))
    for model in models for layout in layouts]
"""(model, (tp, pp, ep)) checked rank by rank; ``qwen3_moe_wide``'s experts (512 rows) are whole blocks at
TP 4 with and without expert parallelism."""
REFUSED = [("deepseek_v3", (4, 1, 1), "self_attn.q_b_proj.weight"),
           ("deepseek_v3_q_lora_192", (1, 1, 1), "q_lora_rank=192")]
"""(model, (tp, pp, ep), what hybridmem's refusal names): a shard boundary inside a block (q_b_proj's 192 rows
a rank), which vLLM's ``validate_fp8_block_shape`` refuses too; q_a's 192 rows in fused_qkv_a_proj, so kv_a's
block scales start inside a block, which vLLM builds and then fails to load."""
WORLD = 4
KV_CACHE_SCALES = ("attn.q_scale", "attn.k_scale", "attn.v_scale", "attn.prob_scale")
"""Parameters of vLLM's ``Fp8KVCacheMethod`` on every attention layer (``attn``; MLA's ``mla_attn``): no
checkpoint tensor and no synced weight (they scale an FP8 KV cache, which these engines do not use); they keep
vLLM's "not loaded" value, -1 (``BaseKVCacheMethod``, vllm/model_executor/layers/quantization/kv_cache.py)."""


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


def _same_streamed(got: torch.Tensor, want: torch.Tensor) -> bool:
    """An e4m3 weight or its scales bit for bit; another tensor by value (the stream keeps a router bias the
    model keeps in float32 in float32, where the offline cut has it in the checkpoint's bf16: exact)."""
    if want.dtype == torch.float8_e4m3fn or got.dtype == torch.float8_e4m3fn or want.dtype == got.dtype:
        return got.dtype == want.dtype and torch.equal(_bits(got), _bits(want))
    return got.dtype == torch.float32 and torch.equal(got, want.to(torch.float32))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def main(report_path: str, models: list[str]) -> int:
    import vllm

    import hybridmem
    from hybridmem.config import ParallelLayout
    from hybridmem.reshard import ModelSpec, iter_shard, vllm_layout
    from hybridmem.reshard.conventions import VLLMConvention
    from hybridmem.reshard.fp8 import block_from_hf_config, quantize_stream
    from hybridmem.testing.workers import WorkerPool
    from hybridmem.weight_sync.fp8 import Fp8Target
    from tests.reshard import _fp8_tasks

    report: dict = {"vllm": vllm.__version__, "hybridmem": hybridmem.__file__, "cases": [], "refused": [],
                    "failures": []}
    root = tempfile.mkdtemp(prefix="hybridmem-fp8-")
    made = {model: _checkpoint(root, MODELS[model]) for model in models}

    def layout_of(path: str, tp: int, pp: int, ep: int):
        with open(f"{path}/config.json") as f:
            config = json.load(f)
        conv = VLLMConvention(weight_block_size=block_from_hf_config(config))
        return vllm_layout(ModelSpec.from_hf_config(config), ParallelLayout(tp=tp, pp=pp, ep=ep), WORLD,
                           convention=conv)

    with WorkerPool(WORLD, timeout_s=900) as pool:
        for model, (tp, pp, ep) in [c for c in CASES if c[0] in models]:
            path, bf16, quantized = made[model]
            layout = layout_of(path, tp, pp, ep)
            got = pool.run(_fp8_tasks.fp8_loaded_parameters, path, tp, pp, ep, world_size=WORLD)
            with open(f"{path}/config.json") as f:
                saved = json.load(f)
            streamed = pool.run(_fp8_tasks.fp8_streamed, saved, bf16, tp, pp, ep, world_size=WORLD)
            family = MODELS[model]["model_type"]
            case = {"model": model, "family": family, "tp": tp, "pp": pp, "ep": ep, "ranks": []}
            for rank in range(WORLD):
                theirs = got[rank]["loaded"]
                ours = dict(iter_shard(quantize_stream(bf16.items(), quantized), layout, rank))
                # what a sync hands the engine: the rank's unquantized shards, quantized piece by piece
                target = Fp8Target(layout, rank)
                handed = dict(target.stream(iter_shard(bf16.items(), target.plan_layout(), rank)))
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
                bad += [f"synced: {n}" for n in sorted(set(ours) ^ set(handed))]
                bad += [f"synced: {n}" for n, t in handed.items() if n in ours and (
                    t.dtype != ours[n].dtype or not torch.equal(_bits(t), _bits(ours[n])))]
                # what the sync's stream hands it from FSDP2-sharded weights over the gloo ranks
                over = streamed[rank]["handed"]
                bad += [f"streamed: {n}" for n in sorted(set(ours) ^ set(over))]
                bad += [f"streamed: {n}" for n, t in over.items()
                        if n in ours and not _same_streamed(t, ours[n])]
                kv = [n for n in theirs if n.endswith(KV_CACHE_SCALES)]
                if any(float(theirs[n]) != -1.0 for n in kv):
                    bad.append("kv-cache scales not at vLLM's 'not loaded' -1")
                processed = got[rank]["processed"]
                if model in DENSE_MODELS:
                    changed = [n for n, t in processed.items() if not torch.equal(_bits(t), _bits(theirs[n]))]
                    bad += [f"processed: {n}" for n in changed]
                fp8_bytes = sum(t.numel() * t.element_size() for t in ours.values())
                bf16_bytes = sum(t.numel() * 2 for n, t in ours.items() if not n.endswith("_scale_inv"))
                case["ranks"].append({
                    "rank": rank, "tensors": len(ours), "compared": len(synced), "differ": bad,
                    "fp8_tensors": sum(t.dtype == torch.float8_e4m3fn for t in ours.values()),
                    "scales": sum(n.endswith("_scale_inv") for n in ours),
                    "fp8_nbytes": fp8_bytes, "bf16_nbytes": bf16_bytes,
                    "streamed_cells": {k: streamed[rank][k] for k in ("quantized_cells", "loose_cells")},
                    "kernels": sorted(set(got[rank]["kernels"].values())),
                    "processed": "error" if "error" in processed else len(processed),
                    "processing_error": processed.get("error") if "error" in processed else None})
                if bad:
                    report["failures"].append(f"{model} tp={tp} pp={pp} ep={ep} rank {rank}: {bad[:5]}")
            report["cases"].append(case)
            print(json.dumps({k: case[k] for k in ("model", "tp", "pp", "ep")}),
                  [(r["rank"], r["fp8_nbytes"], r["bf16_nbytes"], len(r["differ"])) for r in case["ranks"]],
                  flush=True)
        for model, (tp, pp, ep), weight in [r for r in REFUSED if r[0] in models]:
            path = made[model][0]
            try:
                layout_of(path, tp, pp, ep)
                ours = None
            except ValueError as exc:
                ours = str(exc)
            theirs = pool.run(_fp8_tasks.fp8_refusal, path, tp, pp, ep, world_size=WORLD)
            refused = {"model": model, "tp": tp, "pp": pp, "ep": ep, "hybridmem": ours, "vllm": theirs}
            report["refused"].append(refused)
            print(json.dumps(refused), flush=True)
            if ours is None or weight not in ours or not all(theirs):
                report["failures"].append(f"{model} tp={tp} pp={pp} ep={ep}: not refused by both, naming "
                                          f"{weight}: {refused}")
    with open(report_path, "w") as f:
        json.dump(report, f, indent=1)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:] or list(MODELS)))
