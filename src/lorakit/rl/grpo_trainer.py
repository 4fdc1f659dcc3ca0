"""The group-relative stages' Trainer (lorakit.commands.grpo): each rollout samples num_generations answers to every
prompt of the process's share, scores them with the reward functions (and the reward model), turns the scores into
advantages (rl.group_math) and trains num_iterations optimizer steps on them with the clipped surrogate; the experience
stream, the old policy, the EMA and exact resume are rl.rl_trainer's."""

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from lorakit.rl.alarms import HealthPlan
from lorakit.rl.experience import (
    MicroBatch,
    Rollout,
    SumStats,
    add_moments,
    append_turn_end,
    derived_seed,
    epoch_chunks,
    generation_batch_size,
    iteration_prompt_indices,
    with_figure,
)
from lorakit.rl.group_math import (
    global_whiten,
    group_advantages,
    group_policy_loss,
    kl_estimate,
    reinforce_pp_returns,
    zero_spread_groups,
)
from lorakit.rl.health import AnswerLimit, pop_moments
from lorakit.rl.reward_functions import (
    REWARD_MODEL_LABEL,
    RewardBatch,
    RewardFunction,
    RewardScores,
    score_completions,
    warn_never_applied,
)
from lorakit.rl.rl_math import FixedKLController, sampler_gap
from lorakit.rl.rl_trainer import RLTrainer

if TYPE_CHECKING:
    from lorakit.data.prompts import Prompt
    from lorakit.rl.grpo_checks import GroupSchedule
    from lorakit.rl.grpo_config import GRPOArguments
    from lorakit.rl.role_policy import SharedBasePolicy

logger = logging.getLogger(__name__)

# What compute_loss reads of each micro-batch, row by row (plus prompt_length, old_from_update and step_tokens).
GROUP_FIELDS = ("input_ids", "attention_mask", "response_mask", "old_logprobs", "sampler_logprobs", "ref_logprobs",
                "advantages")


class GroupExperience(NamedTuple):
    """One rollout's experience, rows in groups of num_generations consecutive answers to one prompt:
    the rollout (ids, masks, the sampler's log-probs and entropy), the old policy's and the reference's log-probs
    [N, A] (the reference's zero without one), the advantages ([N], or [N, A] for REINFORCE++), the rewards, the
    mask the update trains on (response_mask less the rows dynamic sampling leaves out), the zero-spread groups, and
    whether the update's own log-probs are the old policy's (no pass before it)."""

    rollout: Rollout
    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: RewardScores
    training_mask: torch.Tensor
    zero_spread: torch.Tensor
    old_from_update: bool


def all_reduce_sum(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """values summed over every process (the identity on one), reduced on device (NCCL reduces CUDA tensors only),
    returned where they were."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        reduced = values.to(device, copy=True)
        dist.all_reduce(reduced)
        return reduced.to(values.device)
    return values


class GRPOTrainer(RLTrainer):
    """GRPO, Dr. GRPO, DAPO's loss, RLOO and REINFORCE++ on the Trainer (see the module's docstring). records: the
    Prompt each train prompt was read from (index for index), eval_records the held-out ones'; rewards: the
    --reward_funcs; schedule: rl.grpo.GroupSchedule."""

    stage_name = "GRPO"
    args: "GRPOArguments"
    model: "SharedBasePolicy"  # rl.group_policy's: the actor, the reference and the reward model on one base

    def __init__(self, *args: Any, records: list["Prompt"], eval_records: list["Prompt"] | None,
                 rewards: list[RewardFunction], schedule: "GroupSchedule", **kwargs: Any) -> None:
        training_args = kwargs["args"]
        super().__init__(*args, steps_per_iteration=schedule.steps, max_answer_len=training_args.max_completion_length,
                         **kwargs)
        self.records, self.eval_records, self.rewards, self.schedule = records, eval_records, rewards, schedule
        # Every field any record has, passed to every call (None where a record lacks it), as TRL passes columns.
        self.field_names = sorted({name for record in records + (eval_records or []) for name in record.fields})
        self.kl_ctl = FixedKLController(self.args.beta)
        # REINFORCE++ pays the KL in the reward; the others in the loss.
        self.kl_in_reward = self.args.advantage_estimator.startswith("reinforce_pp")
        # A group's answers share their prompt's pass (rl.role_policy.RolePolicy.prompt_shared_hidden); checkpointed
        # layers keep no cache, so under --gradient_checkpointing every row runs its prompt.
        self.model.share_prompts = not self.args.gradient_checkpointing
        self.warned_never_applied: set[str] = set()  # the functions that returned None everywhere, warned once each

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(values, self.args.device)

    @property
    def kl_estimator(self) -> str:
        """--kl_estimator, which GRPOArguments' __post_init__ sets where not given (k1 in the reward, else k3)."""
        assert self.args.kl_estimator is not None  # set by __post_init__
        return self.args.kl_estimator

    # -- experience -----------------------------------------------------------

    def make_iteration(self, iteration: int) -> list[MicroBatch]:
        """One rollout as the Trainer's micro-batches; its statistics are logged with the rollout's steps."""
        args = self.args
        indices = iteration_prompt_indices(len(self.prompts), iteration, self.schedule.prompts, args)
        answers, batch = self.schedule.answers, generation_batch_size(args)
        # A seed per generation batch, by its first answer's place in the global rollout: the same batches sample
        # the same answers on one process or several.
        seeds = [derived_seed(args.seed, iteration, args.process_index * answers + start, 1)
                 for start in range(0, answers, batch)]
        first_update = epoch_chunks(self.schedule.answers, iteration, 0, args)  # the old policy's pass: its rows
        experience = self.make_experience(indices, self.prompts, self.records, args.num_generations, seeds,
                                          old_from_update=self.steps_per_iteration == 1, row_chunks=first_update)
        self.experience_stats = self.experience_metrics(experience)
        rollout = experience.rollout
        self.experience_stats.update(self.answer_figures(rollout.input_ids, rollout.prompt_length,
                                                         rollout.response_mask, args.num_generations))
        if args.log_completions and iteration % args.log_completions == 0 and args.should_log:
            self.log_group(iteration, experience, self.records[indices[0]])
        return self.micro_batches(experience, iteration)

    def make_experience(self, indices: Sequence[int], prompt_ids: list[list[int]], records: list["Prompt"],
                        group_size: int, seeds: int | list[int], old_from_update: bool,
                        row_chunks: list[torch.Tensor] | None = None, train: bool = True) -> GroupExperience:
        """group_size answers to each prompt of indices, sampled from one seed or a seed per generation batch,
        scored, with their advantages (train; an evaluation needs none: its zero advantages). The old policy's
        pass, where there is one, runs over row_chunks, the micro-batches the first update sees."""
        rows = [prompt_ids[i] for i in indices for _ in range(group_size)]
        row_records = [records[i] for i in indices for _ in range(group_size)]
        self.model.eval()
        with self.times.timing("time_generation"), torch.no_grad():
            rollout = (self.maker.generate(rows, seeds) if isinstance(seeds, int)
                       else self.maker.generate(rows, seeds[0], batch_seeds=seeds))
        with self.times.timing("time_scoring"), torch.no_grad():
            frozen = self.frozen_passes(rollout)
            rewards = self.score(rollout, row_records, frozen.get("scores"))
            old = rollout.logprobs if old_from_update else self.maker.old_logprobs(rollout, row_chunks)
            ref = frozen.get("ref_logprobs", torch.zeros_like(old))
            mask = rollout.response_mask
            advantages = (self.advantages(rewards.scores.to(mask.device), old, ref, mask, group_size) if train
                          else torch.zeros(mask.shape[0], device=mask.device))
            zero_spread = zero_spread_groups(rewards.scores, group_size)
            training_mask = mask
            if self.args.dynamic_sampling:
                kept = (~zero_spread).repeat_interleave(group_size).to(mask.device)
                training_mask = mask * kept[:, None].to(mask.dtype)
            if self.args.mask_truncated_completions:  # an answer cut at the limit: scored, not trained on
                training_mask = training_mask * rollout.has_eos[:, None].to(mask.dtype)
        return GroupExperience(rollout, old, ref, advantages, rewards, training_mask, zero_spread, old_from_update)

    def frozen_passes(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        """The reference's log-probs (where --beta > 0) and the reward model's scores (where one is given), one
        generation batch at a time, over groups of rows of similar length."""
        model, needs_reference = self.model, self.args.beta > 0
        if not needs_reference and model.score_head is None:
            return {}

        def passes(ids: torch.Tensor, mask: torch.Tensor, prompt_length: int) -> dict[str, torch.Tensor]:
            result = {}
            if needs_reference:
                result["ref_logprobs"] = model.answer_logprobs("reference", ids, mask, prompt_length)
            if model.score_head is not None:
                closed = append_turn_end(ids, mask, self.maker.answer_end_id, self.maker.after_turn_end_ids)
                result["scores"] = model.scores(*closed)
            return result

        parts: dict[str, list[torch.Tensor]] = {}
        batch = generation_batch_size(self.args)
        for start in range(0, rollout.input_ids.shape[0], batch):
            rows = slice(start, start + batch)
            for name, value in model.over_length_groups(rollout.input_ids[rows], rollout.attention_mask[rows],
                                                        rollout.prompt_length, passes).items():
                parts.setdefault(name, []).append(value)
        return {name: torch.cat(values) for name, values in parts.items()}

    def score(self, rollout: Rollout, records: list["Prompt"], model_scores: torch.Tensor | None) -> RewardScores:
        """The reward functions' weighted sum of each answer, plus the reward model's score where there is one."""
        answers = rollout.input_ids[:, rollout.prompt_length:].cpu()  # one copy, not a device sync per row
        mask = rollout.response_mask.bool().cpu()
        completion_ids = [answers[row][mask[row]].tolist() for row in range(answers.shape[0])]
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        prompts = [record.messages if record.conversational else record.messages[-1]["content"] for record in records]
        completions = [[{"role": "assistant", "content": text}] if record.conversational else text
                       for record, text in zip(records, texts, strict=True)]
        fields = {name: [record.fields.get(name) for record in records] for name in self.field_names}
        batch = RewardBatch(prompts, completions, completion_ids, fields, [record.where for record in records])
        scored = score_completions(self.rewards, batch, self.state, self.args.reward_timeout) if self.rewards else (
            RewardScores(torch.zeros(len(records)), {}))
        if self.is_world_process_zero():
            warn_never_applied(self.rewards, scored, self.warned_never_applied)
        if model_scores is None:
            return scored
        return RewardScores(scored.scores + model_scores.float().cpu(),
                            {**scored.per_function, REWARD_MODEL_LABEL: model_scores.float().cpu()})

    def advantages(self, scores: torch.Tensor, old: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor,
                   group_size: int) -> torch.Tensor:
        """--advantage_estimator's advantages: one per answer [N], or REINFORCE++'s per token [N, A] (the KL to
        the reference paid in the reward at --beta, the returns whitened over every process's tokens)."""
        args = self.args
        sequence = group_advantages(scores, group_size, args.advantage_estimator, args.scale_rewards,
                                    reduce=self.all_reduce_sum).to(mask.device)
        if not self.kl_in_reward:
            return sequence
        kl = kl_estimate(old, ref, self.kl_estimator) if args.beta > 0 else torch.zeros_like(old)
        returns = reinforce_pp_returns(sequence, kl, mask, args.beta)
        return global_whiten(returns, mask, reduce=self.all_reduce_sum)

    # -- micro-batches and the loss ------------------------------------------------

    def micro_batches(self, experience: GroupExperience, iteration: int) -> list[MicroBatch]:
        """num_iterations passes over the rollout, each in its own seeded order, in micro-batches of
        per_device_train_batch_size answers; each carries the global count of the answer tokens its optimizer
        step trains on (the dapo loss's denominator)."""
        rollout, args = experience.rollout, self.args
        columns = {"input_ids": rollout.input_ids, "attention_mask": rollout.attention_mask,
                   "response_mask": experience.training_mask, "old_logprobs": experience.old_logprobs,
                   "sampler_logprobs": rollout.logprobs, "ref_logprobs": experience.ref_logprobs,
                   "advantages": experience.advantages}
        step_tokens = self.all_reduce_sum(experience.training_mask.sum().float().reshape(1)).item()
        size = rollout.input_ids.shape[0]
        batches: list[MicroBatch] = []
        for epoch in range(args.num_iterations):
            for chunk in epoch_chunks(size, iteration, epoch, args):
                rows = chunk.to(rollout.input_ids.device)
                batch: MicroBatch = {name: columns[name][rows] for name in GROUP_FIELDS}
                batch.update(prompt_length=rollout.prompt_length, old_from_update=self.steps_per_iteration == 1,
                             step_tokens=max(step_tokens, 1.0))
                batches.append(batch)
        return batches

    def compute_loss(self, model: torch.nn.Module, inputs: MicroBatch, return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None,
                     ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        args = self.args
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                        prompt_length=inputs["prompt_length"], values=False)
        old_logprobs = self.old_logprobs(outputs["logprobs"], inputs)
        result = group_policy_loss(
            outputs["logprobs"], old_logprobs, inputs["advantages"], inputs["response_mask"], args.epsilon,
            args.epsilon_high, inputs["ref_logprobs"], 0.0 if self.kl_in_reward else args.beta, self.kl_estimator,
            args.loss_type, args.max_completion_length, inputs["step_tokens"], args.importance_sampling_level,
            self.sampler_weights(old_logprobs, inputs))
        loss = result.loss
        if args.loss_type == "dapo":
            # Its denominator counts every process's and accumulation step's tokens: undo the Trainer's division
            # by the accumulation steps and the data-parallel mean of the gradients.
            loss = loss * self.current_gradient_accumulation_steps * args.world_size
        for name, value in (("policy_loss", loss), ("clipfrac", result.clipfrac), ("kl", result.kl)):
            self.train_stats.add(name, value.item())
        self.health_stats.add("kl", result.kl.item())  # the iteration's own, for its health check
        loss = self.add_router_aux(loss, outputs)  # after dapo's scaling: the aux loss is per micro-batch
        return (loss, outputs) if return_outputs else loss

    # -- health monitors -------------------------------------------------------------

    def reward_weights(self) -> dict[str, float]:
        """{component as logged (reward/<name>_mean): its weight in the reward}: the functions, the reward model."""
        weights = {function.label: function.weight for function in self.rewards}
        if self.model.score_head is not None:
            weights[REWARD_MODEL_LABEL] = 1.0
        return weights

    def plan_health(self) -> HealthPlan:
        signals = ["entropy", "response_length", "truncated_share", "sampler_gap", "distinct_2", "top_answer_share"]
        left_out = {"explained_variance": "no critic"}
        # A reward correlated with length is the sign of a learned reward model being gamed; a program's reward
        # (exact match, a format check) that prefers some lengths computes what it was written to: measured on the
        # demo's healthy exact-match run, where short right answers gave a correlation of 0.88 and a false alarm.
        if self.model.score_head is not None:
            signals.insert(3, "reward_length_corr")
        else:
            left_out["reward_length_corr"] = "no reward model: a program's reward is not gamed by length"
        if self.args.beta > 0:
            signals[:0] = ["kl", "kl_acceleration"]
        else:
            left_out["kl"] = left_out["kl_acceleration"] = "--beta 0: no reference, no KL to it"
        components = self.reward_weights()
        if len(components) > 1:
            signals += [f"reward_share/{name}" for name in components]
        else:
            left_out["reward_share"] = "one reward component: its share is always 1"
        if self.sft_answers is not None:
            signals.append("sft_copy_share")
        else:
            left_out["sft_copy_share"] = "no --sft_answers_file"
        return HealthPlan(signals, left_out, AnswerLimit(self.args.max_completion_length, "--max_completion_length"))

    def health_figures(self, update: dict[str, float]) -> dict[str, float | None]:
        """The rollout's statistics (experience_metrics, answer_figures), the KL per token to the reference (the
        loss's, REINFORCE++'s in the reward) and each reward component's share |weight x mean| / their sum."""
        stats = self.experience_stats
        figures = {name: stats.get(name) for name in ("entropy", "response_length", "reward_length_corr",
                                                      "distinct_2", "top_answer_share", "sft_copy_share")}
        figures["truncated_share"] = stats["clipped_share"]
        figures["sampler_gap"] = stats.get("sampler_gap/kl", update.get("sampler_gap/kl"))
        figures["kl"] = stats.get("reward_kl") if self.kl_in_reward else update.get("kl")
        magnitudes = {name: abs(weight * stats.get(f"reward/{name}_mean", 0.0))
                      for name, weight in self.reward_weights().items()}
        total = sum(magnitudes.values())
        if len(magnitudes) > 1 and total > 0:
            figures.update({f"reward_share/{name}": value / total for name, value in magnitudes.items()})
        return figures

    # -- statistics, evaluation, samples ---------------------------------------------

    def experience_metrics(self, experience: GroupExperience, row_weights: torch.Tensor | None = None,
                           prefix: str = "") -> dict[str, float]:
        """Means over every process's answers (weighted by row_weights, default 1): reward_mean and reward_std,
        reward/<function>_mean and _std (over the answers it applies to), response_length, clipped_share (answers
        cut at the length limit), entropy (per real token), zero_spread_share (groups whose answers all scored the
        same), reward_kl (REINFORCE++ at --beta > 0: the KL to the reference per token, paid in the reward; the loss's
        kl is then 0), trained_token_share (the answer tokens the update trains on: less those dynamic sampling and
        --mask_truncated_completions leave out), sampler_gap/* where the old policy's pass ran (else the update
        measures it) and reward_length_corr (the reward's Pearson correlation with the answer length)."""
        rollout, rewards = experience.rollout, experience.rewards
        weights = torch.ones(len(rewards.scores)) if row_weights is None else row_weights.float().cpu()
        mask = rollout.response_mask.float().cpu()
        stats = SumStats()
        rows = {"reward_mean": rewards.scores, "reward_sq": rewards.scores ** 2, "response_length": mask.sum(-1),
                "clipped_share": (~rollout.has_eos.cpu()).float()}
        for name, values in rewards.per_function.items():
            applies = (~torch.isnan(values)).float() * weights
            stats.add(f"reward/{name}_mean", (torch.nan_to_num(values) * applies).sum().item(), applies.sum().item())
            stats.add(f"reward/{name}_sq", (torch.nan_to_num(values) ** 2 * applies).sum().item(), applies.sum().item())
        for name, values in rows.items():
            stats.add(name, (values * weights).sum().item(), weights.sum().item())
        token_weights = mask * weights[:, None]
        stats.add("entropy", (rollout.entropy.float().cpu() * token_weights).sum().item(), token_weights.sum().item())
        stats.add("zero_spread_share", experience.zero_spread.float().sum().item(), experience.zero_spread.numel())
        if self.kl_in_reward and self.args.beta > 0:  # REINFORCE++: the KL to the reference it pays in the reward
            kl = kl_estimate(experience.old_logprobs, experience.ref_logprobs, self.kl_estimator).float().cpu()
            stats.add("reward_kl", (kl * token_weights).sum().item(), token_weights.sum().item())
        stats.add("trained_token_share", (experience.training_mask.float().cpu() * weights[:, None]).sum().item(),
                  token_weights.sum().item())
        if not experience.old_from_update:  # else the update measures it (RLTrainer.old_logprobs)
            gap = sampler_gap(experience.old_logprobs.cpu(), rollout.logprobs.cpu(), token_weights)
            stats.add("sampler_gap/logprob_abs", gap.logprob_abs, gap.count)
            stats.add("sampler_gap/kl", gap.kl, gap.count)
        add_moments(stats, "length_moments", rewards.scores, mask.sum(-1), weights)
        metrics = stats.reduced(self.args.device)
        for mean in [name for name in metrics if name.endswith("_mean") and name.startswith("reward")]:
            square = metrics.pop(mean[: -len("_mean")] + "_sq")
            metrics[mean[: -len("_mean")] + "_std"] = max(square - metrics[mean] ** 2, 0.0) ** 0.5
        with_figure(metrics, "reward_length_corr", pop_moments(metrics, "length_moments").correlation())
        return {f"{prefix}{name}": value for name, value in metrics.items()}

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """One answer to each held-out prompt, sampled with a fixed seed (two evaluations differ by the policy only),
        scored as training's are: eval_reward_mean, eval_reward/<function>_mean, ..."""
        # Evaluated only with an eval_dataset: the command's are these prompts, read from eval_records.
        assert self.eval_prompts is not None and self.eval_records is not None
        args, count = self.args, len(self.eval_prompts)
        batch = generation_batch_size(args)
        per_rank = -(-count // args.world_size // batch) * batch
        mine = list(range(args.process_index, count, args.world_size))
        indices = mine + [0] * (per_rank - len(mine))  # every process runs as many batches (ZeRO-3's collectives)
        weights = torch.tensor([1.0] * len(mine) + [0.0] * (per_rank - len(mine)))
        experience = self.make_experience(indices, self.eval_prompts, self.eval_records, 1, derived_seed(args.seed, 3),
                                          old_from_update=True, train=False)
        metrics = self.experience_metrics(experience, weights, f"{metric_key_prefix}_")
        metrics.pop(f"{metric_key_prefix}_zero_spread_share")
        metrics.pop(f"{metric_key_prefix}_trained_token_share")
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def log_group(self, iteration: int, experience: GroupExperience, record: "Prompt") -> None:
        """The first prompt of the rollout with its group's answers and rewards."""
        rollout, width = experience.rollout, experience.rollout.prompt_length
        lines = [f"iteration {iteration} sample, {record.where}: {record.messages[-1]['content']}"]
        for row in range(self.args.num_generations):
            answer = self.decoded(rollout.input_ids[row, width:]).strip()
            lines.append(f"  [{experience.rewards.scores[row].item():+.3f}] {answer}")
        logger.info("\n".join(lines))
