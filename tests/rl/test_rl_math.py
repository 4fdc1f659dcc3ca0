"""The PPO math (lorakit.rl.rl_math) against numbers worked out by hand: the expected values below were
computed on paper from the definitions, step by step in the comments, never by the function
under test."""

import math

import pytest
import torch

from lorakit.models.positions import last_position, positions_from_mask
from lorakit.rl.rl_math import (
    AdaptiveKLController,
    FixedKLController,
    advantages_and_returns,
    ema_update,
    entropy_from_logits,
    gae_advantages_and_returns,
    kl_penalty_rewards,
    length_chunks,
    logprobs_from_logits,
    make_kl_controller,
    masked_mean,
    masked_var,
    masked_whiten,
    penalised_scores,
    policy_loss,
    sampler_correction_weights,
    sampler_gap,
    value_loss,
)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


def test_gae_treats_each_row_as_its_own_episode_of_its_own_length():
    gamma, lam = 0.9, 0.8  # gamma * lam = 0.72
    # Padding holds large junk values and rewards: none of it may leak into a real position.
    values = torch.tensor([[1.0, 2.0, 3.0, 9.0], [0.5, -1.0, 0.0, 2.0], [2.0, 5.0, 5.0, 5.0]])
    rewards = torch.tensor([[0.5, 0.0, 1.0, 7.0], [0.0, 1.0, 0.0, -1.0], [3.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    advantages, returns = gae_advantages_and_returns(values, rewards, mask, gamma, lam)
    # Row 0 (3 tokens): t=2 delta = 1 + 0.9*0 - 3 = -2 (terminal: next value 0, not the pad's 9)
    #   t=1 delta = 0 + 0.9*3 - 2 = 0.7,  A = 0.7 + 0.72*(-2) = -0.74
    #   t=0 delta = 0.5 + 0.9*2 - 1 = 1.3, A = 1.3 + 0.72*(-0.74) = 0.7672
    # Row 1 (4 tokens): t=3 delta = -1 - 2 = -3
    #   t=2 delta = 0 + 0.9*2 - 0 = 1.8,   A = 1.8 - 0.72*3 = -0.36
    #   t=1 delta = 1 + 0.9*0 + 1 = 2,      A = 2 - 0.72*0.36 = 1.7408
    #   t=0 delta = 0 - 0.9 - 0.5 = -1.4,   A = -1.4 + 0.72*1.7408 = -0.146624
    # Row 2 (1 token): A = 3 - 2 = 1.
    close(advantages, [[0.7672, -0.74, -2.0, 0.0], [-0.146624, 1.7408, -0.36, -3.0], [1.0, 0.0, 0.0, 0.0]])
    # returns = A + V on real tokens, 0 on padding
    close(returns, [[1.7672, 1.26, 1.0, 0.0], [0.353376, 0.7408, -0.36, -1.0], [3.0, 0.0, 0.0, 0.0]])
    # A row's result does not depend on the batch width it was padded to.
    alone, _ = gae_advantages_and_returns(values[:1, :3], rewards[:1, :3], mask[:1, :3], gamma, lam)
    close(alone, [[0.7672, -0.74, -2.0]])


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value():
    values = torch.tensor([[0.25, 0.5, 1.0, 0.0]])
    rewards = torch.tensor([[1.0, -2.0, 4.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0]])
    advantages, returns = gae_advantages_and_returns(values, rewards, mask, 1.0, 1.0)
    # reward-to-go: [3, 2, 4]; Monte Carlo advantage = reward-to-go - V
    close(returns, [[3.0, 2.0, 4.0, 0.0]])
    close(advantages, [[2.75, 1.5, 3.0, 0.0]])


def test_kl_penalty_on_every_token_and_clipped_score_at_the_last_real_token():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -0.4, -0.6, -0.8], [-1.0, -1.0, -4.0, -4.0]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -0.5, -0.1], [-0.2, -0.9, -0.1, -0.3], [-1.0, -1.0, -0.5, -0.5]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    scores = torch.tensor([10.0, -0.7, -9.0])
    rewards, kl = kl_penalty_rewards(logprobs, ref_logprobs, scores, mask, kl_coef=0.1, clip_reward_value=5.0)
    # kl = logprobs - ref on real tokens, 0 on padding (row 2's padding differs by 3.5: ignored)
    close(kl, [[0.5, -1.0, 0.0, 0.0], [0.0, 0.5, -0.5, -0.5], [0.0, 0.0, 0.0, 0.0]])
    # rewards = -0.1 * kl, plus clamp(score, -5, 5) at the last real token:
    # row 0: score 10 -> 5 at t=2; row 1: -0.7 (inside the clip) at t=3; row 2: -9 -> -5 at t=1.
    close(rewards, [[-0.05, 0.1, 5.0, 0.0], [0.0, -0.05, 0.05, 0.05 - 0.7], [0.0, -5.0, 0.0, 0.0]])


def test_masked_statistics_and_whitening_ignore_padding():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 6.0, -50.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    # real entries 1, 2, 3, 4, 5: mean 3, squared deviations 4+1+0+1+4 = 10
    close(masked_mean(values, mask), 3.0)
    close(masked_mean(values, mask, dim=1), [2.0, 4.5])
    close(masked_var(values, mask, unbiased=False), 10 / 5)
    close(masked_var(values, mask), 10 / 4)
    std = math.sqrt(2.5)
    whitened = masked_whiten(values, mask)
    close(whitened, [[-2 / std, -1 / std, 0.0, 0.0], [1 / std, 2 / std, 0.0, 0.0]], atol=1e-5)
    kept_mean = masked_whiten(values, mask, shift_mean=False)
    close(kept_mean, [[3 - 2 / std, 3 - 1 / std, 3.0, 0.0], [3 + 1 / std, 3 + 2 / std, 0.0, 0.0]], atol=1e-5)
    assert torch.equal(whitened[mask == 0], torch.zeros(3)) and torch.equal(kept_mean[mask == 0], torch.zeros(3))
    close(masked_mean(values, torch.zeros_like(mask)), 0.0)  # nothing real: 0, not NaN
    with pytest.raises(ValueError):
        masked_var(values, torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 0]]))


def test_policy_loss_without_clipping_is_the_plain_ratio_objective():
    old_logprobs = torch.tensor([[-1.0, -2.0, -0.5]])
    logprobs = (old_logprobs + torch.tensor([[0.1, -0.1, 0.0]])).requires_grad_()
    advantages = torch.tensor([[1.0, 2.0, -1.0]])
    loss, clipfrac, approx_kl = policy_loss(logprobs, old_logprobs, advantages, torch.ones(1, 3), cliprange=0.2)
    e01, em01 = 1.1051709180756477, 0.9048374180359595  # e^0.1, e^-0.1: inside [0.8, 1.2]
    close(loss, (-1.0 * e01 - 2.0 * em01 + 1.0) / 3)
    close(clipfrac, 0.0)
    close(approx_kl, 0.5 * (0.01 + 0.01 + 0.0) / 3)
    loss.backward()
    close(logprobs.grad, [[-e01 / 3, -2 * em01 / 3, 1 / 3]])  # d(-A*ratio)/dlogp = -A*ratio


def test_sampler_gap_is_the_mean_logprob_difference_and_the_k3_kl_estimate():
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.3, 7.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    same = sampler_gap(trainer, trainer.clone(), mask)
    assert same.logprob_abs == 0 and same.kl == 0 and same.count == 5
    sampler = trainer + torch.tensor([[0.1, -0.2, 0.0], [0.0, 0.3, -5.0]])  # the padding's junk is not counted
    gap = sampler_gap(trainer, sampler, mask)
    close(gap.logprob_abs / gap.count, 0.6 / 5)
    # k3 = (r - 1) - log r, r = pi_train / pi_sampler = e^(trainer - sampler)
    k3 = sum(math.exp(d) - 1 - d for d in (-0.1, 0.2, 0.0, 0.0, -0.3))
    close(gap.kl / gap.count, k3 / 5)
    assert gap.kl > 0


def test_sampler_correction_weighs_each_token_by_its_capped_ratio():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    sampler = torch.tensor([[-1.0, -1.5, -3.0]])
    weights = sampler_correction_weights(old, sampler, cap=2.0)
    close(weights, [[1.0, math.exp(0.5), 2.0]])  # e^2 capped at 2
    logprobs = old.clone().requires_grad_()
    advantages = torch.tensor([[1.0, 2.0, -1.0]])
    loss, clipfrac, approx_kl = policy_loss(logprobs, old, advantages, torch.ones(1, 3), 0.2, weights)
    close(loss, (-1.0 - 2.0 * math.exp(0.5) + 2.0) / 3)  # ratio 1: each token's -A, weighted
    close(approx_kl, 0.0)


def test_policy_loss_clips_only_where_the_clip_is_pessimistic():
    old_logprobs = torch.zeros(1, 5)
    # log-ratios +-0.5 leave the [0.8, 1.2] range; the last position is padding with junk.
    logprobs = torch.tensor([[0.5, -0.5, 0.5, -0.5, 9.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 0]])
    loss, clipfrac, approx_kl = policy_loss(logprobs, old_logprobs, advantages, mask, cliprange=0.2)
    up, down = 1.6487212707001282, 0.6065306597126334  # e^0.5, e^-0.5
    # per token max(-A*r, -A*clip(r)):
    #   A=+1, r=1.65: max(-1.65, -1.2) = -1.2   clipped term used
    #   A=+1, r=0.61: max(-0.61, -0.8) = -0.61  unclipped (a ratio drop is not limited)
    #   A=-1, r=1.65: max(1.65, 1.2)   = 1.65   unclipped
    #   A=-1, r=0.61: max(0.61, 0.8)   = 0.8    clipped term used
    close(loss, (-1.2 - down + up + 0.8) / 4)
    close(clipfrac, 2 / 4)
    close(approx_kl, 0.5 * 0.25)
    loss.backward()
    # where the clipped term is used the token gets no gradient; padding never does
    close(logprobs.grad, [[0.0, -down / 4, up / 4, 0.0, 0.0]])


def test_value_loss_clips_around_the_old_values():
    values = torch.tensor([[1.0, 2.0, 0.5, 2.0, 3.0]], requires_grad=True)
    old_values = torch.tensor([[1.1, 1.5, 0.5, 1.5, 0.0]])
    returns = torch.tensor([[1.0, 3.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 0]])
    loss, clipfrac = value_loss(values, old_values, returns, mask, cliprange_value=0.2)
    # token 0: V=1.0 inside [0.9, 1.3]: errors 0, 0
    # token 1: V=2.0 clipped to 1.7: (2-3)^2 = 1 vs (1.7-3)^2 = 1.69 -> 1.69, the clipped one
    # token 2: V=old: 0.25 both
    # token 3: V=2.0 clipped to 1.7: (2-1)^2 = 1 vs (1.7-1)^2 = 0.49 -> 1, the unclipped one
    close(loss, 0.5 * (0.0 + 1.69 + 0.25 + 1.0) / 4)
    close(clipfrac, 1 / 4)
    loss.backward()
    # d/dV 0.5*(V-R)^2/4 = (V-R)/4 where unclipped wins; 0 where the clipped value is used
    close(values.grad, [[0.0, 0.0, 0.5 / 4, 1.0 / 4, 0.0]])

    unclipped_loss, unclipped_frac = value_loss(values.detach()[:, :4], values.detach()[:, :4], returns[:, :4],
                                                mask[:, :4], cliprange_value=0.2)
    close(unclipped_loss, 0.5 * (0.0 + 1.0 + 0.25 + 1.0) / 4)
    close(unclipped_frac, 0.0)


def test_adaptive_kl_controller_follows_ziegler_with_the_error_clipped():
    controller = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    expected = 0.1
    steps = [  # (measured KL, n_steps, clipped proportional error worked out by hand)
        (9.0, 1000, 0.2),    # 9/6 - 1 = 0.5 -> clipped to 0.2
        (7.5, 1000, 0.2),    # 0.25 -> 0.2
        (4.5, 2000, -0.2),   # -0.25 -> -0.2
        (6.6, 1000, 0.1),    # inside the clip
        (5.4, 1000, -0.1),
        (6.0, 500, 0.0),     # on target: unchanged
    ]
    for current_kl, n_steps, error in steps:
        controller.update(current_kl, n_steps)
        expected *= 1 + error * n_steps / 10000
        assert controller.value == pytest.approx(expected, rel=1e-12)
    # 0.1 * 1.02 * 1.02 * 0.96 * 1.01 * 0.99 = 0.09986841216
    assert controller.value == pytest.approx(0.09986841216, rel=1e-12)

    resumed = make_kl_controller(0.1, target_kl=6.0, kl_horizon=10000)
    assert isinstance(resumed, AdaptiveKLController) and resumed.value == 0.1
    resumed.load_state_dict(controller.state_dict())
    resumed.update(12.0, 10000)  # error clipped to 0.2 over a whole horizon: x1.2
    assert resumed.value == pytest.approx(0.09986841216 * 1.2, rel=1e-12)


def test_fixed_kl_controller_never_moves():
    controller = make_kl_controller(0.05)
    assert isinstance(controller, FixedKLController)
    for current_kl in (0.0, 3.0, 100.0):
        controller.update(current_kl, 64)
    assert controller.value == 0.05
    other = FixedKLController(0.3)
    other.load_state_dict(controller.state_dict())
    assert other.value == 0.05


def test_ema_update_in_place():
    weight = torch.nn.Parameter(torch.tensor([[3.0, -2.0], [0.0, 10.0]]))
    bias = torch.nn.Parameter(torch.tensor([1.0]))
    ema_weight = torch.tensor([[1.0, 2.0], [4.0, 0.0]])
    ema_bias = torch.tensor([0.0])
    ema_update([ema_weight, ema_bias], [weight, bias], beta=0.9)
    # 0.9 * ema + 0.1 * x
    close(ema_weight, [[1.2, 1.6], [3.6, 1.0]])
    close(ema_bias, [0.1])
    ema_update([ema_weight, ema_bias], [weight, bias], beta=0.9)
    close(ema_weight, [[1.38, 1.24], [3.24, 1.9]])
    close(ema_bias, [0.19])
    assert not ema_weight.requires_grad and weight.grad is None


def test_logprobs_and_entropy_hand_computed_and_against_log_softmax():
    # position 0: probabilities (1/2, 1/4, 1/4) shifted by a constant; position 1: uniform over 3
    logits = torch.tensor([[[math.log(0.5) + 7, math.log(0.25) + 7, math.log(0.25) + 7], [2.0, 2.0, 2.0]]])
    labels = torch.tensor([[1, 2]])
    close(logprobs_from_logits(logits, labels), [[math.log(0.25), -math.log(3)]])
    # H(1/2, 1/4, 1/4) = 0.5*ln2 + 2*0.25*ln4 = 1.5*ln2; H(uniform 3) = ln3
    close(entropy_from_logits(logits), [[1.5 * math.log(2), math.log(3)]])

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=generator, dtype=torch.float64) * 4
    labels = torch.randint(0, 11, (3, 5), generator=generator)
    log_softmax = torch.log_softmax(logits, dim=-1)
    direct = torch.stack([torch.stack([log_softmax[b, t, labels[b, t]] for t in range(5)]) for b in range(3)])
    close(logprobs_from_logits(logits, labels), direct, atol=1e-10)
    close(entropy_from_logits(logits), -(log_softmax.exp() * log_softmax).sum(-1), atol=1e-6)
    # bf16 logits are reduced in float32: within bf16 rounding of the logits themselves
    low = logprobs_from_logits(logits.to(torch.bfloat16), labels)
    assert low.dtype == torch.float32
    close(low, direct, atol=0.1)


def test_length_chunks_group_similar_rows_to_skip_padding():
    # Prompts 10, 30, 12, 31 tokens, answers 5, 5, 2, 5; at least 2 rows per group.
    # One group: 4 x (31 + 5) = 144 padded tokens. Sorted by prompt: rows 0 (10), 2 (12), 1 (30), 3 (31).
    # {0, 2} + {1, 3}: 2 x (12 + 5) + 2 x (31 + 5) = 34 + 72 = 106, the least of the 2-row splits.
    assert length_chunks([10, 30, 12, 31], [5, 5, 2, 5], 2) == [([0, 2], 12, 5), ([1, 3], 31, 5)]
    # At least 3 rows per group leaves no split: the whole batch, as wide as its longest row.
    assert length_chunks([10, 30, 12, 31], [5, 5, 2, 5], 3) == [([0, 2, 1, 3], 31, 5)]
    # Rows of one length: splitting saves nothing, and the tie goes to fewer groups.
    assert length_chunks([8, 8, 8, 8], [3, 3, 3, 3], 1) == [([0, 1, 2, 3], 8, 3)]
    # Answers count too: equal prompts, answers 1, 9, 1, 9 -> {0, 2} 2 x 9 + {1, 3} 2 x 17 = 52 < 4 x 17.
    assert length_chunks([8, 8, 8, 8], [1, 9, 1, 9], 2) == [([0, 2], 8, 1), ([1, 3], 8, 9)]


def test_advantages_are_whitened_over_the_batch_and_returns_are_not():
    values = torch.tensor([[0.25, 0.5, 1.0, 0.0]])
    rewards = torch.tensor([[1.0, -2.0, 4.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0]])
    advantages, returns = advantages_and_returns(values, rewards, mask, 1.0, 1.0)
    # GAE with gamma = lam = 1: [2.75, 1.5, 3.0] (reward-to-go [3, 2, 4] minus V), mean 29/12;
    # deviations 1/3, -11/12, 7/12; unbiased variance (16 + 121 + 49) / 144 / 2 = 31/48.
    std = math.sqrt(31 / 48)
    close(advantages, [[(1 / 3) / std, -(11 / 12) / std, (7 / 12) / std, 0.0]], atol=1e-5)
    close(returns, [[3.0, 2.0, 4.0, 0.0]])  # the critic's targets come from the unwhitened advantages
    # One real token has no variance: its advantage stays as GAE gave it (4 - 1 = 3), not NaN.
    alone, _ = advantages_and_returns(values, rewards, torch.tensor([[0.0, 0, 1, 0]]), 1.0, 1.0)
    close(alone, [[0.0, 0.0, 3.0, 0.0]])


def test_missing_eos_penalty_applies_to_unended_answers_only():
    scores, has_eos = torch.tensor([2.0, 10.0, -0.5]), torch.tensor([True, False, True])
    close(penalised_scores(scores, has_eos, 1.5), [2.0, 8.5, -0.5])
    close(penalised_scores(scores, has_eos, None), [2.0, 10.0, -0.5])


def test_last_position_and_positions_from_left_and_right_padded_masks():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    assert last_position(mask).tolist() == [4, 2, 0]  # left padded, right padded, nothing real
    assert last_position(mask.float()).tolist() == [4, 2, 0]
    # Attended tokens count from 0 whatever the padding; padding reads 0 before and the last count after.
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 0, 0, 0, 0]]
