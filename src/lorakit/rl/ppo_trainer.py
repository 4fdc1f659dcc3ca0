"""The PPO stage's Trainer: the clipped PPO update of actor and critic in one module, on
experience made by rl.experience, with rl.ema's average of the actor and rl.ppo_checkpoint's
checkpoints that resume the iteration stream exactly. DeepSpeed, gradient accumulation and
clipping, logging and the checkpoint schedule stay the Trainer's."""

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback
from transformers.integrations import is_deepspeed_zero3_enabled

from lorakit.models.zero3 import gathered
from lorakit.rl.ema import ActorEMA
from lorakit.rl.experience import (
    ExperienceMaker,
    ExperienceStream,
    MicroBatch,
    PhaseTimes,
    SumStats,
    derived_seed,
    epoch_chunks,
    evaluation_metrics,
    evaluation_prompt_rows,
    iteration_prompt_rows,
    micro_batches,
    training_metrics,
)
from lorakit.rl.ppo_checkpoint import (
    PPOTrainerPrivateOverrides,
    read_ppo_state,
    save_trainable_weights,
    write_ppo_state,
)
from lorakit.rl.ppo_math import (
    make_kl_controller,
    masked_mean,
    policy_loss,
    sampler_correction_weights,
    sampler_gap,
    value_loss,
)
from lorakit.trainers.causal_lm import ResumableTrainer

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase, TrainerControl, TrainerState, TrainingArguments

    from lorakit.rl.ppo import PPODataArguments

logger = logging.getLogger(__name__)


class PPOStepCallback(TrainerCallback):
    """Times the optimizer steps (generation happens before on_step_begin, while the Trainer
    fetches the step's micro-batches), updates the EMA after each, and saves the roles the
    Trainer does not (critic, actor_ema) when training ends."""

    def __init__(self, times: PhaseTimes, ema: ActorEMA, save_roles: Callable[[str], None]) -> None:
        self.times, self.ema, self.save_roles = times, ema, save_roles
        self.started = None

    def on_step_begin(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl",
                      **kwargs: Any) -> None:
        self.started = time.perf_counter()

    def on_step_end(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl",
                    **kwargs: Any) -> None:
        self.times.add("time_training", time.perf_counter() - self.started)
        self.ema.update()

    def on_train_end(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl",
                     **kwargs: Any) -> None:
        self.save_roles(args.output_dir)


class PPOTrainer(PPOTrainerPrivateOverrides, ResumableTrainer):
    """PPO on the Trainer: experience in (an ExperienceStream it owns), clipped policy + value
    (+ ptx) loss out, actor and critic at their own learning rates."""

    def __init__(self, *args: Any, prompts: list[list[int]], eval_prompts: list[list[int]] | None,
                 ptx_blocks: "Dataset | None", data_args: "PPODataArguments", tokenizer: "PreTrainedTokenizerBase",
                 steps_per_iteration: int, after_turn_end_ids: Sequence[int] = (), answer_end_id: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prompts, self.eval_prompts, self.ptx_blocks = prompts, eval_prompts, ptx_blocks
        self.unsup_coef = data_args.unsup_coef
        self.tokenizer = tokenizer
        self.steps_per_iteration = steps_per_iteration
        logger.info("old policy: %s", "each rollout trains one optimizer step, whose own log-probs serve (no pass "
                    "before it)" if steps_per_iteration == 1 else f"each rollout trains {steps_per_iteration} "
                    "optimizer steps: one no-grad pass of the training forward before them")
        self.kl_ctl = make_kl_controller(self.args.kl_ctl, self.args.target_kl, self.args.kl_horizon)
        # The token that ends an answer: the template's turn-end token (Phi-3's <|end|>, Gemma's
        # <end_of_turn>) where it is not EOS; generation stops on it and scores are read after the
        # turn's remaining ids (after_turn_end_ids).
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.maker = ExperienceMaker(self.model, self.args, pad_id,
                                     tokenizer.eos_token_id if answer_end_id is None else answer_end_id,
                                     after_turn_end_ids, data_args.max_answer_seq_len,
                                     deepspeed_engine=lambda: self.deepspeed)
        self.stream = ExperienceStream(self.make_iteration)
        self.ema = ActorEMA(self.model, self.args.ema_beta)
        self.train_stats, self.experience_stats = SumStats(), {}
        self.times = PhaseTimes("time_generation", "time_scoring", "time_training")
        self.model.temperature = self.args.temperature
        self.model.chunked_loss = self.args.chunked_loss
        self.model.group_by_length = not (is_deepspeed_zero3_enabled() and self.args.world_size > 1)
        self.add_callback(PPOStepCallback(self.times, self.ema, self.save_roles))

    # -- experience -----------------------------------------------------------

    def get_train_dataloader(self) -> ExperienceStream:
        return self.stream

    def make_iteration(self, iteration: int) -> list[MicroBatch]:
        """One iteration's experience as the Trainer's micro-batches; its statistics are logged with
        the iteration's steps and move the KL controller."""
        args, kl_coef = self.args, self.kl_ctl.value
        rows = iteration_prompt_rows(self.prompts, iteration, args)
        seed = derived_seed(args.seed, iteration, args.process_index, 1)
        experience = self.maker.make(rows, seed, kl_coef, self.times, epoch_chunks(len(rows), iteration, 0, args),
                                     old_from_update=self.steps_per_iteration == 1)
        self.experience_stats = training_metrics(experience, kl_coef, args.device)
        self.kl_ctl.update(self.experience_stats["kl"], len(rows) * args.world_size)
        if args.print_answers and iteration % args.print_answers_interval == 0 and args.should_log:
            width, row = experience.prompt_length, experience.input_ids[0]
            logger.info("iteration %d sample\n  prompt: %s\n  answer: %s\n  score: %.4f", iteration,
                        self.tokenizer.decode(row[:width], skip_special_tokens=True).strip(),
                        self.tokenizer.decode(row[width:], skip_special_tokens=True).strip(),
                        experience.scores[0].item())
        return micro_batches(experience, iteration, args, self.ptx_blocks)

    # -- loss -----------------------------------------------------------------

    def compute_loss(self, model: torch.nn.Module, inputs: MicroBatch, return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None,
                     ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                        prompt_length=inputs["prompt_length"], ptx_input_ids=inputs.get("ptx_input_ids"))
        mask, weights, stats = inputs["response_mask"], None, {}
        old_logprobs = self.old_logprobs(outputs["logprobs"], inputs)
        if self.args.sampler_correction:
            weights = sampler_correction_weights(old_logprobs, inputs["sampler_logprobs"],
                                                 self.args.sampler_correction_cap)
            stats = {"sampler_correction/weight_mean": masked_mean(weights, mask),
                     "sampler_correction/capped_fraction": masked_mean(
                         (weights >= self.args.sampler_correction_cap).float(), mask)}
        actor_loss, clipfrac, approx_kl = policy_loss(outputs["logprobs"], old_logprobs,
                                                      inputs["advantages"], mask, self.args.cliprange, weights)
        critic_loss, value_clipfrac = value_loss(outputs["values"], inputs["old_values"], inputs["returns"], mask,
                                                 self.args.cliprange_value)
        # Actor and critic parameters are disjoint: one backward of the sum trains each on its own loss.
        loss = actor_loss + critic_loss
        stats.update({"policy_loss": actor_loss, "value_loss": critic_loss, "policy_clipfrac": clipfrac,
                      "value_clipfrac": value_clipfrac, "approx_kl": approx_kl})
        if "ptx_loss" in outputs:
            loss = loss + self.unsup_coef * outputs["ptx_loss"]
            stats["ptx_loss"] = outputs["ptx_loss"]
        for name, value in stats.items():
            self.train_stats.add(name, value.item())
        return (loss, outputs) if return_outputs else loss

    def old_logprobs(self, logprobs: torch.Tensor, inputs: MicroBatch) -> torch.Tensor:
        """The old policy's log-probs for this micro-batch: the experience's, or, where the rollout trains this one
        optimizer step only (old_from_update), this forward's own, detached (the weights have not moved since the
        rollout: TRL's shortcut, one no-grad pass fewer), with the sampler gap measured here."""
        if not inputs["old_from_update"]:
            return inputs["old_logprobs"]
        old_logprobs = logprobs.detach()
        gap = sampler_gap(old_logprobs, inputs["sampler_logprobs"], inputs["response_mask"])
        self.train_stats.add("sampler_gap/logprob_abs", gap.logprob_abs, gap.count)
        self.train_stats.add("sampler_gap/kl", gap.kl, gap.count)
        return old_logprobs

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer with actor and critic in their own parameter groups: two learning
        rates (the scheduler scales both alike)."""
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            decay = set(self.get_decay_parameter_names(opt_model))
            groups = []
            for is_critic, lr in ((False, self.args.actor_learning_rate), (True, self.args.critic_learning_rate)):
                for decays in (True, False):
                    params = [p for n, p in opt_model.named_parameters() if p.requires_grad
                              and opt_model.is_critic_parameter(n) == is_critic and (n in decay) == decays]
                    if params:
                        groups.append({"params": params, "lr": lr,
                                       "weight_decay": self.args.weight_decay if decays else 0.0})
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    # -- evaluation and logging -----------------------------------------------

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs and self.train_stats.sums:
            logs.update(self.train_stats.reduced(self.args.device))
            logs.update(self.experience_stats)
            logs.update(self.times.drained())
            logs["iteration"] = self.stream.iteration
            self.train_stats = SumStats()
        super().log(logs, *args, **kwargs)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Answers to the held-out prompts, sampled with a fixed seed (so two evaluations differ by
        the policy only), made and measured exactly as training's experience is."""
        rows, weights = evaluation_prompt_rows(self.eval_prompts, self.args)
        experience = self.maker.make(rows, derived_seed(self.args.seed, 3), self.kl_ctl.value)
        metrics = evaluation_metrics(experience, weights, self.args.device, metric_key_prefix)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # -- saving and resuming ----------------------------------------------------

    def save_roles(self, directory: str) -> None:
        """actor_ema and critic into directory (collective under ZeRO-3: every rank calls it)."""
        with gathered(p for p in self.model.parameters() if p.requires_grad):
            if self.args.should_save:
                self.model.save_critic(os.path.join(directory, "critic"))
                self.tokenizer.save_pretrained(os.path.join(directory, "critic"))
                self.ema.save(directory, self.tokenizer)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Only what PPO trains (rl.ppo_checkpoint); in a checkpoint also the PPO state and the EMA."""
        output_dir = output_dir or self.args.output_dir
        save_trainable_weights(self.model, output_dir, self.args.should_save)
        if not self.args.should_save:
            return
        if _internal_call:
            write_ppo_state(output_dir, self.stream.iteration, self.steps_per_iteration, self.kl_ctl, self.args.seed)
            self.ema.save(output_dir, self.tokenizer)
        else:
            self.tokenizer.save_pretrained(output_dir)

    def after_prepare(self, max_steps: int, resume_from_checkpoint: str | None) -> None:
        """PPO's own resume (iteration counter, KL controller, EMA) and the EMA's start."""
        if resume_from_checkpoint is not None:
            state = read_ppo_state(resume_from_checkpoint, self.steps_per_iteration)
            self.stream.iteration = state["iteration"]
            self.kl_ctl.load_state_dict(state["kl_controller"])
            if self.args.enable_ema:
                self.ema.load(resume_from_checkpoint)
        if self.args.enable_ema:
            self.ema.start()
        logger.info("PPO: %d optimizer step(s) per iteration, %d iteration(s) to step %d, starting at iteration %d",
                    self.steps_per_iteration, math.ceil(max_steps / self.steps_per_iteration), max_steps,
                    self.stream.iteration)
