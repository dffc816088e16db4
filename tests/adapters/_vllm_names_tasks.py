"""The attach-time name check against a real vLLM (the CPU build), run in its own process by
test_vllm_names_check.py.

``python _vllm_names_tasks.py OUT.json`` builds one ``vllm.LLM`` for a tiny Qwen2 checkpoint, attaches
``VLLMEngine`` to it as vLLM loaded it, then renames a parameter inside the worker's model (as a vLLM
release that names a module differently would) and attaches again; it writes what each attach did as
JSON. A process of its own because ``vllm.LLM`` changes the caller's environment, thread count and
global seed.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from _vllm_real_tasks import (  # this script's own folder is first on sys.path
    LLM_KWARGS,
    VLLM_ENV,
)

RENAMED_FROM = "model.layers.0.self_attn.o_proj.weight"
RENAMED_TO = "model.layers.0.self_attn.out_proj.weight"


def rename_o_proj(model):
    """Run in the worker through ``LLM.apply_model``: layer 0's ``o_proj`` becomes ``out_proj`` (the
    module and its weight are the same objects; only the name differs)."""
    attn = model.get_submodule("model.layers.0.self_attn")
    attn.out_proj = attn.o_proj
    del attn.o_proj
    return sorted(n for n, _ in model.named_parameters() if n.startswith("model.layers.0.self_attn."))


def _attach(llm, **kwargs) -> str:
    from hybridmem.adapters.vllm import VLLMEngine

    try:
        VLLMEngine(llm, release_now=False, **kwargs)
    except ValueError as exc:
        return str(exc)
    return "attached"


def renamed_parameter() -> dict:
    import torch
    import transformers
    import vllm

    # head_dim = 64 / 2 = 32: the smallest the CPU attention backend takes.
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, vocab_size=256,
                                   max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    ckpt = tempfile.mkdtemp()
    transformers.Qwen2ForCausalLM(cfg).float().save_pretrained(ckpt, safe_serialization=True)
    llm = vllm.LLM(model=ckpt, skip_tokenizer_init=True, **LLM_KWARGS)
    res = {"as_loaded": _attach(llm)}
    (res["renamed_params"],) = llm.apply_model(rename_o_proj)
    res["renamed"] = _attach(llm)
    res["renamed_unchecked"] = _attach(llm, check_names=False)
    shutdown = getattr(llm, "shutdown", None)
    if callable(shutdown):
        shutdown()
    return res


def main() -> None:
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    result = renamed_parameter()
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
