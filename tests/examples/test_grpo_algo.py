"""GRPO arithmetic and the counting task, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from hybridmem.examples.grpo.algo import GRPOConfig, group_advantages, policy_loss
from hybridmem.examples.grpo.task import CountTask


def test_count_task_prompts_and_rewards():
    task = CountTask(vocab_size=5, prompt_len=3, completion_len=4)
    prompts = task.prompts(4, seed=0)
    assert prompts == task.prompts(4, seed=0)
    for p in prompts:
        assert [(b - a) % 5 for a, b in zip(p, p[1:])] == [1, 1]
    r = task.rewards([[2, 3, 4], [2, 3, 4]], [[0, 1, 2, 3], [0, 2, 3, 0]])
    assert r.tolist() == [1.0, 0.5]  # 4->0 wraps; second: 4->0 ok, 0->2 no, 2->3 ok, 3->0 no
    with pytest.raises(ValueError, match="CountTask.vocab_size=0"):
        CountTask(vocab_size=0)


def test_group_advantages_are_normalised_per_group():
    r = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 4.0, 6.0, 8.0])
    adv = group_advantages(r, 4)
    g1 = torch.tensor([1.0, 0.0, 0.5, 0.5])
    torch.testing.assert_close(adv[:4], (g1 - 0.5) / (g1.std() + 1e-6))
    torch.testing.assert_close(adv[4:].mean(), torch.tensor(0.0))
    assert torch.equal(group_advantages(torch.ones(4), 2), torch.zeros(4))  # no signal in a tied group
    with pytest.raises(ValueError, match="5 rewards do not split into groups of 2"):
        group_advantages(torch.ones(5), 2)


def test_policy_loss_clips_and_penalises_kl():
    adv = torch.tensor([1.0, -1.0])
    old = torch.zeros(2, 1)
    ref = torch.zeros(2, 1)
    lp = torch.tensor([[math.log(1.5)], [math.log(1.5)]])  # ratio 1.5 on both rows
    loss, stats = policy_loss(lp, old, ref, adv, clip_ratio=0.2, kl_coef=0.0)
    # row 0 (A=+1): min(1.5, 1.2) = 1.2; row 1 (A=-1): min(-1.5, -1.2) = -1.5
    torch.testing.assert_close(loss, torch.tensor(-(1.2 - 1.5) / 2))
    assert stats["clip_frac"] == 1.0
    loss_kl, stats_kl = policy_loss(lp, old, ref, adv, clip_ratio=0.2, kl_coef=1.0)
    d = -math.log(1.5)
    expected_kl = math.exp(d) - d - 1
    assert stats_kl["kl"] == pytest.approx(expected_kl)
    torch.testing.assert_close(loss_kl, loss + expected_kl)


def test_grpo_config_errors():
    with pytest.raises(ValueError, match="group_size=1"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="clip_ratio=1.5"):
        GRPOConfig(clip_ratio=1.5)


def test_policy_loss_with_asymmetric_rows_and_the_direction_of_its_gradient():
    # Row 0: A=+2, ratio 1.5 -> min(3.0, clip 1.2 * 2 = 2.4) = 2.4; row 1: A=-1, ratio 0.5 ->
    # min(-0.5, clip 0.8 * -1 = -0.8) = -0.8. Loss = -(2.4 - 0.8) / 2 = -0.8 (a flipped sign gives 1.25).
    adv = torch.tensor([2.0, -1.0])
    old = torch.zeros(2, 1)
    lp = torch.tensor([[math.log(1.5)], [math.log(0.5)]])
    loss, stats = policy_loss(lp, old, old, adv, clip_ratio=0.2, kl_coef=0.0)
    torch.testing.assert_close(loss, torch.tensor(-0.8))
    assert stats["clip_frac"] == 1.0
    # Unclipped (ratio 1): gradient descent must raise the log-prob of a token with a positive advantage
    # and lower it for a negative one: d loss / d logp = -A * ratio / num_rows.
    lp = torch.zeros(2, 1, requires_grad=True)
    loss, _ = policy_loss(lp, old, old, adv, clip_ratio=0.2, kl_coef=0.0)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0], [0.5]]))


def test_better_completions_get_positive_advantages():
    adv = group_advantages(torch.tensor([0.0, 1.0, 0.25, 0.25, 3.0, 1.0, 2.0, 2.0]), 4)
    assert adv[1] > 0 > adv[0] and adv[4] > 0 > adv[5]
    assert adv.argmax().item() in (1, 4) and adv[2] == adv[3] < 0


def test_the_reward_model_scores_as_the_tasks_rule():
    """hybridmem/examples/grpo/reward.py's network against CountTask.rewards (the rule, written separately):
    random sequences, and counting ones that score 1 (with wrap-around past the vocabulary's end)."""
    import torch

    from hybridmem.examples.grpo.reward import CountRewardModel
    from hybridmem.examples.grpo.task import CountTask

    task = CountTask()
    seqs = torch.randint(0, task.vocab_size, (256, task.prompt_len + task.completion_len),
                         generator=torch.Generator().manual_seed(0))
    seqs[:16] = torch.tensor([[(s + j) % task.vocab_size for j in range(seqs.shape[1])] for s in range(16)])
    ids = seqs.tolist()
    rule = task.rewards([s[:task.prompt_len] for s in ids], [s[task.prompt_len:] for s in ids])
    scores = CountRewardModel(task)(seqs)
    assert torch.equal(scores, rule) and scores[:16].eq(1).all() and 0 < scores[16:].mean() < 0.5
