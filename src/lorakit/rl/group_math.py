"""The math of group-relative RL (GRPO and its Dr. GRPO / DAPO losses, RLOO, REINFORCE++) as pure functions of
tensors, each testable against numbers worked out by hand, as rl_math is for PPO.

Conventions: the rows of a batch come in groups of `group_size` consecutive rows, the answers sampled for one
prompt (row g * G + i is answer i to prompt g); `scores` [N] is one number per answer (the weighted sum of its
rewards); per-token tensors are [N, T] over the answer tokens only, `mask` 1.0 on real answer tokens and 0.0 on
the padding after them. Advantages of the group methods are one number per answer, broadcast over its tokens;
REINFORCE++'s are per token (its KL penalty is paid token by token in the reward).

Sources: GRPO (Shao et al. 2024, DeepSeekMath) and TRL's GRPOTrainer for the group advantage, its std's epsilon
and the k3 KL in the loss; Dr. GRPO (Liu et al. 2025) for the unscaled advantage and the constant normaliser;
DAPO (Yu et al. 2025) for clip-higher, the token mean over the global batch and dynamic sampling; RLOO (Ahmadian
et al. 2024) for the leave-one-out baseline; REINFORCE++ (Hu 2025) and OpenRLHF's `reinforce_baseline` for the
per-token KL reward, the returns and the global normalisation; GSPO (Zheng et al. 2025) for the sequence-level
importance ratio; Schulman's k1/k2/k3 KL estimators.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch

# TRL's GRPOTrainer divides by std + 1e-4: a group whose scores barely differ is not blown up to unit spread.
STD_EPSILON = 1e-4
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "dr_grpo", "dapo")
KL_ESTIMATORS = ("k1", "k2", "k3")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")

# Sums over this process's rows -> the same sums over every process's (an all-reduce); the identity on one process.
Reduce = Callable[[torch.Tensor], torch.Tensor]


class GroupLoss(NamedTuple):
    """group_policy_loss's loss and its diagnostics (detached): the share of real tokens whose ratio was clipped,
    and the mean KL to the reference over real tokens (0 without one)."""

    loss: torch.Tensor
    clipfrac: torch.Tensor
    kl: torch.Tensor


def grouped(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N] -> [N / group_size, group_size]; refuses a batch that does not split into whole groups."""
    if group_size < 1 or values.shape[0] % group_size:
        raise ValueError(f"{values.shape[0]} rows do not split into groups of {group_size}")
    return values.reshape(-1, group_size)


def zero_spread_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N / G] bool: the groups whose answers all scored the same (no signal to rank them by: DAPO's dynamic
    sampling drops them, and their group-relative advantage is 0)."""
    groups = grouped(scores, group_size)
    return (groups == groups[:, :1]).all(dim=1)


def group_advantages(scores: torch.Tensor, group_size: int, estimator: str, scale_rewards: str = "group",
                     reduce: Reduce = lambda sums: sums) -> torch.Tensor:
    """One advantage per answer [N] from the scores [N] of its group:
    grpo: (r - group mean) / (std + STD_EPSILON), std (unbiased) of the group (scale_rewards group), of the whole
          global batch (batch: reduce sums the statistics over processes), or no division at all (none: Dr. GRPO);
    rloo: r - the mean of the other G - 1 answers' scores (leave-one-out; G / (G - 1) x (r - group mean));
    reinforce_pp_baseline: r - group mean, the per-token shaping and global normalisation to follow
          (reinforce_pp_returns, global_whiten);
    reinforce_pp: r itself (no baseline; the global normalisation is the only one)."""
    groups = grouped(scores.float(), group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if estimator == "reinforce_pp":
        return scores.float().clone()
    if estimator == "reinforce_pp_baseline":
        return centred.flatten()
    if estimator == "rloo":
        if group_size < 2:
            raise ValueError("rloo needs at least 2 answers per prompt")
        return (centred * group_size / (group_size - 1)).flatten()
    if estimator != "grpo":
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose from {', '.join(ADVANTAGE_ESTIMATORS)}")
    if scale_rewards == "none":
        return centred.flatten()
    if scale_rewards == "group":
        std = groups.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(groups[:, :1])
    elif scale_rewards == "batch":
        std = batch_std(scores.float(), reduce)
    else:
        raise ValueError(f"unknown --scale_rewards {scale_rewards!r}; choose from {', '.join(SCALE_REWARDS)}")
    return (centred / (std + STD_EPSILON)).flatten()


def batch_std(scores: torch.Tensor, reduce: Reduce) -> torch.Tensor:
    """The unbiased std of the scores of every process (reduce sums count, sum and sum of squares); 0 for one."""
    count, total, squares = reduce(torch.stack([scores.new_tensor(float(scores.numel())), scores.sum(),
                                                (scores ** 2).sum()]).double()).unbind()
    if count < 2:
        return torch.zeros(())
    return ((squares - total ** 2 / count).clamp(min=0.0) / (count - 1)).sqrt().float()


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs (Schulman's estimators, with
    log r = log pi_ref - log pi): k1 = -log r (unbiased, can be negative), k2 = (log r)^2 / 2, k3 = r - 1 - log r
    (unbiased and never negative: GRPO's). mask: 0 at padding, where log r is taken as 0 before any exp (a padding
    token's log-probs can be anything; inf x 0 would be NaN)."""
    log_ratio = ref_logprobs - logprobs
    if mask is not None:
        log_ratio = torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        return torch.exp(log_ratio) - 1.0 - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; choose from {', '.join(KL_ESTIMATORS)}")


def reinforce_pp_returns(sequence_rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
                         ) -> torch.Tensor:
    """REINFORCE++'s per-token returns [N, T]: each token's reward is -kl_coef x its KL estimate (kl [N, T]), the
    answer's last real token adds the sequence reward [N]; the return of a token is the sum of the rewards from it
    to the answer's end (no discount: gamma 1). 0 on padding."""
    mask = mask.to(kl.dtype)
    rewards = -kl_coef * kl * mask
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)
    rewards = rewards.scatter_add(1, last[:, None], (sequence_rewards.to(kl.dtype) * (mask.sum(dim=1) > 0))[:, None])
    return rewards.flip(1).cumsum(1).flip(1) * mask


def global_whiten(values: torch.Tensor, mask: torch.Tensor, reduce: Reduce = lambda sums: sums) -> torch.Tensor:
    """values [N, T] normalised to zero mean and unit variance over the real tokens of the whole global batch
    (reduce sums the statistics over processes), 0 on padding: REINFORCE++'s normalisation, the same on every
    rank whatever its share of the batch."""
    mask = mask.to(torch.float32)
    masked = values.float() * mask
    totals = reduce(torch.stack([masked.sum(), (masked ** 2).sum(), mask.sum()]))
    count = totals[2].clamp(min=1.0)
    mean = totals[0] / count
    variance = (totals[1] / count - mean ** 2).clamp(min=0.0)
    return (values.float() - mean) * torch.rsqrt(variance + 1e-8) * mask


def importance_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, level: str
                     ) -> torch.Tensor:
    """pi / pi_old per token [N, T] (level token), or GSPO's sequence-level ratio, exp of the mean per-token log
    ratio over the answer's real tokens, broadcast over its tokens (level sequence)."""
    log_ratio = torch.where(mask.bool(), logprobs - old_logprobs, torch.zeros_like(logprobs))  # no exp of padding
    if level == "token":
        return torch.exp(log_ratio)
    if level != "sequence":
        raise ValueError(f"unknown importance sampling level {level!r}; choose from token, sequence")
    mask = mask.to(log_ratio.dtype)
    per_sequence = (log_ratio * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return torch.exp(per_sequence).expand_as(log_ratio)


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int,
                   global_tokens: float | None = None) -> torch.Tensor:
    """The batch's loss from per-token terms [N, T]: grpo, each answer's token mean, then the mean over answers;
    dr_grpo, the token sum over answers x max_completion_length (a constant: no length bias); dapo, the token sum
    over global_tokens, the real tokens of the whole optimizer step (every rank and accumulation step), so that
    each token weighs the same wherever it fell. An answer without a real token (left out by dynamic sampling)
    does not count among the answers."""
    mask = mask.to(per_token.dtype)
    per_token = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))
    total = per_token.sum()
    answers = (mask.sum(dim=1) > 0).sum().clamp(min=1)
    if loss_type == "grpo":
        return (per_token.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).sum() / answers
    if loss_type == "dr_grpo":
        return total / (answers * max_completion_length)
    if loss_type == "dapo":
        if not global_tokens:
            raise ValueError("the dapo loss needs the optimizer step's global count of answer tokens")
        return total / global_tokens
    raise ValueError(f"unknown loss type {loss_type!r}; choose from {', '.join(LOSS_TYPES)}")


def group_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, epsilon: float, epsilon_high: float | None = None,
                      ref_logprobs: torch.Tensor | None = None, beta: float = 0.0, kl_estimator: str = "k3",
                      loss_type: str = "grpo", max_completion_length: int = 1, global_tokens: float | None = None,
                      importance_sampling_level: str = "token", token_weights: torch.Tensor | None = None
                      ) -> GroupLoss:
    """The clipped surrogate of the group methods: per token -min(ratio A, clip(ratio, 1 - epsilon, 1 +
    epsilon_high) A) (epsilon_high defaults to epsilon; DAPO's clip-higher raises it), times token_weights where
    given (detached: the sampler correction), plus beta x the KL estimate to the reference where beta > 0,
    aggregated by loss_type (aggregate_loss). advantages: [N] (one per answer, broadcast) or [N, T] (per token,
    REINFORCE++)."""
    ratio = importance_ratio(logprobs, old_logprobs, mask, importance_sampling_level)
    advantages = advantages[:, None] if advantages.dim() == 1 else advantages
    high = epsilon if epsilon_high is None else epsilon_high
    unclipped, clipped = ratio * advantages, torch.clamp(ratio, 1.0 - epsilon, 1.0 + high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * token_weights
    kl = torch.zeros_like(per_token)
    if beta > 0.0:
        if ref_logprobs is None:
            raise ValueError("beta > 0 needs the reference's log-probs")
        kl = kl_estimate(logprobs, ref_logprobs, kl_estimator, mask)
        per_token = per_token + beta * kl
    loss = aggregate_loss(per_token, mask, loss_type, max_completion_length, global_tokens)
    with torch.no_grad():
        real = mask.to(torch.float32)
        count = real.sum().clamp(min=1.0)
        clipfrac = ((clipped < unclipped).float() * real).sum() / count
        mean_kl = (kl.float() * real).sum() / count
    return GroupLoss(loss, clipfrac, mean_kl)
