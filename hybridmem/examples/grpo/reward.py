"""The demo's reward model: a small network co-resident on the devices that scores rollouts of the
counting task (``--reward model``).

Its one weight is a ``vocab_size x vocab_size`` table whose row ``a`` scores each token that may follow
``a``; built from the task, the table holds 1 where ``b = a + 1 (mod vocab_size)`` and 0 elsewhere, so the
network scores each completion as the task's rule does (a learned reward model would be trained towards
that table). Kept that way on purpose: a run scored by the model learns exactly as a run scored by the
rule, so the two are compared reward for reward, and what the model adds is its place in memory (its
weights offloaded to the host except while it scores, :meth:`hybridmem.ShardingManager.onloaded`).
"""

from __future__ import annotations

import torch

from hybridmem.examples.grpo.task import CountTask

__all__ = ["CountRewardModel"]


class CountRewardModel(torch.nn.Module):
    """Scores ``[batch, prompt_len + completion_len]`` token sequences in ``[0, 1]``.

    Args:
        task: The task whose completions it scores.
        device: Where its weights are built.
    """

    def __init__(self, task: CountTask, *, device: torch.device | str = "cpu"):
        super().__init__()
        self.prompt_len, self.completion_len = task.prompt_len, task.completion_len
        V = task.vocab_size
        self.successor = torch.nn.Embedding(V, V, device=device)
        with torch.no_grad():
            self.successor.weight.zero_()
            self.successor.weight[torch.arange(V), (torch.arange(V) + 1) % V] = 1.0
        self.requires_grad_(False)

    def forward(self, seqs: torch.Tensor) -> torch.Tensor:
        """The score of each sequence: the mean, over its completion tokens, of the table's entry for the
        token before and the token itself."""
        P, C = self.prompt_len, self.completion_len
        before, tokens = seqs[:, P - 1:P + C - 1], seqs[:, P:P + C]
        hits = self.successor(before).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [batch, C]
        return hits.sum(dim=1) / C
