"""vLLM's own DeepSeek sparse attention models on a GPU against hybridmem's vLLM layout (the GPU suite's
``dsa``).

    python benchmarks/vllm_sparse_attention.py --device cuda --json dsa.json

For DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``): a small checkpoint written by transformers
(``save_pretrained``, random values), with the attention sizes vLLM's sparse MLA kernels take
(``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64, an indexer head of 128), is built by the installed vLLM on the
GPU as vLLM serves these models there (the CUDA class of ``vllm.models.deepseek_v32``, its sparse attention
backend and indexer, TP 1, no engine) and filled by the model's own ``load_weights``. Every parameter it has,
name, shape and value, must equal ``shard(checkpoint, vllm_layout(spec, TP 1), 0)``. The CPU tests
(tests/reshard/test_vllm_names.py) build the same models with vLLM's MLA backend in place of the sparse one,
which vLLM's CPU platform refuses.

Without a CUDA device or without vLLM the script writes ``{"skipped": why}`` and prints why (exit status 0).
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import time
from pathlib import Path

FAMILIES = {
    "deepseek_v32": dict(n_shared_experts=1, qk_nope_head_dim=128, v_head_dim=128, index_n_heads=64),
    # GLM-5: the same architecture under GLM's names, wider nope and value heads.
    "glm_moe_dsa": dict(n_shared_experts=1, qk_nope_head_dim=192, v_head_dim=256, index_n_heads=32),
}
COMMON = dict(hidden_size=256, num_hidden_layers=2, vocab_size=512, max_position_embeddings=4096,
              num_attention_heads=64, num_key_value_heads=64, intermediate_size=512, n_routed_experts=8,
              num_experts_per_tok=2, moe_intermediate_size=128, q_lora_rank=256, kv_lora_rank=512,
              qk_rope_head_dim=64, first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="noaux_tc",
              index_head_dim=128, index_topk=2048, tie_word_embeddings=False, torch_dtype="bfloat16")
"""Sizes the sparse MLA and indexer kernels accept (a latent of 512 + 64 rotary, 64 heads, indexer heads of
128); hidden size, layers, experts and vocabulary small."""


def why_skipped(device: str) -> str | None:
    """Why this machine cannot run the check, or ``None``."""
    if device != "cuda":
        return "needs --device cuda (vLLM's CPU platform refuses sparse attention)"
    import torch

    if not torch.cuda.is_available():
        return f"needs a CUDA device (torch.cuda.is_available() is False, torch {torch.__version__})"
    try:
        import vllm
    except Exception as exc:  # absent, or a build that fails to load beside this torch
        return f"needs vLLM ({type(exc).__name__}: {exc})"
    return None if vllm.__version__ else "vLLM reports no version"


def _checkpoint(model_type: str, path: Path) -> dict:
    """Write a transformers checkpoint of ``model_type`` into ``path``; its ``{name: tensor}`` (bfloat16)."""
    import safetensors.torch
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **{**COMMON, **FAMILIES[model_type]})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(path)
    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(safetensors.torch.load_file(f))
        f.unlink()
    gen = torch.Generator().manual_seed(1)
    weights = {n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in sorted(weights.items())}
    safetensors.torch.save_file(weights, path / "model.safetensors")
    return weights


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_family(model_type: str, root: Path) -> dict:
    """Build ``model_type``'s checkpoint with vLLM on the GPU and compare every loaded parameter."""
    import torch
    from vllm.config import (
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import parallel_state
    from vllm.model_executor.model_loader.utils import initialize_model

    from hybridmem.config import ParallelLayout
    from hybridmem.reshard import ModelSpec, shard, vllm_layout

    path = root / model_type
    path.mkdir()
    weights = _checkpoint(model_type, path)
    spec = ModelSpec.from_hf_config(json.loads((path / "config.json").read_text()))
    ours = shard(weights, vllm_layout(spec, ParallelLayout(), 1), 0)
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="bfloat16",
                                 enforce_eager=True, max_model_len=4096, seed=0),
        load_config=LoadConfig(load_format="dummy"), parallel_config=ParallelConfig(),
        device_config=DeviceConfig("cuda"))
    t = time.perf_counter()
    with set_current_vllm_config(vllm_config):
        if parallel_state._WORLD is None:
            parallel_state.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{_free_port()}", 0,
                                                        backend="nccl")
        parallel_state.initialize_model_parallel(1, 1)
        try:
            with torch.device("cuda"):
                model = initialize_model(vllm_config=vllm_config)
            model.load_weights(iter(sorted(weights.items())))
            theirs = {n: p.detach().cpu() for n, p in model.named_parameters()}
            cls = f"{type(model).__module__}.{type(model).__qualname__}"
            attention = sorted({f"{type(m).__module__}.{type(m).__qualname__}"
                                for n, m in model.named_modules() if n.endswith("self_attn.indexer")})
        finally:
            parallel_state.destroy_model_parallel()
    missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    wrong = sorted(n for n in set(ours) & set(theirs)
                   if ours[n].shape != theirs[n].shape
                   or not torch.equal(ours[n].to(theirs[n].dtype), theirs[n]))
    indexer = sorted(n for n in theirs if ".indexer." in n)
    return {"model_class": cls, "indexer_class": attention, "parameters": len(theirs),
            "indexer_parameters": len(indexer), "missing_in_vllm": missing, "not_in_layout": extra,
            "different": wrong, "build_load_s": time.perf_counter() - t,
            "ok": not missing and not extra and not wrong and bool(indexer)
            and cls.startswith("vllm.models.deepseek_v32.")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--json", required=True, help="where to write the figures")
    args = parser.parse_args(argv)
    out = Path(args.json)
    why = why_skipped(args.device)
    if why is not None:
        print(f"vllm_sparse_attention.py: skipped: {why}")
        out.write_text(json.dumps({"skipped": why}))
        return 0
    import vllm

    results = {"vllm": vllm.__version__, "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in FAMILIES:
            results["families"][model_type] = res = check_family(model_type, Path(tmp))
            print(json.dumps({model_type: res}, indent=1), flush=True)
    out.write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results["families"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
