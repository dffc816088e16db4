"""Small random Llama/Qwen2 models, their HF greedy references, and worker tasks for the engine tests.

Tasks run in :class:`hybridmem.testing.workers.WorkerPool` processes, so they are module-level functions
taking picklable arguments (a config dict, a state dict).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from hybridmem.engines import ReferenceEngine, SamplingParams

# vocab 250 is not a multiple of 64: padded to 256, so the last TP rank holds zeroed padding rows.
_COMMON = dict(vocab_size=250, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               max_position_embeddings=256, rms_norm_eps=1e-6)
CONFIGS = {
    # GQA with qkv bias; at TP4 there are more ranks than kv heads (each kv head on 2 ranks).
    "qwen2_gqa_bias": (Qwen2Config, Qwen2ForCausalLM,
                       dict(_COMMON, num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6,
                            tie_word_embeddings=False)),
    # Tied embeddings, one kv head (MQA): replicated on every rank at TP2 and TP4.
    "llama_tied_mqa": (LlamaConfig, LlamaForCausalLM,
                       dict(_COMMON, num_attention_heads=4, num_key_value_heads=1, rope_theta=10000.0,
                            tie_word_embeddings=True)),
    # kv heads split evenly at every TP size; head_dim 8 given explicitly.
    "llama_even": (LlamaConfig, LlamaForCausalLM,
                   dict(_COMMON, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                        rope_theta=500000.0, tie_word_embeddings=False)),
    # Mistral (Llama's blocks), no sliding window.
    "mistral": (MistralConfig, MistralForCausalLM,
                dict(_COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=None,
                     tie_word_embeddings=False)),
    # Phi-3: q/k/v and gate/up fused in the checkpoint (loaded through load_weights as stored).
    "phi3": (Phi3Config, Phi3ForCausalLM,
             dict(_COMMON, num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)),
}
PROMPTS = [[3, 17, 42, 99, 5], [7, 8], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 249, 0]]
MAX_TOKENS = 10


@dataclass(frozen=True)
class Case:
    """One model: its HF config (object and dict), weights, and HF's greedy continuations and log-probs."""

    name: str
    config: object
    config_dict: dict
    state_dict: dict
    ref_tokens: list
    ref_logprobs: list


def build_hf(name: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """The HF model ``name`` with random weights from ``seed`` (nothing is downloaded)."""
    cfg_cls, model_cls, kwargs = CONFIGS[name]
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    return config, model


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """log_softmax of HF's logits at each generated token, from one forward over prompt + tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].double()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def build_case(name: str, dtype: torch.dtype = torch.float32) -> Case:
    config, model = build_hf(name, dtype)
    tokens, logprobs = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            # An explicit mask: HF would otherwise mask prompt tokens equal to pad_token_id.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0)
            gen = out[0, len(prompt):].tolist()
            tokens.append(gen)
            logprobs.append(hf_logprobs(model, prompt, gen))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return Case(name, config, config.to_dict(), state, tokens, logprobs)


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True)


# Worker tasks ------------------------------------------------------------------------------------
def _engine(ctx, config_dict, state_dict, **kwargs) -> ReferenceEngine:
    engine = ReferenceEngine(config_dict, group=ctx.group, num_kv_blocks=kwargs.pop("num_kv_blocks", 32),
                             block_size=kwargs.pop("block_size", 4), **kwargs)
    engine.load_weights(state_dict.items())
    return engine


def task_generate(ctx, config_dict, state_dict, params, **kwargs):
    """Generate ``PROMPTS``; returns ``(token lists, logprob lists, {name: shape})``."""
    engine = _engine(ctx, config_dict, state_dict, **kwargs)
    outs = engine.generate(PROMPTS, params)
    shapes = {n: tuple(t.shape) for n, t in engine.named_parameters()}
    return [o.token_ids for o in outs], [o.logprobs for o in outs], shapes


def task_params(ctx, config_dict, state_dict):
    """This rank's parameters after ``load_weights`` (for layout checks)."""
    engine = _engine(ctx, config_dict, state_dict)
    return {n: t.clone() for n, t in engine.named_parameters()}


def task_cycles(ctx, config_dict, state_dict, num_cycles):
    """Generate, then ``num_cycles`` x (release both tags, check bytes, resume, rewrite weights, generate).

    Odd cycles rewrite the weights through ``load_weights`` (HF names); even ones write per-rank shards
    in place into ``named_parameters()``, as the resharding engine does.
    """
    engine = _engine(ctx, config_dict, state_dict)
    shards = {n: t.clone() for n, t in engine.named_parameters()}
    before = [o.token_ids for o in engine.generate(PROMPTS, greedy())]
    after, released = [], []
    for cycle in range(num_cycles):
        engine.release(["weights", "kv_cache"])
        released.append((engine.resident_nbytes("weights"), engine.resident_nbytes("kv_cache")))
        engine.resume(["weights", "kv_cache"])
        if cycle % 2:
            engine.load_weights(state_dict.items())
        else:
            for name, t in engine.named_parameters():
                t.copy_(shards[name])
        after.append([o.token_ids for o in engine.generate(PROMPTS, greedy())])
    planned = (engine.planned_nbytes("weights"), engine.planned_nbytes("kv_cache"))
    return before, after, released, planned
