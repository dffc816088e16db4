"""The demo's task: continue a count, a verifiable reward a tiny policy learns within minutes on CPU.

A prompt is ``prompt_len`` consecutive tokens counting up from a random start (``5 6 7`` with
``vocab_size = 16``, wrapping to 0 after ``vocab_size - 1``); the policy must continue the count for
``completion_len`` tokens (``8 9 10 11``). The reward of a completion is the fraction of its tokens that
equal the previous token plus one (mod ``vocab_size``), so a random policy scores ``1 / vocab_size`` and
a perfect one 1.0; partial credit gives a smooth learning signal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CountTask"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CountTask:
    """Prompts and rewards of the counting task."""

    vocab_size: int = 16
    prompt_len: int = 3
    completion_len: int = 4

    def __post_init__(self) -> None:
        for key in ("vocab_size", "prompt_len", "completion_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"CountTask.{key}={getattr(self, key)} must be >= 1")

    def prompts(self, num_prompts: int, *, seed: int) -> list[list[int]]:
        """``num_prompts`` prompts, reproducible from ``seed``."""
        starts = torch.randint(0, self.vocab_size, (num_prompts,),
                               generator=torch.Generator().manual_seed(seed))
        return [[(int(s) + j) % self.vocab_size for j in range(self.prompt_len)] for s in starts]

    def rewards(self, prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
        """Reward in ``[0, 1]`` per completion: the fraction of steps that count up by one."""
        out = torch.empty(len(completions), dtype=torch.float32)
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            seq = [prompt[-1], *completion[: self.completion_len]]
            hits = sum((b - a) % self.vocab_size == 1 for a, b in zip(seq, seq[1:]))
            out[i] = hits / self.completion_len
        return out
