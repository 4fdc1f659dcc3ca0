"""The RL math as pure functions of tensors (PPO's, and what the group-relative methods share with it: log-probs,
masked means, the KL controllers, the sampler correction), torch only, no model, no Trainer, so that each piece
is testable against numbers worked out by hand.

Conventions follow DeepSpeed-Chat's step-3 trainer and InstructGPT: every per-token tensor is
[batch, response_len] and covers the generated response only; `mask` is 1.0 on real response
tokens (up to and including EOS, or the last generated token) and 0.0 on the padding after it.
The sequence score of the reward model is credited at each row's last real token, and the
per-token KL to the reference model is paid as a penalty on every token.
"""

from typing import NamedTuple

import torch

from lorakit.models.positions import last_position


class ShapedRewards(NamedTuple):
    """kl_penalty_rewards' per-token rewards and KL to the reference, both [B, T] and 0 on padding."""

    rewards: torch.Tensor
    kl: torch.Tensor


class AdvantagesAndReturns(NamedTuple):
    """PPO's per-token training targets: advantages (the actor's) and returns (the critic's), [B, T], 0 on padding."""

    advantages: torch.Tensor
    returns: torch.Tensor


class PolicyLoss(NamedTuple):
    """policy_loss's loss and its two diagnostics (detached): the share of clipped tokens and the approximate KL."""

    loss: torch.Tensor
    clipfrac: torch.Tensor
    approx_kl: torch.Tensor


class ValueLoss(NamedTuple):
    """value_loss's loss and the share of real tokens where the clipped error won (detached)."""

    loss: torch.Tensor
    clipfrac: torch.Tensor


class LengthChunk(NamedTuple):
    """One group of length_chunks: its rows (ascending prompt length) and its longest prompt and answer."""

    rows: list[int]
    prompt_width: int
    answer_width: int


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over the entries where mask is 1. An all-masked slice gives 0, not NaN, so
    a batch whose every row ended at once cannot poison a logged statistic."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1e-8)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over the entries where mask is 1 (padding neither shifts the mean nor
    adds spread). Bessel's correction uses the number of real entries, not the tensor's size."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count < 2:
            raise ValueError(f"an unbiased variance needs at least 2 unmasked entries, got {int(count)}")
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise `values` to unit variance (and zero mean unless shift_mean is False) using the
    statistics of the real tokens only; padding stays exactly 0 so it never enters a later sum.
    Keeping the mean (shift_mean=False) is how rewards are whitened without changing their sign."""
    mean, variance = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(values.dtype)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) per position: [B, T, V] logits and [B, T] labels -> [B, T].

    Computed as the label's logit minus the row's logsumexp, one batch row at a time, so no second
    [B, T, V] tensor (a full log_softmax) is ever held: with a 49k-152k vocabulary that tensor is
    the largest allocation of the PPO step. Half-precision logits are reduced in float32, because
    a bf16 logsumexp over a large vocabulary loses the small differences the PPO ratio is made of."""
    label_logits = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    if logits.dtype in (torch.float32, torch.float64):
        normalisers = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return label_logits - normalisers
    normalisers = torch.stack([torch.logsumexp(row.float(), dim=-1) for row in logits])
    return label_logits.float() - normalisers


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution per position: [B, T, V] -> [B, T].

    H = logsumexp(z) - sum(softmax(z) * z), which needs no log of a probability that underflowed
    to 0; one batch row at a time, half precision in float32, as in logprobs_from_logits."""
    entropies = []
    for row in logits:
        if row.dtype not in (torch.float32, torch.float64):
            row = row.float()
        probabilities = torch.softmax(row, dim=-1)
        entropies.append(torch.logsumexp(row, dim=-1) - (probabilities * row).sum(-1))
    return torch.stack(entropies)


def kl_penalty_rewards(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, scores: torch.Tensor,
                       mask: torch.Tensor, kl_coef: float, clip_reward_value: float) -> ShapedRewards:
    """Per-token rewards of the InstructGPT objective (DeepSpeed-Chat's compute_rewards).

    Every real token pays -kl_coef * (log pi - log pi_ref), the sampled estimate of its KL to the
    reference model, which keeps the policy near the SFT model the reward model was trained on.
    The reward model's sequence score is clamped to +-clip_reward_value (an unbounded score is
    what a policy learns to exploit first) and added at the row's last real token: that is the
    action that completed the scored sequence. A row with no real token gets no score.

    Returns (rewards, kl), both [B, T] and 0 on padding."""
    mask = mask.to(logprobs.dtype)
    kl = (logprobs - ref_logprobs) * mask
    rewards = -kl_coef * kl
    clipped_scores = torch.clamp(scores.to(rewards.dtype), -clip_reward_value, clip_reward_value)
    has_response = (mask.sum(-1) > 0).to(rewards.dtype)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last_position(mask)] += clipped_scores * has_response
    return ShapedRewards(rewards, kl)


def gae_advantages_and_returns(values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor,
                               gamma: float, lam: float) -> AdvantagesAndReturns:
    """Generalised advantage estimation (Schulman et al. 2016), backwards over the response.

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, where every
    position after a row's end counts as terminal: the value after the last real token is 0 and
    padding carries no reward and no advantage, so rows of different lengths in one batch are
    each treated as their own episode. Returns = A + V are the critic's regression targets.
    No whitening here: the caller decides whether to whiten advantages (over the whole batch).

    Returns (advantages, returns), both [B, T] and 0 on padding."""
    mask = mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    advantages_reversed = []
    next_advantage = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = (delta + gamma * lam * next_advantage) * mask[:, t]
        next_value = values[:, t]
        advantages_reversed.append(next_advantage)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = (advantages + values) * mask
    return AdvantagesAndReturns(advantages, returns)


def penalised_scores(scores: torch.Tensor, has_eos: torch.Tensor, missing_eos_penalty: float | None) -> torch.Tensor:
    """The reward model's [B] scores less missing_eos_penalty for each answer that stopped at the
    length limit instead of ending ([B] bool has_eos); unchanged when the penalty is None. Applied
    before kl_penalty_rewards clips the score, as TRL applies it."""
    if missing_eos_penalty is None:
        return scores
    return scores - missing_eos_penalty * (~has_eos.bool()).to(scores.dtype)


def advantages_and_returns(values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor,
                           gamma: float, lam: float) -> AdvantagesAndReturns:
    """PPO's training targets of one batch of experience: GAE advantages whitened over the whole
    batch's real tokens (when it has at least 2, the fewest a variance needs), and the critic's
    returns from the advantages before whitening. All [B, T], 0 on padding."""
    advantages, returns = gae_advantages_and_returns(values, rewards, mask, gamma, lam)
    if mask.sum() >= 2:
        advantages = masked_whiten(advantages, mask)
    return AdvantagesAndReturns(advantages, returns)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cliprange: float, token_weights: torch.Tensor | None = None) -> PolicyLoss:
    """PPO's clipped surrogate (Schulman et al. 2017) as a loss, averaged over real tokens.

    ratio = pi/pi_old; the loss takes max(-A * ratio, -A * clip(ratio, 1-c, 1+c)) per token, the
    pessimistic one, so a step gains nothing from pushing the ratio beyond the clip range.

    Returns (loss, clipfrac, approx_kl): clipfrac is the share of real tokens whose clipped term
    was the one used (the ratio left the range in the direction the advantage favours), and
    approx_kl = mean 0.5 * (log pi - log pi_old)^2, an estimate of KL(pi_old || pi) that is
    never negative; both are diagnostics, detached from the graph. token_weights [B, A] (detached,
    e.g. sampler_correction_weights) multiply each token's term before the mean."""
    mask = mask.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    per_token = torch.max(unclipped, clipped)
    loss = masked_mean(per_token if token_weights is None else per_token * token_weights, mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).to(logprobs.dtype), mask)
        approx_kl = masked_mean(0.5 * log_ratio ** 2, mask)
    return PolicyLoss(loss, clipfrac, approx_kl)


class SamplerGap(NamedTuple):
    """sampler_gap's sums over the sampled tokens (divide by count for the means logged as sampler_gap/*)."""

    logprob_abs: float
    kl: float
    # Named as the trainers read it (gap.count), so it shadows tuple.count, which nothing calls on a SamplerGap.
    count: float  # type: ignore[assignment]


def sampler_gap(trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor) -> SamplerGap:
    """How far the sampler's numbers are from the training forward's, over the sampled tokens (mask [B, A] 1 on
    them; the log-probs [B, A]), the one definition every RL method logs: the sum of |log pi_train - log
    pi_sampler|, and of KL(sampler || trainer) estimated on the sampler's own tokens with Schulman's k3 estimator,
    (r - 1) - log r with r = pi_train / pi_sampler (unbiased for samples drawn from the sampler, never negative).
    Both are 0 when the two agree; a rollout engine whose weights drift from the trained ones shows at once."""
    mask = mask.to(torch.float32)
    delta = (trainer_logprobs.float() - sampler_logprobs.float()) * mask
    k3 = (torch.exp(delta) - 1.0 - delta) * mask
    return SamplerGap(delta.abs().sum().item(), k3.sum().item(), mask.sum().item())


def sampler_correction_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                               cap: float) -> torch.Tensor:
    """Truncated importance sampling (as TRL's and verl's): each sampled token's weight min(pi_old / pi_sampler,
    cap), detached, for a policy loss whose old policy is the training forward's while the tokens came from the
    sampler. [B, A] float32."""
    with torch.no_grad():
        return torch.exp(old_logprobs.float() - sampler_logprobs.float()).clamp(max=cap)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               mask: torch.Tensor, cliprange_value: float) -> ValueLoss:
    """The critic's clipped regression loss: 0.5 * mean over real tokens of
    max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), which, like the policy's clip, removes
    the incentive to move a value estimate far from the one the experience was scored with.

    Returns (loss, clipfrac): clipfrac is the share of real tokens where the clipped error won."""
    mask = mask.to(values.dtype)
    clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(unclipped_error, clipped_error), mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped_error > unclipped_error).to(values.dtype), mask)
    return ValueLoss(loss, clipfrac)


class FixedKLController:
    """A constant KL coefficient (DeepSpeed-Chat's --kl_ctl)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt; kept so the trainer treats both controllers alike."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """The KL coefficient of Ziegler et al. 2019 ("Fine-tuning language models from human
    preferences"): it grows while the measured KL to the reference is above `target` and shrinks
    while below, with the error clipped to +-20% so one noisy batch cannot swing it, and scaled by
    n_steps / horizon so it moves by about e-fold over `horizon` samples of sustained error."""

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"the adaptive KL controller needs target > 0 and horizon > 0, got {target}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        # The coefficient is the state; target and horizon are settings, saved so a resumed run
        # can be checked against them.
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


# Either controller: the trainer and the checkpoint treat both alike (value, update, state_dict, load_state_dict).
KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(kl_ctl: float, target_kl: float | None = None, kl_horizon: int = 10000) -> KLController:
    """A fixed controller at kl_ctl, or, given a target KL, an adaptive one starting at kl_ctl."""
    if target_kl is None:
        return FixedKLController(kl_ctl)
    return AdaptiveKLController(kl_ctl, target_kl, kl_horizon)


@torch.no_grad()
def ema_update(ema_tensors: list[torch.Tensor], tensors: list[torch.Tensor], beta: float) -> None:
    """ema = beta * ema + (1 - beta) * x in place, for each pair (DeepSpeed-Chat's --enable_ema:
    an exponential moving average of the actor's weights, often a better model to ship than the
    last noisy PPO iterate)."""
    if len(ema_tensors) != len(tensors):
        raise ValueError(f"ema_update got {len(ema_tensors)} averages for {len(tensors)} tensors")
    for average, current in zip(ema_tensors, tensors, strict=True):
        average.lerp_(current.to(average.dtype), 1.0 - beta)


def length_chunks(prompt_lengths: list[int], answer_lengths: list[int], min_rows: int) -> list[LengthChunk]:
    """Groups of rows of similar length for the passes over a rollout: [LengthChunk(rows, prompt_width,
    answer_width)], rows in ascending prompt length, each group as wide as its own longest prompt
    and answer. Prompts are left-padded to the longest of the whole batch and answers right-padded
    to the longest answer, so one pass over the batch computes every padding position; groups of
    similar length skip most of them.

    The groups minimise the padded tokens (rows x (prompt_width + answer_width), summed), each
    holding at least min_rows rows (so passes stay big enough to run efficiently); on a tie the
    fewer groups win. Exact dynamic programming over the rows sorted by prompt length."""
    count = len(prompt_lengths)
    order = sorted(range(count), key=lambda row: (prompt_lengths[row], answer_lengths[row], row))
    min_rows = max(1, min(min_rows, count))
    # best[end] = (padded tokens, groups, start of the last group) for the first `end` sorted rows.
    best: list[tuple[int, int, int] | None] = [(0, 0, 0)] + [None] * count
    for end in range(min_rows, count + 1):
        for start in range(0, end - min_rows + 1):
            before = best[start]
            if before is None:
                continue
            rows = order[start:end]
            tokens = len(rows) * (max(prompt_lengths[r] for r in rows) + max(answer_lengths[r] for r in rows))
            candidate = (before[0] + tokens, before[1] + 1, start)
            current = best[end]
            if current is None or candidate[:2] < current[:2]:
                best[end] = candidate
    groups, end = [], count
    while end > 0:
        last = best[end]
        assert last is not None  # every end the walk meets was reached: best[count] from start 0, each start itself
        start = last[2]
        rows = order[start:end]
        groups.append(LengthChunk(rows, max(prompt_lengths[r] for r in rows), max(answer_lengths[r] for r in rows)))
        end = start
    return groups[::-1]
