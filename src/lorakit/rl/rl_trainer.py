"""What every RL stage's Trainer shares (rl.ppo_trainer's PPO, rl.grpo_trainer's group-relative methods): the
experience as the Trainer's endless "dataloader" (one iteration of micro-batches at a time, ExperienceStream), the
rollout (rl.experience's ExperienceMaker and its engine), the old policy's log-probs from the update itself where a
rollout trains one optimizer step, the sampler-vs-trainer correction, the actor's EMA, the statistics logged with
each step, the health monitors that judge each iteration (rl.health; what an alarm does: rl.alarms), and
checkpoints that resume the iteration stream exactly (rl.rl_checkpoint). A stage adds its make_iteration
(experience -> micro-batches), compute_loss, and its health signals (plan_health, health_figures)."""

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.integrations import is_deepspeed_zero3_enabled

from lorakit.models.router import router_aux_coef, router_aux_term
from lorakit.models.zero3 import gathered
from lorakit.rl.alarms import (
    HealthCallback,
    HealthPlan,
    alarm_logs,
    ended_under_alarm_note,
    last_alarm_free_checkpoint,
    load_health_state,
    publish_from_checkpoint,
    report_iteration,
    save_health_state,
    stop_message,
    write_alarm_file,
)
from lorakit.rl.ema import EMA_DIR_NAME, ActorEMA
from lorakit.rl.experience import ExperienceMaker, ExperienceStream, MicroBatch, PhaseTimes, SumStats
from lorakit.rl.health import Alarm, HealthMonitor, StoppedByAlarm, answer_diversity, normalized_answer
from lorakit.rl.rl_checkpoint import (
    RLTrainerPrivateOverrides,
    read_rl_state,
    save_trainable_weights,
    write_rl_state,
)
from lorakit.rl.rl_math import FixedKLController, KLController, masked_mean, sampler_correction_weights, sampler_gap
from lorakit.trainers.causal_lm import ResumableTrainer
from lorakit.trainers.checkpoints import SavePeftModelCallback, barrier, output_dir_of, rank_zero_decides

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_utils import TrainOutput

    from lorakit.rl.role_policy import RolePolicy
    from lorakit.rl.rollout_arguments import RolloutArguments

logger = logging.getLogger(__name__)


class RLStepCallback(TrainerCallback):
    """Times the optimizer steps (generation happens before on_step_begin, while the Trainer
    fetches the step's micro-batches), updates the EMA after each, and saves the roles the
    Trainer does not (PPO's critic, actor_ema) when training ends."""

    def __init__(self, times: PhaseTimes, ema: ActorEMA, save_roles: Callable[[str], None]) -> None:
        self.times, self.ema, self.save_roles = times, ema, save_roles
        self.started: float | None = None

    def on_step_begin(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl",
                      **kwargs: Any) -> None:
        self.started = time.perf_counter()

    def on_step_end(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl",
                    **kwargs: Any) -> None:
        assert self.started is not None  # the Trainer begins each step before it ends it
        self.times.add("time_training", time.perf_counter() - self.started)
        self.ema.update()

    def on_train_end(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl",
                     **kwargs: Any) -> None:
        self.save_roles(output_dir_of(args))


class RLTrainer(RLTrainerPrivateOverrides, ResumableTrainer):
    """The shared part of the RL stages' Trainers (see the module's docstring). prompts: the train prompts' token
    ids; max_answer_len: the most tokens sampled per answer, max_prompt_len the most prompt tokens (the rollout
    engine sizes its caches by them); answer_end_id: the token that ends an answer (the template's turn end where
    it is not EOS), after_turn_end_ids: the turn's ids after it."""

    stage_name = "RL"
    # Narrower than ResumableTrainer's: every RL stage's arguments are RolloutArguments, its model a RolePolicy.
    args: "RolloutArguments"
    model: "RolePolicy"
    # The experience's statistics of the iteration being trained (make_iteration), logged with its steps.
    experience_stats: dict[str, float]

    def __init__(self, *args: Any, prompts: list[list[int]], eval_prompts: list[list[int]] | None,
                 tokenizer: "PreTrainedTokenizerBase", steps_per_iteration: int, max_answer_len: int,
                 max_prompt_len: int | None = None, after_turn_end_ids: Sequence[int] = (),
                 answer_end_id: int | None = None, sft_answers: frozenset[str] | None = None, **kwargs: Any) -> None:
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
        self.kl_ctl: KLController = FixedKLController(0.0)  # a stage with a KL controller (PPO) replaces it
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
        self.add_callback(RLStepCallback(self.times, self.ema, self.save_final_roles))
        # The health monitors (rl.health, rl.alarms) start with training (start_health): which signals a stage has
        # depends on what its own __init__ sets up after this one.
        self.sft_answers, self.health_stats = sft_answers, SumStats()
        self.health, self.health_plan = HealthMonitor([]), HealthPlan([], {})
        self.health_callback: HealthCallback | None = None

    # -- experience -----------------------------------------------------------

    # The Trainer iterates whatever this returns (with no __len__ it runs by --max_steps); it annotates a DataLoader.
    def get_train_dataloader(self) -> ExperienceStream:  # type: ignore[override]
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
        self.health_stats.add("sampler_gap/kl", gap.kl, gap.count)  # the iteration's own, for its health check
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
            logs.update(alarm_logs(self.health))
            logs["iteration"] = self.stream.iteration
            self.train_stats = SumStats()
        super().log(logs, *args, **kwargs)

    def decoded(self, ids: torch.Tensor) -> str:
        """The text of one row of token ids, special tokens skipped (the logged samples)."""
        # One row decodes to one string; transformers types decode for a batch of rows too (str | list[str]).
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))

    # -- health monitors ----------------------------------------------------------

    def plan_health(self) -> HealthPlan:
        """The signals this stage monitors, and why it has none of the others."""
        raise NotImplementedError

    def health_figures(self, update: dict[str, float]) -> dict[str, float | None]:
        """The figures of the iteration just trained, by signal, from its experience statistics and update
        (update: what its optimizer steps measured, reduced over every process)."""
        raise NotImplementedError

    def answer_figures(self, input_ids: torch.Tensor, prompt_length: int, response_mask: torch.Tensor,
                       group_size: int) -> dict[str, float]:
        """The rollout's answer diversity over every process's answers (gathered; answers in groups of group_size to
        one prompt): distinct_2, top_answer_share and, with --sft_answers_file, sft_copy_share (the share of answers
        equal to an SFT answer, whitespace aside)."""
        answers = input_ids[:, prompt_length:].cpu()
        mask = response_mask.bool().cpu()
        ids = [answers[row][mask[row]].tolist() for row in range(answers.shape[0])]
        gathered_ids = ids
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            parts: list[list[list[int]]] = [[] for _ in range(dist.get_world_size())]  # all_gather_object fills it
            dist.all_gather_object(parts, ids)
            gathered_ids = [answer for part in parts for answer in part]
        figures = {name: value for name, value in answer_diversity(gathered_ids, group_size)._asdict().items()
                   if value is not None}
        if self.sft_answers is not None:
            copies = SumStats()
            texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
            copies.add("sft_copy_share", sum(normalized_answer(text) in self.sft_answers for text in texts), len(texts))
            figures.update(copies.reduced(self.args.device))
        return figures

    def start_health(self) -> None:
        """The stage's monitor and the callback that judges each iteration with it (rl.alarms.HealthCallback)."""
        self.health_plan = self.plan_health()
        self.health = HealthMonitor(self.health_plan.signals, self.health_plan.answer_limit)
        self.health_callback = HealthCallback(self.check_health, self.health, self.steps_per_iteration,
                                              self.args.stop_on_alarm, self.args.publish_on_alarm)
        self.add_callback(self.health_callback)
        if self.args.should_log:
            logger.info(self.health_plan.describe(self.stage_name))

    def check_health(self, step: int) -> list[Alarm]:
        """Judge the iteration just trained: its figures reduced over every process, then rank 0's monitor decides
        and every process takes its verdict (a broadcast: no process saves or stops while another goes on). Each
        new alarm is a warning line, each signal a completed baseline leaves unable to alarm is named in one line,
        and both go to the alarm file at once (rl.alarms.report_iteration)."""
        update = self.health_stats.reduced(self.args.device) if self.health_stats.sums else {}
        self.health_stats = SumStats()
        figures = self.health_figures(update)
        iteration = self.stream.iteration - 1
        not_judged_before = self.health.not_judged()
        alarms = rank_zero_decides(lambda: self.health.observe(step, iteration, figures))
        if self.args.process_index != 0:
            self.health.record(alarms)
        else:
            report_iteration(output_dir_of(self.args), self.stage_name, self.health_plan, self.health, alarms,
                             not_judged_before)
        return alarms

    def adapter_dir_name(self) -> str:
        """The published adapter's directory name (the stage's SavePeftModelCallback's)."""
        return next(callback.adapter_dir_name for callback in self.callback_handler.callbacks
                    if isinstance(callback, SavePeftModelCallback))

    def end_health(self) -> None:
        """Once training ended: with an alarm active, the adapter (and actor_ema) published are the last checkpoint's,
        saved with none (or nothing is published), unless --publish_on_alarm keeps the end of training's; the alarm
        file gets the ending; a run --stop_on_alarm ended raises StoppedByAlarm (exit status 4) once its state is
        saved."""
        adapter, checkpoint, published = self.adapter_dir_name(), None, None
        output_dir = output_dir_of(self.args)
        through = bool(self.health.active) and self.args.publish_on_alarm
        callback = self.started_health_callback()
        if callback.holds_saving():
            checkpoint = last_alarm_free_checkpoint(output_dir, self.state.global_step)
            if self.args.should_save:
                names = [adapter] + ([EMA_DIR_NAME] if self.args.enable_ema else [])
                publish_from_checkpoint(output_dir, checkpoint, names)
            published = checkpoint and os.path.join(os.path.basename(checkpoint), adapter)
        stopped = callback.stopped
        if self.args.process_index == 0:
            ending = {"step": self.state.global_step, "stopped": stopped, "alarm_active": bool(self.health.active),
                      "published_from": published, "published_through_alarm": through}
            write_alarm_file(output_dir, self.stage_name, self.health_plan, self.health, ending)
            if self.health.active and not stopped:
                logger.warning("training ended with a health alarm active: %s",
                               ended_under_alarm_note(adapter, checkpoint, through))
        if stopped:
            self.save_state()
        barrier()  # the files are in place before any process leaves (a launcher stops the rest when one exits)
        if stopped:
            raise StoppedByAlarm(stop_message(self.health.active, adapter, checkpoint, output_dir))

    def started_health_callback(self) -> HealthCallback:
        """The callback start_health installed: train() starts the health monitors before the first step."""
        assert self.health_callback is not None, "start_health() runs first (RLTrainer.train)"
        return self.health_callback

    def train(self, *args: Any, **kwargs: Any) -> "TrainOutput":
        self.start_health()
        output = super().train(*args, **kwargs)
        self.end_health()
        return output

    # -- saving and resuming ----------------------------------------------------

    def save_final_roles(self, directory: str) -> None:
        """The roles at the end of training, unless an alarm holds saving (end_health publishes the checkpoint's)."""
        if self.started_health_callback().holds_saving():
            logger.info("the roles trained while a health alarm is active are not saved to %s", directory)
            return
        self.save_roles(directory)

    def save_roles(self, directory: str) -> None:
        """actor_ema into directory (collective under ZeRO-3: every rank calls it); a stage adds its other roles."""
        with gathered(p for p in self.model.parameters() if p.requires_grad):
            if self.args.should_save:
                self.ema.save(directory, self.tokenizer)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Only what the stage trains (rl.rl_checkpoint); in a checkpoint also the iteration state and the EMA."""
        output_dir = output_dir or output_dir_of(self.args)
        save_trainable_weights(self.model, output_dir, self.args.should_save)
        if not self.args.should_save:
            return
        if _internal_call:
            write_rl_state(output_dir, self.stream.iteration, self.steps_per_iteration, self.kl_ctl, self.args.seed)
            save_health_state(output_dir, self.health)
            self.ema.save(output_dir, self.tokenizer)
        else:
            self.tokenizer.save_pretrained(output_dir)

    def after_prepare(self, max_steps: int, resume_from_checkpoint: str | None) -> None:
        """The stage's own resume (iteration counter, KL controller, EMA) and the EMA's start."""
        if resume_from_checkpoint is not None:
            state = read_rl_state(resume_from_checkpoint, self.steps_per_iteration)
            self.stream.iteration = state["iteration"]
            self.kl_ctl.load_state_dict(state["kl_controller"])
            load_health_state(resume_from_checkpoint, self.health)
            if self.args.enable_ema:
                self.ema.load(resume_from_checkpoint)
        if self.args.enable_ema:
            self.ema.start()
        logger.info("%s: %d optimizer step(s) per iteration, %d iteration(s) to step %d, starting at iteration %d",
                    self.stage_name, self.steps_per_iteration, math.ceil(max_steps / self.steps_per_iteration),
                    max_steps, self.stream.iteration)
