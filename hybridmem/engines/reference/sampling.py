"""Sampling: choosing the next token from full-vocabulary logits.

[Note: sampling on every TP rank]
Every tensor-parallel rank gathers the full logits and samples itself, with its own ``torch.Generator``
seeded identically (``seed + sequence index``), so all ranks draw the same tokens without a broadcast.
This needs the gathered logits to be bitwise equal on every rank, which all-gather guarantees.

Log-probs are ``log_softmax`` of the raw (temperature-free, unfiltered) logits in float32, taken at the
chosen token: what vLLM returns by default (``logprobs_mode="raw_logprobs"``).
"""

from __future__ import annotations

import torch

from hybridmem.contract.generation import SamplingParams

__all__ = ["sample_next", "make_generator"]


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """Choose the next token from one sequence's full logits (``[vocab_size]``).

    Returns:
        ``(token, logprob)``, the log-prob as in [Note: sampling on every TP rank].
    """
    logits = logits.float()
    if params.temperature == 0.0:
        token = int(torch.argmax(logits))
    else:
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep a token if the mass before it is < top_p: the smallest prefix reaching top_p.
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        token = int(torch.multinomial(probs, 1, generator=generator))
    logprob = float(torch.log_softmax(logits, dim=-1)[token])
    return token, logprob
