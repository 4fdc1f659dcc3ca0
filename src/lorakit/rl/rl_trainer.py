"""What every RL stage's Trainer shares (rl.ppo_trainer's PPO, rl.grpo_trainer's group-relative methods): the
experience as the Trainer's endless "dataloader" (one iteration of micro-batches at a time, ExperienceStream), the
rollout (rl.experience's ExperienceMaker and its engine), the old policy's log-probs from the update itself where a
rollout trains one optimizer step, the sampler-vs-trainer correction, the actor's EMA, the statistics logged with
each step, and checkpoints that resume the iteration stream exactly (rl.ppo_checkpoint). A stage adds its
make_iteration (experience -> micro-batches) and compute_loss."""

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback
from transformers.integrations import is_deepspeed_zero3_enabled

from lorakit.models.router import router_aux_coef, router_aux_term
from lorakit.models.zero3 import gathered
from lorakit.rl.ema import ActorEMA
from lorakit.rl.experience import ExperienceMaker, ExperienceStream, MicroBatch, PhaseTimes, SumStats
from lorakit.rl.ppo_checkpoint import (
    PPOTrainerPrivateOverrides,
    read_ppo_state,
    save_trainable_weights,
    write_ppo_state,
)
from lorakit.rl.ppo_math import FixedKLController, masked_mean, sampler_correction_weights, sampler_gap
from lorakit.trainers.causal_lm import ResumableTrainer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, TrainerControl, TrainerState, TrainingArguments

logger = logging.getLogger(__name__)


class RLStepCallback(TrainerCallback):
    """Times the optimizer steps (generation happens before on_step_begin, while the Trainer
    fetches the step's micro-batches), updates the EMA after each, and saves the roles the
    Trainer does not (PPO's critic, actor_ema) when training ends."""

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


class RLTrainer(PPOTrainerPrivateOverrides, ResumableTrainer):
    """The shared part of the RL stages' Trainers (see the module's docstring). prompts: the train prompts' token
    ids; max_answer_len: the most tokens sampled per answer, max_prompt_len the most prompt tokens (the rollout
    engine sizes its caches by them); answer_end_id: the token that ends an answer (the template's turn end where
    it is not EOS), after_turn_end_ids: the turn's ids after it."""

    stage_name = "RL"

    def __init__(self, *args: Any, prompts: list[list[int]], eval_prompts: list[list[int]] | None,
                 tokenizer: "PreTrainedTokenizerBase", steps_per_iteration: int, max_answer_len: int,
                 max_prompt_len: int | None = None, after_turn_end_ids: Sequence[int] = (),
                 answer_end_id: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The losses are per micro-batch (PPO's means; GRPO's dapo scales its own): the Trainer divides each by the
        # accumulation steps. Pinned, not left to its guess from num_items_in_batch (RL batches have no labels).
        self.loss_is_scaled_for_ga = False
        self.prompts, self.eval_prompts = prompts, eval_prompts
        self.tokenizer = tokenizer
        self.steps_per_iteration = steps_per_iteration
        logger.info("old policy: %s", "each rollout trains one optimizer step, whose own log-probs serve (no pass "
                    "before it)" if steps_per_iteration == 1 else f"each rollout trains {steps_per_iteration} "
                    "optimizer steps: one no-grad pass of the training forward before them")
        self.kl_ctl = FixedKLController(0.0)  # a stage with a KL controller (PPO) replaces it
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.maker = ExperienceMaker(self.model, self.args, pad_id,
                                     tokenizer.eos_token_id if answer_end_id is None else answer_end_id,
                                     after_turn_end_ids, max_answer_len, max_prompt_len,
                                     deepspeed_engine=lambda: self.deepspeed)
        self.stream = ExperienceStream(self.make_iteration)
        self.ema = ActorEMA(self.model, self.args.ema_beta)
        self.train_stats, self.experience_stats = SumStats(), {}
        self.times = PhaseTimes("time_generation", "time_scoring", "time_training")
        self.model.temperature = self.args.temperature
        # A mixture-of-experts actor's loss carries its routers' load-balancing term (the stage's compute_loss).
        self.router_aux_coef = self.model.router_aux_coef = router_aux_coef(self.model.generator())
        self.model.chunked_loss = self.args.chunked_loss
        self.model.group_by_length = not (is_deepspeed_zero3_enabled() and self.args.world_size > 1)
        self.add_callback(RLStepCallback(self.times, self.ema, self.save_roles))

    # -- experience -----------------------------------------------------------

    def get_train_dataloader(self) -> ExperienceStream:
        return self.stream

    def make_iteration(self, iteration: int) -> list[MicroBatch]:
        raise NotImplementedError

    # -- the old policy and the sampler ---------------------------------------

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

    def sampler_weights(self, old_logprobs: torch.Tensor, inputs: MicroBatch) -> torch.Tensor | None:
        """--sampler_correction's per-token weights (logged), or None without it."""
        if not self.args.sampler_correction:
            return None
        mask, cap = inputs["response_mask"], self.args.sampler_correction_cap
        weights = sampler_correction_weights(old_logprobs, inputs["sampler_logprobs"], cap)
        self.train_stats.add("sampler_correction/weight_mean", masked_mean(weights, mask).item())
        self.train_stats.add("sampler_correction/capped_fraction", masked_mean((weights >= cap).float(), mask).item())
        return weights

    def add_router_aux(self, loss: torch.Tensor, outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """loss + router_aux_coef * the actor's router aux loss, where the training pass returned one (a mixture of
        experts); the aux loss is logged as router_aux_loss. Per micro-batch, as the stages' losses are."""
        if "router_aux_loss" not in outputs:
            return loss
        self.train_stats.add("router_aux_loss", outputs["router_aux_loss"].item())
        return loss + router_aux_term(self.router_aux_coef, outputs["router_aux_loss"])

    # -- logging ----------------------------------------------------------------

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs and self.train_stats.sums:
            logs.update(self.train_stats.reduced(self.args.device))
            logs.update(self.experience_stats)
            logs.update(self.times.drained())
            logs["iteration"] = self.stream.iteration
            self.train_stats = SumStats()
        super().log(logs, *args, **kwargs)

    # -- saving and resuming ----------------------------------------------------

    def save_roles(self, directory: str) -> None:
        """actor_ema into directory (collective under ZeRO-3: every rank calls it); a stage adds its other roles."""
        with gathered(p for p in self.model.parameters() if p.requires_grad):
            if self.args.should_save:
                self.ema.save(directory, self.tokenizer)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Only what the stage trains (rl.ppo_checkpoint); in a checkpoint also the iteration state and the EMA."""
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
        """The stage's own resume (iteration counter, KL controller, EMA) and the EMA's start."""
        if resume_from_checkpoint is not None:
            state = read_ppo_state(resume_from_checkpoint, self.steps_per_iteration)
            self.stream.iteration = state["iteration"]
            self.kl_ctl.load_state_dict(state["kl_controller"])
            if self.args.enable_ema:
                self.ema.load(resume_from_checkpoint)
        if self.args.enable_ema:
            self.ema.start()
        logger.info("%s: %d optimizer step(s) per iteration, %d iteration(s) to step %d, starting at iteration %d",
                    self.stage_name, self.steps_per_iteration, math.ceil(max_steps / self.steps_per_iteration),
                    max_steps, self.stream.iteration)
