"""GRPO's arithmetic: group-normalised advantages and the clipped policy loss with a KL penalty.

Pure tensor functions, so each is tested on its own; the loop in :mod:`hybridmem.examples.grpo.loop`
wires them to the policy, the engine and the ShardingManager.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GRPOConfig", "group_advantages", "policy_loss"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GRPOConfig:
    """GRPO hyper-parameters (names as verl / MindSpeed-RL use them)."""

    group_size: int = 8
    """Completions sampled per prompt (``n_samples_per_prompt``)."""
    clip_ratio: float = 0.2
    """PPO clip range epsilon."""
    kl_coef: float = 0.02
    """Weight of the KL penalty to the reference policy (``kl_ctrl.kl_coef``)."""
    lr: float = 3e-3
    ppo_epochs: int = 2
    """Optimizer steps per rollout batch (the ratio leaves 1 from the second on, so clipping matters)."""
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"GRPOConfig.group_size={self.group_size} must be >= 2 "
                             "(advantages are group-relative)")
        if not 0 < self.clip_ratio < 1:
            raise ValueError(f"GRPOConfig.clip_ratio={self.clip_ratio} must be in (0, 1)")
        if self.kl_coef < 0 or self.lr <= 0 or self.ppo_epochs < 1 or self.temperature <= 0:
            raise ValueError(
                f"GRPOConfig needs kl_coef >= 0, lr > 0, ppo_epochs >= 1, temperature > 0; got "
                f"kl_coef={self.kl_coef}, lr={self.lr}, ppo_epochs={self.ppo_epochs}, "
                f"temperature={self.temperature}"
            )


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """``(r - mean(group)) / (std(group) + eps)`` per completion; ``rewards`` is grouped consecutively."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)
    adv = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + eps)
    return adv.view(-1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_ratio: float,
    kl_coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss over completion tokens (all ``[batch, tokens]``; ``advantages`` is ``[batch]``).

    Clipped surrogate ``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)`` plus ``kl_coef`` times the
    k3 estimator of KL(policy || reference), ``exp(ref - logp) - (ref - logp) - 1`` (non-negative, as in
    the GRPO paper), both averaged over tokens.

    Returns:
        The loss and figures for the log (``kl``, ``clip_frac``).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * adv)
    delta = ref_logprobs - logprobs
    kl = torch.exp(delta) - delta - 1
    loss = (-surrogate + kl_coef * kl).mean()
    stats = {"kl": float(kl.detach().mean()),
             "clip_frac": float(((ratio.detach() - 1).abs() > clip_ratio).float().mean())}
    return loss, stats
