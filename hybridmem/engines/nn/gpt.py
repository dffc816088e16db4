"""A trainable, tensor-parallel Llama/Qwen2 decoder in plain PyTorch, holding Megatron-core's layout.

Its architecture is a :class:`~hybridmem.reshard.ModelSpec` the embedded blocks run
(:func:`hybridmem.engines.nn.config.embedded_spec` reads and checks one).

The example GRPO trainer (:mod:`hybridmem.examples.grpo`) trains this model when it runs without
Megatron. Its parameters carry Megatron-core's GPT names and per-rank shapes (local layer spec), so the
resharding engine converts it to the inference layout exactly as it converts a real Megatron model:

- ``embedding.word_embeddings.weight`` ``[Vp / tp, H]`` (vocab padded to ``Vp``, rows split by rank);
- ``decoder.layers.{i}.input_layernorm.weight`` ``[H]``;
- ``decoder.layers.{i}.self_attention.linear_qkv.weight|bias``: this rank's query groups, each group's
  rows ``[q heads of the group; k; v]`` (Megatron's interleaved QKV);
- ``decoder.layers.{i}.self_attention.linear_proj.weight`` ``[H, nq / tp * hd]`` (row-parallel);
- ``decoder.layers.{i}.pre_mlp_layernorm.weight`` ``[H]``;
- ``decoder.layers.{i}.mlp.linear_fc1.weight`` ``[2 * I / tp, H]`` as ``[gate_r; up_r]``;
- ``decoder.layers.{i}.mlp.linear_fc2.weight`` ``[H, I / tp]`` (row-parallel);
- ``decoder.final_layernorm.weight`` ``[H]``; ``output_layer.weight`` ``[Vp / tp, H]`` unless tied.

The math is :mod:`hybridmem.engines.nn.functional` (the same functions as HF transformers), so for the same
weights the full-vocab logits equal ``Qwen2ForCausalLM``'s / ``LlamaForCausalLM``'s.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridmem.engines.nn.functional import apply_rope, rms_norm, rope_cos_sin, swiglu
from hybridmem.engines.nn.tp import (
    copy_to_group,
    gather_last_dim,
    group_size,
    reduce_from_group,
    vocab_parallel_embedding,
)
from hybridmem.reshard.spec import ModelSpec

__all__ = ["MegatronLayoutGPT", "init_hf_weights", "allreduce_grads"]


def init_hf_weights(config: ModelSpec, *, seed: int, std: float = 0.02,
                    dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random full (unsharded) weights under HF names, the same on every rank for the same ``seed``.

    Linear and embedding weights are ``N(0, std)``, biases small, norms ones (as HF initialises them).
    """
    g = torch.Generator().manual_seed(seed)
    H, ffn, hd = config.hidden_size, config.intermediate_size, config.head_dim
    nq, nkv = config.num_attention_heads, config.num_key_value_heads

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(config.vocab_size, H)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = torch.ones(H, dtype=dtype)
        out[p + "self_attn.q_proj.weight"] = normal(nq * hd, H)
        out[p + "self_attn.k_proj.weight"] = normal(nkv * hd, H)
        out[p + "self_attn.v_proj.weight"] = normal(nkv * hd, H)
        if config.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = normal(nq * hd)
            out[p + "self_attn.k_proj.bias"] = normal(nkv * hd)
            out[p + "self_attn.v_proj.bias"] = normal(nkv * hd)
        out[p + "self_attn.o_proj.weight"] = normal(H, nq * hd)
        out[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=dtype)
        out[p + "mlp.gate_proj.weight"] = normal(ffn, H)
        out[p + "mlp.up_proj.weight"] = normal(ffn, H)
        out[p + "mlp.down_proj.weight"] = normal(H, ffn)
    out["model.norm.weight"] = torch.ones(H, dtype=dtype)
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = normal(config.vocab_size, H)
    return out


class _Layer(torch.nn.Module):
    """One decoder layer's parameters, named as Megatron's local spec names them."""

    def __init__(self, config: ModelSpec, tp: int, dtype: torch.dtype, device: Any):
        super().__init__()
        H, hd = config.hidden_size, config.head_dim
        groups = config.num_key_value_heads // tp
        q_per_group = config.num_attention_heads // config.num_key_value_heads
        qkv_rows = groups * (q_per_group + 2) * hd
        kw = {"dtype": dtype, "device": device}
        self.input_layernorm = _Weight(torch.ones(H, **kw))
        self.self_attention = torch.nn.Module()
        self.self_attention.linear_qkv = _Weight(torch.empty(qkv_rows, H, **kw), bias=config.qkv_bias)
        self.self_attention.linear_proj = _Weight(torch.empty(H, groups * q_per_group * hd, **kw))
        self.pre_mlp_layernorm = _Weight(torch.ones(H, **kw))
        self.mlp = torch.nn.Module()
        self.mlp.linear_fc1 = _Weight(torch.empty(2 * config.intermediate_size // tp, H, **kw))
        self.mlp.linear_fc2 = _Weight(torch.empty(H, config.intermediate_size // tp, **kw))


class _Weight(torch.nn.Module):
    """A holder of ``weight`` (and optionally ``bias``), so parameter names match Megatron's."""

    def __init__(self, weight: torch.Tensor, *, bias: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(weight.shape[0], dtype=weight.dtype,
                                                       device=weight.device))


class MegatronLayoutGPT(torch.nn.Module):
    """A Llama/Qwen2 decoder, tensor parallel over ``group``, with Megatron-core's parameter layout.

    Args:
        config: The decoder's shape.
        padded_vocab_size: Rows of the embedding / output layer over all ranks (Megatron pads the vocab
            to a multiple of ``make_vocab_size_divisible_by * tp``); must divide by the TP size.
        group: The tensor-parallel group (``None`` without ``torch.distributed``: TP1).
        dtype: Parameter dtype.
        device: Parameter device.

    Parameters are created uninitialised; load them with :meth:`load_state_dict` (per-rank Megatron
    state dict, e.g. from ``hybridmem.reshard`` sharding full HF weights).
    """

    def __init__(
        self,
        config: ModelSpec,
        *,
        padded_vocab_size: int,
        group: Any = None,
        dtype: torch.dtype = torch.float32,
        device: Any = "cpu",
    ):
        super().__init__()
        tp = group_size(group)
        problems = {
            "num_key_value_heads": config.num_key_value_heads,
            "intermediate_size": config.intermediate_size,
            "padded_vocab_size": padded_vocab_size,
        }
        for key, value in problems.items():
            if value % tp:
                raise ValueError(f"{key}={value} is not divisible by the tensor-parallel size {tp}")
        if padded_vocab_size < config.vocab_size:
            raise ValueError(f"padded_vocab_size={padded_vocab_size} is smaller than "
                             f"vocab_size={config.vocab_size}")
        self.config = config
        self.group = group
        self.tp = tp
        self.padded_vocab_size = padded_vocab_size
        kw = {"dtype": dtype, "device": device}
        self.embedding = torch.nn.Module()
        self.embedding.word_embeddings = _Weight(torch.empty(padded_vocab_size // tp, config.hidden_size,
                                                             **kw))
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(_Layer(config, tp, dtype, device)
                                                  for _ in range(config.num_hidden_layers))
        self.decoder.final_layernorm = _Weight(torch.ones(config.hidden_size, **kw))
        if not config.tie_word_embeddings:
            self.output_layer = _Weight(torch.empty(padded_vocab_size // tp, config.hidden_size, **kw))

    def _attention(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        B, S, _ = h.shape
        q_per_group = cfg.num_attention_heads // cfg.num_key_value_heads
        qkv = F.linear(copy_to_group(h, self.group), layer.self_attention.linear_qkv.weight,
                       getattr(layer.self_attention.linear_qkv, "bias", None))
        qkv = qkv.view(B, S, -1, q_per_group + 2, cfg.head_dim)  # [B, S, groups, q heads + k + v, hd]
        groups = qkv.shape[2]
        q = qkv[:, :, :, :q_per_group].reshape(B, S, groups * q_per_group, cfg.head_dim)
        k, v = qkv[:, :, :, q_per_group], qkv[:, :, :, q_per_group + 1]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, hd]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out = out.transpose(1, 2).reshape(B, S, -1)
        return reduce_from_group(F.linear(out, layer.self_attention.linear_proj.weight), self.group)

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(copy_to_group(h, self.group), layer.mlp.linear_fc1.weight).chunk(2, dim=-1)
        return reduce_from_group(F.linear(swiglu(gate, up), layer.mlp.linear_fc2.weight), self.group)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits over the real vocab, ``[batch, seq, vocab_size]``, identical on every TP rank.

        Sequences are unpadded and start at position 0 (the GRPO example uses fixed-length prompts and
        completions).
        """
        cfg = self.config
        x = vocab_parallel_embedding(tokens, self.embedding.word_embeddings.weight, self.group)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        for layer in self.decoder.layers:
            x = x + self._attention(layer, rms_norm(x, layer.input_layernorm.weight, cfg.rms_norm_eps),
                                    cos, sin)
            x = x + self._mlp(layer, rms_norm(x, layer.pre_mlp_layernorm.weight, cfg.rms_norm_eps))
        x = rms_norm(x, self.decoder.final_layernorm.weight, cfg.rms_norm_eps)
        head = self.embedding.word_embeddings if cfg.tie_word_embeddings else self.output_layer
        logits = gather_last_dim(F.linear(copy_to_group(x, self.group), head.weight), self.group)
        return logits[..., : cfg.vocab_size]

    def token_logprobs(self, tokens: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
        """Log-probability of each token given its prefix, ``[batch, seq - 1]`` (tokens ``1..``)."""
        logits = self(tokens)[:, :-1]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def allreduce_grads(model: torch.nn.Module, group: Any) -> None:
    """Average gradients over the data-parallel ``group`` (one flat all-reduce; no-op for one rank)."""
    size = group_size(group)
    if size == 1:
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()
