"""The direct preference losses as pure functions of per-pair answer log-probabilities (torch only),
defined as TRL defines them (trl 1.16: DPOTrainer for sigmoid/ipo/hinge/robust and its "sft" term,
the CPO trainer's simpo, the ORPO trainer's odds ratio), so a first batch gives TRL's loss.

Every argument is a float tensor of shape [pairs]: `*_logps` the sum of the log-probabilities of an
answer's tokens (policy or reference), `*_tokens` how many answer tokens that sum covers. Each loss
returns PairLosses (loss per pair, chosen reward, rejected reward); the rewards are detached and only logged.
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")
# Losses that never read the reference: no reference forward, no precomputed reference log-probs.
REFERENCE_FREE = ("simpo", "orpo")


class PairScores(NamedTuple):
    """A value for each pair's chosen and rejected answer, [pairs] each: a reward model's scores (models.heads), or
    DPO's implicit rewards (detached: only logged)."""

    chosen: Tensor
    rejected: Tensor


class PairLosses(NamedTuple):
    """What every preference loss returns: the loss of each pair and its answers' rewards, [pairs] each."""

    losses: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor


class SequenceLogps(NamedTuple):
    """Per answer sequence: the sum of its tokens' log-probabilities and how many tokens it has, [sequences] each."""

    sums: Tensor
    counts: Tensor


def log_ratio_rewards(beta: float, chosen_logratios: Tensor, rejected_logratios: Tensor) -> PairScores:
    return PairScores(beta * chosen_logratios.detach(), beta * rejected_logratios.detach())


def sigmoid_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float) -> PairLosses:
    """DPO: -log sigmoid(beta * (chosen log-ratio - rejected log-ratio))."""
    losses = -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))
    return PairLosses(losses, *log_ratio_rewards(beta, chosen_logratios, rejected_logratios))


def hinge_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float) -> PairLosses:
    """SLiC: relu(1 - beta * margin of log-ratios)."""
    losses = torch.relu(1 - beta * (chosen_logratios - rejected_logratios))
    return PairLosses(losses, *log_ratio_rewards(beta, chosen_logratios, rejected_logratios))


def robust_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float,
                label_smoothing: float) -> PairLosses:
    """Robust DPO: an unbiased loss when a share label_smoothing (< 0.5) of the pairs is flipped."""
    logits = beta * (chosen_logratios - rejected_logratios)
    losses = ((1 - label_smoothing) * -F.logsigmoid(logits) + label_smoothing * F.logsigmoid(-logits)) / (
        1 - 2 * label_smoothing)
    return PairLosses(losses, *log_ratio_rewards(beta, chosen_logratios, rejected_logratios))


def ipo_loss(chosen_logratios: Tensor, rejected_logratios: Tensor, chosen_tokens: Tensor, rejected_tokens: Tensor,
             beta: float) -> PairLosses:
    """IPO: (per-token chosen log-ratio - per-token rejected log-ratio - 1 / (2 beta))^2; TRL divides
    each summed log-ratio by its answer's token count (confirmed with the IPO authors)."""
    delta = chosen_logratios / chosen_tokens.clamp(min=1) - rejected_logratios / rejected_tokens.clamp(min=1)
    losses = (delta - 1 / (2 * beta)) ** 2
    return PairLosses(losses, *log_ratio_rewards(beta, chosen_logratios, rejected_logratios))


def simpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, chosen_tokens: Tensor, rejected_tokens: Tensor,
               beta: float, gamma: float, label_smoothing: float = 0.0) -> PairLosses:
    """SimPO, reference-free: the length-normalised log-probabilities as rewards, a target margin
    gamma: -log sigmoid(beta * (mean chosen - mean rejected) - gamma), label-smoothed as TRL's CPO
    trainer does. Rewards: beta * mean log-probability."""
    chosen_mean = chosen_logps / chosen_tokens.clamp(min=1)
    rejected_mean = rejected_logps / rejected_tokens.clamp(min=1)
    logits = beta * (chosen_mean - rejected_mean - gamma / beta)
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return PairLosses(losses, beta * chosen_mean.detach(), beta * rejected_mean.detach())


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler's split at -log 2)."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_odds_ratio_loss(chosen_logps: Tensor, rejected_logps: Tensor, chosen_tokens: Tensor,
                         rejected_tokens: Tensor, beta: float) -> PairLosses:
    """ORPO's odds-ratio term, reference-free: -beta * log sigmoid(log odds(chosen) - log odds(rejected))
    on length-normalised log-probabilities (odds p / (1 - p)). The NLL term of ORPO is nll_loss, added
    with weight 1 by preference_loss's caller. Rewards: beta * mean log-probability."""
    chosen_mean = (chosen_logps / chosen_tokens.clamp(min=1)).float()
    rejected_mean = (rejected_logps / rejected_tokens.clamp(min=1)).float()
    log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
    losses = -beta * F.logsigmoid(log_odds)
    return PairLosses(losses, beta * chosen_mean.detach(), beta * rejected_mean.detach())


def nll_loss(chosen_logps: Tensor, chosen_tokens: Tensor) -> Tensor:
    """Mean negative log-likelihood per chosen-answer token over the batch (TRL's "sft" loss term:
    --rpo_alpha, and ORPO's NLL)."""
    return -chosen_logps.sum() / chosen_tokens.sum().clamp(min=1)


def preference_loss(loss_type: str, policy_chosen_logps: Tensor, policy_rejected_logps: Tensor,
                    ref_chosen_logps: Tensor | None, ref_rejected_logps: Tensor | None, chosen_tokens: Tensor,
                    rejected_tokens: Tensor, beta: float, label_smoothing: float = 0.0,
                    simpo_gamma: float = 0.5) -> PairLosses:
    """PairLosses (loss per pair, chosen reward, rejected reward) of loss_type; the reference log-probs are
    unused (may be None) for the reference-free losses."""
    if loss_type == "simpo":
        return simpo_loss(policy_chosen_logps, policy_rejected_logps, chosen_tokens, rejected_tokens, beta,
                          simpo_gamma, label_smoothing)
    if loss_type == "orpo":
        return orpo_odds_ratio_loss(policy_chosen_logps, policy_rejected_logps, chosen_tokens, rejected_tokens,
                                    beta)
    if ref_chosen_logps is None or ref_rejected_logps is None:
        raise ValueError(f"--loss_type {loss_type} needs the reference log-probs")
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    if loss_type == "sigmoid":
        return sigmoid_loss(chosen_logratios, rejected_logratios, beta)
    if loss_type == "hinge":
        return hinge_loss(chosen_logratios, rejected_logratios, beta)
    if loss_type == "robust":
        return robust_loss(chosen_logratios, rejected_logratios, beta, label_smoothing)
    if loss_type == "ipo":
        return ipo_loss(chosen_logratios, rejected_logratios, chosen_tokens, rejected_tokens, beta)
    raise ValueError(f"unknown loss type {loss_type!r}; one of {', '.join(LOSS_TYPES)}")


def nll_weight(loss_type: str, rpo_alpha: float) -> float:
    """Weight of nll_loss in the total: ORPO's own 1, plus --rpo_alpha for any loss."""
    return (1.0 if loss_type == "orpo" else 0.0) + (rpo_alpha or 0.0)


def sequence_log_probs(token_logps: Tensor, answer_owner: Tensor, num_sequences: int) -> SequenceLogps:
    """SequenceLogps (sum of log-probabilities, token count) per sequence: token_logps [T] are the log-probabilities of
    answer tokens, token t belonging to sequence answer_owner[t]."""
    sums = torch.zeros(num_sequences, dtype=token_logps.dtype, device=token_logps.device)
    sums = sums.index_add(0, answer_owner, token_logps)
    counts = torch.bincount(answer_owner, minlength=num_sequences).to(token_logps.dtype)
    return SequenceLogps(sums, counts)
