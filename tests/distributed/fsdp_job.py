"""The FSDP2 job the multi-rank switch tests run, as a user writes it (importable by spawned workers):
a small Qwen2 checkpoint saved with ``save_pretrained``, loaded with ``from_pretrained``, ``fully_shard``
on each layer and on the model, AdamW, and training steps on random batches."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM


def save_tiny_qwen2(path: str | Path, *, vocab_size: int = 256) -> str:
    """Save a 2-layer Qwen2 (hidden 64, 4 heads, 2 kv heads, untied) with seed-0 weights; returns ``path``."""
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size,
                                 tie_word_embeddings=False)).save_pretrained(path)
    return str(path)


def build_fsdp_model(model_dir: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``from_pretrained`` in fp32 (seed 0), ``fully_shard`` per layer and on the model, and its AdamW."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> float:
    """One step on a batch drawn with ``seed``; returns its loss."""
    opt.zero_grad()
    x = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    return loss.item()
