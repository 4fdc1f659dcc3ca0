"""The DPO losses against numbers worked by hand, on fixed log-probabilities of two pairs."""

import math

import pytest
import torch

from lorakit.models.dpo_losses import (
    log1mexp,
    nll_loss,
    nll_weight,
    preference_loss,
    sequence_log_probs,
)

# Two pairs: summed answer log-probs under the policy and the reference, and answer lengths.
POLICY_CHOSEN, POLICY_REJECTED = torch.tensor([-4.0, -6.0]), torch.tensor([-7.0, -5.0])
REF_CHOSEN, REF_REJECTED = torch.tensor([-5.0, -6.5]), torch.tensor([-6.0, -5.5])
CHOSEN_TOKENS, REJECTED_TOKENS = torch.tensor([2.0, 3.0]), torch.tensor([4.0, 2.0])
# Log-ratios: chosen (1.0, 0.5), rejected (-1.0, 0.5); margins 2.0 and 0.0.


def loss_of(loss_type, **options):
    return preference_loss(loss_type, POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, CHOSEN_TOKENS,
                           REJECTED_TOKENS, **options)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize("loss_type,options,expected", [
    # -log sigmoid(beta * margin): beta 0.5, margins 2 and 0.
    ("sigmoid", {"beta": 0.5}, [-math.log(sigmoid(1.0)), math.log(2)]),
    # relu(1 - beta * margin)
    ("hinge", {"beta": 0.25}, [0.5, 1.0]),
    # ((1 - e) * -log s(z) + e * log s(-z)) / (1 - 2e), z = beta * margin, e = 0.1
    ("robust", {"beta": 0.5, "label_smoothing": 0.1},
     [(0.9 * -math.log(sigmoid(1.0)) + 0.1 * math.log(sigmoid(-1.0))) / 0.8, (0.9 - 0.1) * math.log(2) / 0.8]),
    # (chosen log-ratio / chosen tokens - rejected log-ratio / rejected tokens - 1 / (2 beta))^2, beta 0.5:
    # pair 1: 1/2 - (-1/4) - 1 = -0.25; pair 2: 0.5/3 - 0.5/2 - 1 = -13/12.
    ("ipo", {"beta": 0.5}, [0.0625, (13 / 12) ** 2]),
    # -log sigmoid(beta * (mean chosen - mean rejected) - gamma), beta 2, gamma 0.5:
    # pair 1: means -2 and -1.75 -> 2 * -0.25 - 0.5 = -1; pair 2: means -2 and -2.5 -> 1 - 0.5 = 0.5.
    ("simpo", {"beta": 2.0, "simpo_gamma": 0.5}, [-math.log(sigmoid(-1.0)), -math.log(sigmoid(0.5))]),
])
def test_loss_equals_the_hand_computed_value(loss_type, options, expected):
    losses, chosen_rewards, rejected_rewards = loss_of(loss_type, **options)
    torch.testing.assert_close(losses, torch.tensor(expected), atol=1e-6, rtol=1e-6)
    if loss_type == "simpo":  # beta * mean log-prob
        torch.testing.assert_close(chosen_rewards, torch.tensor([-4.0, -4.0]))
        torch.testing.assert_close(rejected_rewards, torch.tensor([-3.5, -5.0]))
    else:  # beta * log-ratio
        torch.testing.assert_close(chosen_rewards, options["beta"] * torch.tensor([1.0, 0.5]))
        torch.testing.assert_close(rejected_rewards, options["beta"] * torch.tensor([-1.0, 0.5]))


def test_orpo_odds_ratio_and_its_nll_term():
    # Mean log-probs: chosen -2 and -2, rejected -1.75 and -2.5; log odds(p) = log p - log(1 - p).
    def log_odds(mean_logp):
        return mean_logp - math.log(1 - math.exp(mean_logp))

    losses, chosen_rewards, _ = loss_of("orpo", beta=0.1)
    expected = [-0.1 * math.log(sigmoid(log_odds(-2.0) - log_odds(-1.75))),
                -0.1 * math.log(sigmoid(log_odds(-2.0) - log_odds(-2.5)))]
    torch.testing.assert_close(losses, torch.tensor(expected), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chosen_rewards, torch.tensor([-0.2, -0.2]))
    # NLL: chosen log-probs -4 and -6 over 2 + 3 tokens -> 10 / 5.
    assert nll_loss(POLICY_CHOSEN, CHOSEN_TOKENS).item() == pytest.approx(2.0)
    assert nll_weight("orpo", 0.0) == 1.0 and nll_weight("orpo", 0.5) == 1.5
    assert nll_weight("sigmoid", 0.0) == 0.0 and nll_weight("ipo", 0.25) == 0.25


def test_log1mexp_is_accurate_at_both_ends():
    x = torch.tensor([-1e-6, -0.1, -0.7, -5.0, -40.0], dtype=torch.float64)
    torch.testing.assert_close(log1mexp(x), torch.log(1 - torch.exp(x)), atol=1e-12, rtol=1e-6)


def test_at_step_zero_the_dpo_loss_is_log_2_and_the_rewards_are_zero():
    losses, chosen_rewards, rejected_rewards = preference_loss(
        "sigmoid", POLICY_CHOSEN, POLICY_REJECTED, POLICY_CHOSEN.clone(), POLICY_REJECTED.clone(), CHOSEN_TOKENS,
        REJECTED_TOKENS, beta=0.1)
    torch.testing.assert_close(losses, torch.full((2,), math.log(2)))
    assert chosen_rewards.abs().max() == 0 and rejected_rewards.abs().max() == 0


def test_sequence_log_probs_sum_each_answers_own_tokens():
    token_logps, owner = torch.tensor([-0.5, -1.25, -2.0]), torch.tensor([0, 0, 2])
    sums, counts = sequence_log_probs(token_logps, owner, num_sequences=4)
    assert sums.tolist() == [-1.75, 0.0, -2.0, 0.0]
    assert counts.tolist() == [2.0, 0.0, 1.0, 0.0]
