"""ReferenceModel: the per-rank weights of a Llama/Qwen2 decoder and its forward over a paged KV cache.

The math is :mod:`hybridmem.engines.nn.functional` (the same definitions as HF transformers) and the TP
collectives are :mod:`hybridmem.engines.nn.tp`; the weights are in vLLM's per-rank layout ([Note: vLLM
per-rank layout] in :mod:`hybridmem.engines.reference.layout`).

[Note: paged attention, the readable way]
The KV cache is one tensor ``[num_layers, 2, num_blocks, block_size, kv_heads_per_rank, head_dim]``. A
forward takes a batch of chunks (a whole prompt at prefill, one token at decode, mixed freely); the
linear layers run on all tokens of the batch at once, each chunk's new K/V are written to its slots,
and attention then runs per chunk over the keys gathered from its block table, with a causal mask by
absolute position. Speed is not the point: being obviously equal to HF's math is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hybridmem.engines.nn.functional import apply_rope, rms_norm, rope_cos_sin, swiglu
from hybridmem.engines.nn.tp import gather_last_dim, reduce_from_group, vocab_parallel_embedding
from hybridmem.engines.reference.layout import param_shapes
from hybridmem.engines.reference.spec import TPShard

__all__ = ["ReferenceModel", "Chunk"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """New tokens of one sequence in a forward batch.

    Attributes:
        token_ids: The tokens to run (their K/V are not in the cache yet).
        start_pos: Absolute position of ``token_ids[0]`` (= tokens of the sequence already cached).
        slots: Flat cache slots of positions ``0 .. start_pos + len(token_ids) - 1`` (int64, on device).
    """

    token_ids: Sequence[int]
    start_pos: int
    slots: torch.Tensor


class ReferenceModel:
    """Per-rank weights (allocated zeroed) and the forward pass.

    Args:
        shard: Model spec and this rank's TP position.
        group: The TP process group (``None``: single process, or the default group).
        device: Where weights live.
        dtype: Weight and activation dtype.
    """

    def __init__(self, shard: TPShard, *, group: Any, device: torch.device, dtype: torch.dtype):
        self.shard = shard
        self.spec = shard.spec
        self.group = group
        self.device = device
        self.dtype = dtype
        shapes = param_shapes(shard)
        self.params: dict[str, torch.Tensor] = {
            name: torch.zeros(shape, dtype=dtype, device=device) for name, shape in shapes.items()
        }

    @property
    def lm_head(self) -> torch.Tensor:
        """The LM-head matrix (the embedding when tied)."""
        return self.params["model.embed_tokens.weight" if self.spec.tie_word_embeddings else "lm_head.weight"]

    def forward(self, chunks: Sequence[Chunk], kv_cache: torch.Tensor) -> torch.Tensor:
        """Hidden states after the final norm, ``[total new tokens, hidden]`` in chunk order.

        Writes the chunks' K/V into ``kv_cache`` (see [Note: paged attention, the readable way]).
        """
        p, s, sh = self.params, self.spec, self.shard
        d, nh, nkv = s.head_dim, sh.num_heads, sh.num_kv_heads
        tokens = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=self.device)
        positions = torch.cat([
            torch.arange(c.start_pos, c.start_pos + len(c.token_ids), device=self.device) for c in chunks
        ])
        new_slots = torch.cat([c.slots[c.start_pos:] for c in chunks])
        bounds = torch.tensor([0] + [len(c.token_ids) for c in chunks]).cumsum(0).tolist()
        cos, sin = rope_cos_sin(positions, d, s.rope_theta, self.dtype)

        x = vocab_parallel_embedding(tokens, p["model.embed_tokens.weight"], self.group)
        for i in range(s.num_hidden_layers):
            pre = f"model.layers.{i}."
            h = rms_norm(x, p[pre + "input_layernorm.weight"], s.rms_norm_eps)
            qkv = F.linear(h, p[pre + "self_attn.qkv_proj.weight"], p.get(pre + "self_attn.qkv_proj.bias"))
            q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
            q = apply_rope(q.view(-1, nh, d), cos, sin)
            k = apply_rope(k.view(-1, nkv, d), cos, sin)
            k_cache = kv_cache[i, 0].view(-1, nkv, d)
            v_cache = kv_cache[i, 1].view(-1, nkv, d)
            k_cache.index_copy_(0, new_slots, k)
            v_cache.index_copy_(0, new_slots, v.reshape(-1, nkv, d))
            attn = torch.cat([
                self._attend(q[lo:hi], k_cache, v_cache, c, positions[lo:hi])
                for c, lo, hi in zip(chunks, bounds[:-1], bounds[1:])
            ])
            x = x + reduce_from_group(F.linear(attn, p[pre + "self_attn.o_proj.weight"]), self.group)
            h = rms_norm(x, p[pre + "post_attention_layernorm.weight"], s.rms_norm_eps)
            gate, up = F.linear(h, p[pre + "mlp.gate_up_proj.weight"]).chunk(2, dim=-1)
            x = x + reduce_from_group(F.linear(swiglu(gate, up), p[pre + "mlp.down_proj.weight"]), self.group)
        return rms_norm(x, p["model.norm.weight"], s.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``[n, vocab_size]``, identical on every rank (padding cut off)."""
        local = F.linear(hidden, self.lm_head)
        return gather_last_dim(local, self.group)[..., : self.spec.vocab_size]

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: Chunk,
                positions: torch.Tensor) -> torch.Tensor:
        """Causal attention of one chunk's queries ``[n, nh, d]`` over its cached keys; ``[n, nh * d]``."""
        (n, nh, d), nkv = q.shape, k_cache.shape[1]
        k = k_cache.index_select(0, chunk.slots).repeat_interleave(nh // nkv, dim=1)
        v = v_cache.index_select(0, chunk.slots).repeat_interleave(nh // nkv, dim=1)
        mask = torch.arange(k.shape[0], device=q.device)[None, :] <= positions[:, None]
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(0, 1).reshape(n, nh * d)
