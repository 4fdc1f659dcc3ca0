"""The group-relative RL math (rl.group_math) against numbers worked out by hand."""

import math

import pytest
import torch

from lorakit.rl.group_math import (
    STD_EPSILON,
    aggregate_loss,
    global_whiten,
    group_advantages,
    group_policy_loss,
    importance_ratio,
    kl_estimate,
    reinforce_pp_returns,
    zero_spread_groups,
)

# Two prompts, four answers each: one right answer in the first group, the second group all alike.
SCORES = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
CENTRED = [0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]


def close(actual, expected, tolerance=1e-6):
    expected = torch.as_tensor(expected, dtype=torch.float32)
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float32), expected, atol=tolerance, rtol=0), actual


def test_groups_split_whole_and_a_group_whose_answers_all_scored_alike_is_found():
    assert zero_spread_groups(SCORES, 4).tolist() == [False, True]
    assert zero_spread_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 3.0, 3.0]), 2).tolist() == [True, False, True]
    with pytest.raises(ValueError, match="7 rows do not split into groups of 4"):
        group_advantages(SCORES[:7], 4, "grpo")


def test_grpo_advantages_scale_by_the_group_the_batch_or_nothing():
    # Group 1: mean 0.25, unbiased std sqrt((0.75^2 + 3 x 0.25^2) / 3) = 0.5; group 2: no spread, all 0.
    close(group_advantages(SCORES, 4, "grpo", "group"), [c / (0.5 + STD_EPSILON) for c in CENTRED])
    close(group_advantages(SCORES, 4, "grpo", "none"), CENTRED)  # Dr. GRPO
    # Batch: the std of all eight scores (mean 1.125, squared deviations summing to 6.875, over 7).
    batch_std = math.sqrt(6.875 / 7)
    close(group_advantages(SCORES, 4, "grpo", "batch"), [c / (batch_std + STD_EPSILON) for c in CENTRED])


def test_rloo_subtracts_the_mean_of_the_other_answers_and_reinforce_pp_keeps_the_score():
    # Answer 0 scored 1 against the others' 0, 0, 0: +1; each 0 against (1 + 0 + 0) / 3: -1/3.
    close(group_advantages(SCORES, 4, "rloo"), [1.0, -1 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0, 0.0])
    close(group_advantages(SCORES, 4, "reinforce_pp_baseline"), CENTRED)
    close(group_advantages(SCORES, 4, "reinforce_pp"), SCORES)
    with pytest.raises(ValueError, match="rloo needs at least 2"):
        group_advantages(SCORES, 1, "rloo")


def test_the_three_kl_estimators():
    # pi = 0.5, pi_ref = 0.25: log r = log(pi_ref / pi) = -log 2.
    logprobs, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    close(kl_estimate(logprobs, ref, "k1"), [math.log(2)])
    close(kl_estimate(logprobs, ref, "k2"), [0.5 * math.log(2) ** 2])
    close(kl_estimate(logprobs, ref, "k3"), [0.5 - 1 + math.log(2)])
    close(kl_estimate(ref, ref, "k3"), [0.0])


def test_reinforce_pp_pays_the_kl_per_token_and_sums_the_rewards_to_the_end():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # Row 0: rewards -0.05, -0.1, -0.15 + 1 -> returns 0.7, 0.75, 0.85; row 1: -0.25 + 2 at its only token.
    close(reinforce_pp_returns(torch.tensor([1.0, 2.0]), kl, mask, kl_coef=0.5), [[0.7, 0.75, 0.85], [1.75, 0, 0]])


def test_global_whitening_is_the_same_whichever_rank_holds_which_rows():
    values, mask = torch.tensor([[1.0, 2.0], [3.0, 7.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # Real values 1, 2, 3: mean 2, variance 2/3.
    scale = 1 / math.sqrt(2 / 3)
    close(global_whiten(values, mask), [[-scale, 0.0], [scale, 0.0]], tolerance=1e-5)
    # Two ranks, one row each, their sums all-reduced: each gets its rows of the same result.
    parts = [(values[i : i + 1], mask[i : i + 1]) for i in range(2)]
    sums = [torch.stack([(v * m).sum(), ((v * m) ** 2).sum(), m.sum()]) for v, m in parts]
    whole = sums[0] + sums[1]
    close(global_whiten(*parts[0], reduce=lambda _: whole), [[-scale, 0.0]], tolerance=1e-5)
    close(global_whiten(*parts[1], reduce=lambda _: whole), [[scale, 0.0]], tolerance=1e-5)


def test_the_sequence_level_ratio_is_the_exp_of_the_mean_log_ratio_over_real_tokens():
    logprobs, old = torch.tensor([[0.2, -0.1, 0.5]]), torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    close(importance_ratio(logprobs, old, mask, "sequence"), [[math.exp(0.05)] * 3])
    close(importance_ratio(logprobs, old, mask, "token"), [[math.exp(0.2), math.exp(-0.1), 1.0]])  # padding: 1


def test_the_three_losses_aggregate_tokens_as_their_papers_do():
    per_token, mask = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    close(aggregate_loss(per_token, mask, "grpo", 4), (6 / 3 + 4 / 1) / 2)  # each answer's mean, then their mean
    close(aggregate_loss(per_token, mask, "dr_grpo", 4), 10 / (2 * 4))  # over answers x max completion length
    close(aggregate_loss(per_token, mask, "dapo", 4, global_tokens=20), 10 / 20)  # over the step's global tokens
    with pytest.raises(ValueError, match="global count"):
        aggregate_loss(per_token, mask, "dapo", 4)
    # An answer left out of the update (dynamic sampling: no real token) is not counted among the answers.
    left_out = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    close(aggregate_loss(per_token, left_out, "grpo", 4), 6 / 3)
    close(aggregate_loss(per_token, left_out, "dr_grpo", 4), 6 / (1 * 4))


def test_a_padding_tokens_log_probs_never_reach_an_exp():
    """Padding positions may hold any log-prob (-inf included): the loss and its gradient stay finite."""
    logprobs = torch.tensor([[-0.5, -math.inf]], requires_grad=True)
    old, ref, mask = torch.tensor([[-0.6, 0.0]]), torch.tensor([[-0.7, 50.0]]), torch.tensor([[1.0, 0.0]])
    result = group_policy_loss(logprobs, old, torch.tensor([1.0]), mask, 0.2, ref_logprobs=ref, beta=0.1)
    result.loss.backward()
    assert math.isfinite(result.loss.item()) and torch.isfinite(logprobs.grad).all() and logprobs.grad[0, 1] == 0


def test_the_clipped_surrogate_clips_higher_with_epsilon_high_and_adds_the_kl():
    logprobs, old, mask = torch.tensor([[0.3]]), torch.zeros(1, 1), torch.ones(1, 1)
    # Ratio e^0.3 = 1.35 with a positive advantage: clipped at 1 + epsilon.
    result = group_policy_loss(logprobs, old, torch.tensor([1.0]), mask, epsilon=0.2)
    close(result.loss, -1.2)
    close(result.clipfrac, 1.0)
    close(group_policy_loss(logprobs, old, torch.tensor([1.0]), mask, epsilon=0.2, epsilon_high=0.28).loss, -1.28)
    # A negative advantage: the unclipped term is the smaller, nothing clipped.
    result = group_policy_loss(logprobs, old, torch.tensor([-1.0]), mask, epsilon=0.2)
    close(result.loss, math.exp(0.3))
    close(result.clipfrac, 0.0)
    # beta 0.1 and pi_ref = pi / 2 at the ratio 1: k3 = 0.5 - 1 + log 2 added, weighted.
    ref = torch.tensor([[math.log(0.25)]])
    at_one = torch.tensor([[math.log(0.5)]])
    result = group_policy_loss(at_one, at_one, torch.tensor([1.0]), mask, 0.2, ref_logprobs=ref, beta=0.1)
    close(result.loss, -1.0 + 0.1 * (0.5 - 1 + math.log(2)))
    close(result.kl, 0.5 - 1 + math.log(2))


def test_a_zero_spread_group_contributes_no_policy_gradient_only_its_kl():
    advantages = group_advantages(SCORES, 4, "grpo")
    logprobs = torch.full((8, 3), -1.0, requires_grad=True)
    old, mask, ref = torch.full((8, 3), -1.0), torch.ones(8, 3), torch.full((8, 3), -1.5)
    group_policy_loss(logprobs, old, advantages, mask, epsilon=0.2).loss.backward()
    assert logprobs.grad[:4].abs().sum() > 0 and torch.equal(logprobs.grad[4:], torch.zeros(4, 3))
    logprobs.grad = None
    group_policy_loss(logprobs, old, advantages, mask, 0.2, ref_logprobs=ref, beta=0.1).loss.backward()
    # d/dlogp of beta x k3 = beta x (1 - e^(ref - logp)), the group's answers' mean over 3 tokens, over 8 answers.
    close(logprobs.grad[4:], torch.full((4, 3), 0.1 * (1 - math.exp(-0.5)) / 3 / 8))


def test_the_batch_std_is_the_global_batchs_whichever_rank_holds_which_groups():
    # Each "rank" holds one group; the count, sum and sum of squares all-reduced: the std of all eight scores.
    halves = SCORES[:4], SCORES[4:]
    whole = sum(torch.stack([torch.tensor(4.0), half.sum(), (half ** 2).sum()]).double() for half in halves)
    batch_std = math.sqrt(6.875 / 7)
    close(group_advantages(halves[0], 4, "grpo", "batch", reduce=lambda _: whole),
          [c / (batch_std + STD_EPSILON) for c in CENTRED[:4]])
    close(group_advantages(halves[1], 4, "grpo", "batch", reduce=lambda _: whole), [0.0] * 4)
