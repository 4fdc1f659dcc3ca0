"""PPO experience: what one iteration's rollouts are (`Experience`, every tensor's shape in its
docstring), how they are made (`ExperienceMaker`: sample with the actor, score without gradients,
shape rewards, estimate advantages), the statistics logged of them (one function for training and
evaluation alike) and the stream of micro-batches the Trainer trains on.

Shapes: B rows (prompts), P the prompt width (prompts are left-padded to it), A the answer width
(answers are right-padded to it), T = P + A. Per-token tensors cover the answer only, [B, A], and
are 0 on padding."""

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lorakit.rl.health import moment_sums, pop_moments
from lorakit.rl.rl_math import (
    advantages_and_returns,
    kl_penalty_rewards,
    last_position,
    masked_mean,
    penalised_scores,
    sampler_gap,
)
from lorakit.rl.rollout import SampledBatch, rollout_engine

if TYPE_CHECKING:
    from datasets import Dataset

    from lorakit.rl.ppo_config import PPOArguments
    from lorakit.rl.role_policy import RolePolicy
    from lorakit.rl.rollout_arguments import RolloutArguments

logger = logging.getLogger(__name__)

# What the Trainer's compute_loss reads of each micro-batch (plus prompt_length and ptx_input_ids).
TRAINING_FIELDS = ("input_ids", "attention_mask", "response_mask", "old_logprobs", "sampler_logprobs", "old_values",
                   "advantages", "returns")

# One micro-batch for the Trainer: TRAINING_FIELDS' tensors, the int prompt_length, the bool old_from_update, and
# ptx_input_ids (GRPO's: its own fields and the float step_tokens). Typed as the Trainer types compute_loss's inputs:
# each field's type is the stage's to know.
MicroBatch = dict[str, Any]
# The run's arguments an ExperienceMaker reads: any stage's for the rollout, PPO's for make() (its reward shaping).
RolloutArgs = TypeVar("RolloutArgs", bound="RolloutArguments", covariant=True)


@dataclass
class Rollout:
    """Answers sampled by the actor to B prompts.

    input_ids       [B, T] long   prompt (left-padded to P) then answer (right-padded to A)
    attention_mask  [B, T] long   1 on prompt tokens and on answer tokens
    prompt_length   int           P
    response_mask   [B, A] float  1 on answer tokens up to and including the answer-end token
    has_eos         [B] bool      the answer ended with the answer-end token (else it hit the limit)
    logprobs        [B, A] float  the actor's log-prob of each sampled token, taken from the logits
                                  that sampled it (the old policy of PPO's ratio), temperature applied
    entropy         [B, A] float  the actor's next-token entropy at each answer position"""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_length: int
    response_mask: torch.Tensor
    has_eos: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor


@dataclass
class RolloutScores:
    """The no-grad passes over a rollout: ref_logprobs [B, A] (reference model's log-probs of the
    answer tokens), values [B, A] (critic), scores [B] (reward model, read after the turn end)."""

    ref_logprobs: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor


@dataclass
class Experience:
    """One batch of PPO experience: a rollout, its scores, and what PPO derives from them.

    input_ids       [B, T] long   prompt (left-padded to P) then answer (right-padded to A)
    attention_mask  [B, T] long
    prompt_length   int           P
    response_mask   [B, A] float  1 on real answer tokens (through the answer-end token)
    has_eos         [B] bool      the answer ended (else it was cut at --max_answer_seq_len)
    old_logprobs    [B, A] float  actor's log-probs before the update, from the training forward (the old policy)
    sampler_logprobs [B, A] float the sampler's log-probs of the same tokens (the rollout engine's)
    ref_logprobs    [B, A] float  reference model's log-probs
    old_values      [B, A] float  critic's values at sampling time
    entropy         [B, A] float  actor's next-token entropy
    scores          [B] float     reward model's score less --missing_eos_penalty for unended answers,
                                  before clipping
    kl              [B, A] float  log pi - log pi_ref per token
    rewards         [B, A] float  -kl_coef * kl per token, plus the clipped score at the last real token
    advantages      [B, A] float  GAE advantages, whitened over the batch
    returns         [B, A] float  the critic's targets (advantages before whitening + values)
    old_from_update bool          the rollout trains one optimizer step only: the update's own detached log-probs
                                  are the old policy (no pass before it), old_logprobs hold the sampler's (what
                                  the KL penalty was shaped with) and the sampler gap is measured in the update"""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_length: int
    response_mask: torch.Tensor
    has_eos: torch.Tensor
    old_logprobs: torch.Tensor
    sampler_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    old_values: torch.Tensor
    entropy: torch.Tensor
    scores: torch.Tensor
    kl: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    old_from_update: bool = False

    def training_rows(self, rows: torch.Tensor) -> MicroBatch:
        """The Trainer's inputs for the given rows: TRAINING_FIELDS, each [rows, ...], prompt_length and
        old_from_update."""
        batch = {name: getattr(self, name)[rows.to(self.input_ids.device)] for name in TRAINING_FIELDS}
        batch["prompt_length"], batch["old_from_update"] = self.prompt_length, self.old_from_update
        return batch


def shape_experience(rollout: Rollout, scored: RolloutScores, kl_coef: float, args: "PPOArguments",
                     sampler_logprobs: torch.Tensor | None = None, old_from_update: bool = False) -> Experience:
    """The experience of a scored rollout: per-token KL-penalised rewards with the (penalised,
    clipped) score at each answer's end, then whitened GAE advantages and returns. args supplies
    missing_eos_penalty, clip_reward_value, gamma and lam (the run's PPOArguments). rollout.logprobs
    are the old policy's (old_from_update: the sampler's, the update taking its own); sampler_logprobs
    (default: the same) the sampler's."""
    mask = rollout.response_mask
    scores = penalised_scores(scored.scores, rollout.has_eos, args.missing_eos_penalty)
    rewards, kl = kl_penalty_rewards(rollout.logprobs, scored.ref_logprobs, scores, mask, kl_coef,
                                     args.clip_reward_value)
    advantages, returns = advantages_and_returns(scored.values, rewards, mask, args.gamma, args.lam)
    return Experience(
        input_ids=rollout.input_ids, attention_mask=rollout.attention_mask, prompt_length=rollout.prompt_length,
        response_mask=mask, has_eos=rollout.has_eos, old_logprobs=rollout.logprobs,
        sampler_logprobs=rollout.logprobs if sampler_logprobs is None else sampler_logprobs,
        ref_logprobs=scored.ref_logprobs, old_values=scored.values, entropy=rollout.entropy, scores=scores, kl=kl,
        rewards=rewards, advantages=advantages, returns=returns, old_from_update=old_from_update)


# -- prompts, padding, answer ends ----------------------------------------------


def stream_indices(num_items: int, seed: int, start: int, count: int) -> list[int]:
    """Positions start..start+count of an endless stream of seeded permutations of num_items:
    epoch e is permutation(seed, e). A pure function of the position, so a resumed run draws
    exactly the prompts the uninterrupted run would have."""
    picked, permutations = [], {}
    for position in range(start, start + count):
        epoch, offset = divmod(position, num_items)
        if epoch not in permutations:
            permutations[epoch] = np.random.default_rng([seed, epoch]).permutation(num_items)
        picked.append(int(permutations[epoch][offset]))
    return picked


def derived_seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0])


def generation_batch_size(args: "RolloutArguments") -> int:
    """Prompts (PPO) or answers (GRPO) per generate() call per process: PPO's flag, or what GRPOArguments'
    __post_init__ sets (its flag, default --per_device_train_batch_size); None only before that."""
    if args.per_device_generation_batch_size is None:
        raise ValueError("per_device_generation_batch_size is not set: the stage's arguments set it in __post_init__")
    return args.per_device_generation_batch_size


def training_batch_size(args: "RolloutArguments") -> int:
    """Rows per micro-batch of the old policy's pass and the update: PPO's --per_device_training_batch_size (default
    8) or GRPO's --per_device_train_batch_size, as their __post_init__ set it; None only before that."""
    if args.per_device_training_batch_size is None:
        raise ValueError("per_device_training_batch_size is not set: the stage's arguments set it in __post_init__")
    return args.per_device_training_batch_size


def iteration_prompt_indices(num_prompts: int, iteration: int, count: int, args: "RolloutArguments") -> list[int]:
    """The indices of this process's count prompts of one iteration: each process its own stretch of the seeded
    prompt stream, so that one process taking world_size x count prompts takes the same ones."""
    start = (iteration * args.world_size + args.process_index) * count
    return stream_indices(num_prompts, args.seed, start, count)


def iteration_prompt_rows(prompts: list[list[int]], iteration: int, args: "RolloutArguments") -> list[list[int]]:
    """This process's prompts of one PPO iteration: generation_batches x per_device_generation_batch_size
    of them (iteration_prompt_indices)."""
    size = args.generation_batches * generation_batch_size(args)
    return [prompts[i] for i in iteration_prompt_indices(len(prompts), iteration, size, args)]


class EvaluationRows(NamedTuple):
    """This process's held-out prompts (token ids) and their weights [rows] float (0 for the filling repeats)."""

    rows: list[list[int]]
    weights: torch.Tensor


def evaluation_prompt_rows(prompts: list[list[int]], args: "RolloutArguments") -> EvaluationRows:
    """This process's share of the held-out prompts, (rows, weights [rows] float): every process
    gets the same number of generation batches (under ZeRO-3 each forward is a collective), filled
    with repeats of the first prompt that weigh 0 in the statistics."""
    batch, world = generation_batch_size(args), args.world_size
    per_rank = math.ceil(len(prompts) / world / batch) * batch
    mine = list(range(args.process_index, len(prompts), world))
    weights = torch.tensor([1.0] * len(mine) + [0.0] * (per_rank - len(mine)))
    return EvaluationRows([prompts[i] for i in mine] + [prompts[0]] * (per_rank - len(mine)), weights)


class TokenBatch(NamedTuple):
    """Rows of token ids and their attention mask, both [B, width] long."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor


class AnswerMask(NamedTuple):
    """answer_mask's mask [B, A] long (1 through the answer-end token) and has_end [B] bool."""

    mask: torch.Tensor
    has_end: torch.Tensor


def left_pad(rows: list[list[int]], width: int, pad_id: int) -> TokenBatch:
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return TokenBatch(ids, mask)


def answer_mask(answers: torch.Tensor, answer_end_id: int) -> AnswerMask:
    """1 on answer tokens up to and including the first answer-end token (all of a row without
    one); the ids after it are generate's padding. Never compares ids with the pad id (it may be
    the answer-end token). Returns (mask [B, A] long, has_end [B] bool)."""
    is_end = answers == answer_end_id
    seen_before = (is_end.long().cumsum(-1) - is_end.long()) > 0
    return AnswerMask((~seen_before).long(), is_end.any(-1))


def append_turn_end(input_ids: torch.Tensor, attention_mask: torch.Tensor, answer_end_id: int,
                    after_turn_end_ids: list[int]) -> TokenBatch:
    """Completes the turn of each answer that ended: the answer ends with the template's turn-end
    token (answer_end_id: EOS, or `<|im_end|>`, `<|end|>`, ... where the template ends turns with
    its own), and the template renders after_turn_end_ids after it (ChatML's "\\n"); the reward
    model was trained to read its score at the last of them (see ConversationTokenizer's
    keep_after_turn_end and turn_end_ids). Rows cut at the answer length limit are scored where they
    stop. Returns new (ids, mask) [B, T + len(after_turn_end_ids)]."""
    if not after_turn_end_ids:
        return TokenBatch(input_ids, attention_mask)
    extra = len(after_turn_end_ids)
    ids = F.pad(input_ids, (0, extra), value=answer_end_id)
    mask = F.pad(attention_mask, (0, extra), value=0)
    last = last_position(attention_mask)
    rows = torch.nonzero(input_ids.gather(1, last[:, None]).squeeze(1) == answer_end_id).squeeze(1)
    for offset, token in enumerate(after_turn_end_ids, start=1):
        ids[rows, last[rows] + offset] = token
        mask[rows, last[rows] + offset] = 1
    return TokenBatch(ids, mask)


# -- making experience ------------------------------------------------------------


class PhaseTimes:
    """Seconds spent per named phase since the last drain (logged with each training step)."""

    def __init__(self, *names: str) -> None:
        self.seconds = dict.fromkeys(names, 0.0)

    @contextmanager
    def timing(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        yield
        self.add(name, time.perf_counter() - started)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def drained(self) -> dict[str, float]:
        drained = {name: round(value, 4) for name, value in self.seconds.items()}
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        return drained


class ExperienceMaker(Generic[RolloutArgs]):
    """Experience from prompts with the four roles of a RolePolicy: sampling by the actor, then no-grad
    passes of the reference, critic and reward model, then reward shaping and advantages
    (shape_experience). args is the run's arguments: any stage's samples (generate, old_logprobs), PPOArguments
    make the experience (make). deepspeed_engine: returns the Trainer's DeepSpeed engine (None before it exists);
    under ZeRO-3 generation goes through its hooks."""

    def __init__(self, model: "RolePolicy", args: RolloutArgs, pad_id: int, answer_end_id: int,
                 after_turn_end_ids: Sequence[int], max_answer_len: int, max_prompt_len: int | None = None,
                 deepspeed_engine: Callable[[], Any] | None = None) -> None:
        self.model, self.args = model, args
        self.pad_id, self.answer_end_id = pad_id, answer_end_id
        self.after_turn_end_ids, self.max_answer_len = list(after_turn_end_ids), max_answer_len
        self.engine = rollout_engine(model, args, pad_id, answer_end_id, max_answer_len,
                                     deepspeed_engine or (lambda: None), max_prompt_len)

    def make(self: "ExperienceMaker[PPOArguments]", prompt_rows: list[list[int]], seed: int, kl_coef: float,
             times: PhaseTimes | None = None,
             row_chunks: list[torch.Tensor] | None = None, old_from_update: bool = False) -> Experience:
        """Sample answers to prompt_rows (token ids) with the given seed, take the old policy's log-probs
        from the training forward (old_logprobs, over row_chunks), score and shape them; the phases'
        seconds go to times as time_generation and time_scoring. old_from_update (the rollout trains one
        optimizer step only): no pass for the old policy, the update takes its own (Experience.old_from_update)."""
        times = times or PhaseTimes("time_generation", "time_scoring")
        self.model.eval()
        with times.timing("time_generation"), torch.no_grad():
            sampled = self.generate(prompt_rows, seed)
        with times.timing("time_scoring"):
            rollout = sampled if old_from_update else replace(sampled,
                                                               logprobs=self.old_logprobs(sampled, row_chunks))
            return shape_experience(rollout, self.score(rollout), kl_coef, self.args, sampled.logprobs,
                                    old_from_update)

    @torch.no_grad()
    def old_logprobs(self, rollout: Rollout, row_chunks: list[torch.Tensor] | None) -> torch.Tensor:
        """The old policy's log-probs [B, A]: the actor's from the training forward (the policy's
        forward with values=False, no gradients, the precision the Trainer wrapped it in), over the
        micro-batches of rows the first update sees (row_chunks; default: rows in order, in
        per_device_training_batch_size), so that update's ratio is 1 whatever the sampler's numerics."""
        size, device = rollout.input_ids.shape[0], rollout.input_ids.device
        chunks = row_chunks or list(torch.arange(size).split(training_batch_size(self.args)))
        logprobs = torch.zeros_like(rollout.logprobs)
        for rows in chunks:
            rows = rows.to(device)
            outputs = self.model(input_ids=rollout.input_ids[rows], attention_mask=rollout.attention_mask[rows],
                                 prompt_length=rollout.prompt_length, values=False)
            logprobs[rows] = outputs["logprobs"].float() * rollout.response_mask[rows]
        return logprobs

    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> SampledBatch:
        """One generation batch from the rollout engine (a seam of its own: tests/helpers probe it)."""
        return self.engine.sample(prompt_ids, prompt_mask)

    def generate(self, prompt_rows: list[list[int]], seed: int, batch_seeds: Sequence[int] | None = None) -> Rollout:
        """Answers sampled by the current actor (KV cache on, in batches of
        per_device_generation_batch_size, left-padded prompts), with the actor's log-probs and
        entropy of each answer token taken from the logits that sampled it. batch_seeds (one per
        generation batch): each batch sampled from its own seed at its own prompts' width, so that it
        samples the same answers whichever process and rollout it falls in (else one seed for all, the
        rollout's width)."""
        device, batch = self.args.device, generation_batch_size(self.args)
        width = max(len(row) for row in prompt_rows)
        prompt_ids, prompt_mask = left_pad(prompt_rows, width, self.pad_id)
        parts = []
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            for number, start in enumerate(range(0, len(prompt_rows), batch)):
                ids, mask = prompt_ids[start : start + batch], prompt_mask[start : start + batch]
                if batch_seeds is not None:
                    torch.manual_seed(batch_seeds[number])
                    own_width = int(mask.sum(dim=1).max())  # left-padded: the columns before are padding alone
                    ids, mask = ids[:, width - own_width :], mask[:, width - own_width :]
                parts.append(self.sample(ids.to(device), mask.to(device)))
        # Unpacked, not read by field name: a probe wrapping sample() (tests/helpers) may return a plain tuple.
        token_parts, logprob_parts, entropy_parts = zip(*parts, strict=True)
        longest = max(tokens.shape[1] for tokens in token_parts)

        def padded(values: Sequence[torch.Tensor], value: float) -> torch.Tensor:
            return torch.cat([F.pad(part, (0, longest - part.shape[1]), value=value) for part in values])

        answers = padded(token_parts, self.pad_id)
        mask, has_eos = answer_mask(answers, self.answer_end_id)
        response_mask = mask.float().to(device)
        return Rollout(input_ids=torch.cat([prompt_ids, answers], dim=1).to(device),
                       attention_mask=torch.cat([prompt_mask, mask], dim=1).to(device), prompt_length=width,
                       response_mask=response_mask, has_eos=has_eos.to(device),
                       logprobs=padded(logprob_parts, 0.0).to(device) * response_mask,
                       entropy=padded(entropy_parts, 0.0).to(device) * response_mask)

    @torch.no_grad()
    def score(self, rollout: Rollout) -> RolloutScores:
        """The no-grad passes, one generation batch at a time, each over groups of rows of similar
        length: reference log-probs, critic values, reward scores (of each answer closed by the
        template's turn end, append_turn_end)."""
        model, width = self.model, rollout.prompt_length

        def passes(ids: torch.Tensor, mask: torch.Tensor, prompt_length: int) -> dict[str, torch.Tensor]:
            closed = append_turn_end(ids, mask, self.answer_end_id, self.after_turn_end_ids)
            return {"ref_logprobs": model.answer_logprobs("reference", ids, mask, prompt_length),
                    "values": model.answer_values(ids, mask, prompt_length), "scores": model.scores(*closed)}

        parts: dict[str, list[torch.Tensor]] = {"ref_logprobs": [], "values": [], "scores": []}
        batch = generation_batch_size(self.args)
        for start in range(0, rollout.input_ids.shape[0], batch):
            rows = slice(start, start + batch)
            for name, value in model.over_length_groups(rollout.input_ids[rows], rollout.attention_mask[rows], width,
                                                        passes).items():
                parts[name].append(value)
        return RolloutScores(**{name: torch.cat(values) for name, values in parts.items()})


# -- statistics ---------------------------------------------------------------------


class SumStats:
    """Sums and counts of named statistics, reduced across processes on request."""

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}

    def add(self, name: str, total: float, count: float = 1.0) -> None:
        current = self.sums.setdefault(name, [0.0, 0.0])
        current[0] += float(total)
        current[1] += float(count)

    def reduced(self, device: torch.device) -> dict[str, float]:
        names = sorted(self.sums)
        values = torch.tensor([self.sums[n] for n in names], dtype=torch.float64).reshape(-1, 2)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            values = values.to(torch.float32).to(device)
            dist.all_reduce(values)
            values = values.double().cpu()
        return {name: (values[i, 0] / values[i, 1].clamp(min=1e-12)).item() for i, name in enumerate(names)}


def experience_metrics(experience: Experience, device: torch.device,
                       row_weights: torch.Tensor | None = None) -> dict[str, float]:
    """The statistics of an experience, means over all processes' rows (weighted by row_weights [B],
    default 1): reward_mean and reward_std of the sequence reward (sum of the per-token rewards:
    clipped penalised score minus kl_coef x KL), score_mean (the penalised score), kl (sequence KL
    to the reference), response_length, eos_fraction, value_mean, entropy (per real token),
    sampler_gap/logprob_abs and sampler_gap/kl (per real token, rl_math.sampler_gap),
    reward_length_corr (the score's Pearson correlation with the answer length) and explained_variance
    (the critic's values of the returns, per real token; rl.health.PairMoments). The one definition
    training and evaluation both log."""
    mask = experience.response_mask
    weights = torch.ones(mask.shape[0], device=mask.device) if row_weights is None else row_weights.to(mask.device)
    sequence_rewards = experience.rewards.sum(-1)
    stats = SumStats()
    for name, values in (("reward_mean", sequence_rewards), ("reward_sq", sequence_rewards ** 2),
                         ("score_mean", experience.scores), ("kl", experience.kl.sum(-1)),
                         ("response_length", mask.sum(-1)), ("eos_fraction", experience.has_eos.float()),
                         ("value_mean", masked_mean(experience.old_values, mask, dim=-1))):
        stats.add(name, (values * weights).sum().item(), weights.sum().item())
    token_weights = mask * weights[:, None]
    stats.add("entropy", (experience.entropy * token_weights).sum().item(), token_weights.sum().item())
    if not experience.old_from_update:  # else the update measures it (PPOTrainer.compute_loss)
        gap = sampler_gap(experience.old_logprobs, experience.sampler_logprobs, token_weights)
        stats.add("sampler_gap/logprob_abs", gap.logprob_abs, gap.count)
        stats.add("sampler_gap/kl", gap.kl, gap.count)
    add_moments(stats, "length_moments", experience.scores, mask.sum(-1), weights)
    add_moments(stats, "value_moments", experience.returns, experience.returns - experience.old_values, token_weights)
    metrics = stats.reduced(device)
    metrics["reward_std"] = math.sqrt(max(metrics.pop("reward_sq") - metrics["reward_mean"] ** 2, 0.0))
    with_figure(metrics, "reward_length_corr", pop_moments(metrics, "length_moments").correlation())
    with_figure(metrics, "explained_variance", pop_moments(metrics, "value_moments").explained_variance())
    return metrics


def add_moments(stats: SumStats, prefix: str, x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> None:
    """PairMoments of x and y under weights into stats as prefix/<part>, reduced with the other statistics."""
    count = weights.sum().item()
    for part, total in moment_sums(x, y, weights).items():
        stats.add(f"{prefix}/{part}", total, count)


def with_figure(metrics: dict[str, float], name: str, value: float | None) -> None:
    """metrics[name] = value where the batch defines it (a correlation of a constant does not exist)."""
    if value is not None:
        metrics[name] = value


def training_metrics(experience: Experience, kl_coef: float, device: torch.device) -> dict[str, float]:
    """What each training step logs of its iteration's experience, with the KL coefficient it was shaped with."""
    return {**experience_metrics(experience, device), "kl_coef": kl_coef}


def evaluation_metrics(experience: Experience, row_weights: torch.Tensor, device: torch.device,
                       prefix: str = "eval") -> dict[str, float]:
    """What an evaluation logs of the held-out experience: the same statistics as training's, named prefix_*."""
    return {f"{prefix}_{name}": value for name, value in experience_metrics(experience, device, row_weights).items()}


# -- the Trainer's stream of micro-batches -------------------------------------------


def epoch_chunks(size: int, iteration: int, epoch: int, args: "RolloutArguments") -> list[torch.Tensor]:
    """The rows [chunk] long of each micro-batch of one PPO epoch over an iteration's size rows: a seeded order
    per (iteration, rank, epoch), in per_device_training_batch_size rows."""
    order = torch.randperm(size, generator=torch.Generator().manual_seed(
        derived_seed(args.seed, iteration, args.process_index, 2, epoch)))
    return list(order.split(training_batch_size(args)))


def micro_batches(experience: Experience, iteration: int, args: "PPOArguments",
                  ptx_blocks: "Dataset | None") -> list[MicroBatch]:
    """The Trainer's inputs of one iteration: --ppo_epochs passes over the experience, each in its
    own seeded order, in micro-batches of per_device_training_batch_size rows (Experience.training_rows),
    each with ptx_input_ids [rows, block] from the ptx blocks' own seeded stream when there are any."""
    batches: list[MicroBatch] = []
    size = experience.input_ids.shape[0]
    for epoch in range(args.ppo_epochs):
        batches.extend(experience.training_rows(chunk) for chunk in epoch_chunks(size, iteration, epoch, args))
    if ptx_blocks is not None:
        rows = training_batch_size(args)
        start = (iteration * args.world_size + args.process_index) * len(batches) * rows
        picked = stream_indices(len(ptx_blocks), args.seed + 1, start, len(batches) * rows)
        for number, batch in enumerate(batches):
            block_ids = picked[number * rows : (number + 1) * rows]
            batch["ptx_input_ids"] = torch.tensor([ptx_blocks[i]["input_ids"] for i in block_ids])
    return batches


class ExperienceStream:
    """The Trainer's train "dataloader": endless, one PPO iteration of micro-batches at a time,
    made by make_batches(iteration) only when the Trainer asks for the iteration's first
    micro-batch. It owns the iteration counter (a resume sets it). No __len__: the Trainer then
    runs by --max_steps and has no batches to skip on resume."""

    def __init__(self, make_batches: Callable[[int], list[MicroBatch]]) -> None:
        self.make_batches = make_batches
        self.iteration = 0

    def __iter__(self) -> Iterator[MicroBatch]:
        while True:
            batches = self.make_batches(self.iteration)
            self.iteration += 1
            yield from batches
