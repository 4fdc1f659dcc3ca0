"""The PPO stage's Trainer: the clipped PPO update of actor and critic in one module, on
experience made by rl.experience (KL-penalised rewards, GAE), with an adaptive or fixed KL
coefficient and the ptx loss; the rest (the experience stream, the EMA, checkpoints that resume
the iteration stream exactly) is rl.rl_trainer's. DeepSpeed, gradient accumulation and
clipping, logging and the checkpoint schedule stay the Trainer's."""

import logging
import os
from typing import TYPE_CHECKING, Any, cast

import torch

from lorakit.models.zero3 import gathered
from lorakit.rl.alarms import HealthPlan
from lorakit.rl.experience import (
    MicroBatch,
    derived_seed,
    epoch_chunks,
    evaluation_metrics,
    evaluation_prompt_rows,
    iteration_prompt_rows,
    micro_batches,
    training_metrics,
)
from lorakit.rl.health import AnswerLimit
from lorakit.rl.rl_math import make_kl_controller, policy_loss, value_loss
from lorakit.rl.rl_trainer import RLTrainer

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedModel

    from lorakit.rl.experience import ExperienceMaker
    from lorakit.rl.ppo_config import PPOArguments, PPODataArguments
    from lorakit.rl.role_policy import RolePolicy

logger = logging.getLogger(__name__)


class PPOTrainer(RLTrainer):
    """PPO on the Trainer: experience in (an ExperienceStream it owns), clipped policy + value
    (+ ptx) loss out, actor and critic at their own learning rates."""

    stage_name = "PPO"
    args: "PPOArguments"
    maker: "ExperienceMaker[PPOArguments]"  # RLTrainer's, made with these arguments

    def __init__(self, *args: Any, ptx_blocks: "Dataset | None", data_args: "PPODataArguments",
                 **kwargs: Any) -> None:
        super().__init__(*args, max_answer_len=data_args.max_answer_seq_len,
                         max_prompt_len=data_args.max_prompt_seq_len, **kwargs)
        self.ptx_blocks, self.unsup_coef = ptx_blocks, data_args.unsup_coef
        self.kl_ctl = make_kl_controller(self.args.kl_ctl, self.args.target_kl, self.args.kl_horizon)

    # -- experience -----------------------------------------------------------

    def make_iteration(self, iteration: int) -> list[MicroBatch]:
        """One iteration's experience as the Trainer's micro-batches; its statistics are logged with
        the iteration's steps and move the KL controller."""
        args, kl_coef = self.args, self.kl_ctl.value
        rows = iteration_prompt_rows(self.prompts, iteration, args)
        seed = derived_seed(args.seed, iteration, args.process_index, 1)
        experience = self.maker.make(rows, seed, kl_coef, self.times, epoch_chunks(len(rows), iteration, 0, args),
                                     old_from_update=self.steps_per_iteration == 1)
        self.experience_stats = training_metrics(experience, kl_coef, args.device)
        self.experience_stats.update(self.answer_figures(experience.input_ids, experience.prompt_length,
                                                         experience.response_mask, 1))
        self.kl_ctl.update(self.experience_stats["kl"], len(rows) * args.world_size)
        if args.print_answers and iteration % args.print_answers_interval == 0 and args.should_log:
            width, row = experience.prompt_length, experience.input_ids[0]
            logger.info("iteration %d sample\n  prompt: %s\n  answer: %s\n  score: %.4f", iteration,
                        self.decoded(row[:width]).strip(), self.decoded(row[width:]).strip(),
                        experience.scores[0].item())
        return micro_batches(experience, iteration, args, self.ptx_blocks)

    # -- health monitors -------------------------------------------------------

    def plan_health(self) -> HealthPlan:
        left_out = {"reward_share": "one component, the reward model: its share is always 1"}
        signals = ["kl", "kl_acceleration", "entropy", "response_length", "truncated_share", "reward_length_corr",
                   "explained_variance", "sampler_gap", "distinct_2", "top_answer_share"]
        if self.sft_answers is not None:
            signals.append("sft_copy_share")
        else:
            left_out["sft_copy_share"] = ("no --sft_answers_file (the ptx data is pretraining text cut into blocks, "
                                          "not answers to compare with)")
        return HealthPlan(signals, left_out, AnswerLimit(self.maker.max_answer_len, "--max_answer_seq_len"))

    def health_figures(self, update: dict[str, float]) -> dict[str, float | None]:
        """The experience's statistics (training_metrics, answer_figures), the KL per answer token, and the
        sampler gap where the update measured it (one optimizer step per iteration)."""
        stats = self.experience_stats
        figures = {name: stats.get(name) for name in ("entropy", "response_length", "reward_length_corr",
                                                      "explained_variance", "distinct_2", "top_answer_share",
                                                      "sft_copy_share")}
        figures["kl"] = stats["kl"] / stats["response_length"] if stats["response_length"] > 0 else None
        figures["truncated_share"] = 1.0 - stats["eos_fraction"]
        figures["sampler_gap"] = stats.get("sampler_gap/kl", update.get("sampler_gap/kl"))
        return figures

    # -- loss -----------------------------------------------------------------

    def compute_loss(self, model: torch.nn.Module, inputs: MicroBatch, return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None,
                     ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        outputs = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                        prompt_length=inputs["prompt_length"], ptx_input_ids=inputs.get("ptx_input_ids"))
        mask = inputs["response_mask"]
        old_logprobs = self.old_logprobs(outputs["logprobs"], inputs)
        weights = self.sampler_weights(old_logprobs, inputs)
        actor_loss, clipfrac, approx_kl = policy_loss(outputs["logprobs"], old_logprobs,
                                                      inputs["advantages"], mask, self.args.cliprange, weights)
        critic_loss, value_clipfrac = value_loss(outputs["values"], inputs["old_values"], inputs["returns"], mask,
                                                 self.args.cliprange_value)
        # Actor and critic parameters are disjoint: one backward of the sum trains each on its own loss.
        loss = actor_loss + critic_loss
        stats = {"policy_loss": actor_loss, "value_loss": critic_loss, "policy_clipfrac": clipfrac,
                 "value_clipfrac": value_clipfrac, "approx_kl": approx_kl}
        if "ptx_loss" in outputs:
            loss = loss + self.unsup_coef * outputs["ptx_loss"]
            stats["ptx_loss"] = outputs["ptx_loss"]
        for name, value in stats.items():
            self.train_stats.add(name, value.item())
        loss = self.add_router_aux(loss, outputs)
        return (loss, outputs) if return_outputs else loss

    def create_optimizer(self, model: "RolePolicy | None" = None) -> torch.optim.Optimizer:
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
            # transformers annotates a PreTrainedModel; its own create_optimizer passes any nn.Module (only GaLore,
            # APOLLO and LOMO read it, as a module).
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args,
                                                                                cast("PreTrainedModel", opt_model))
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        return self.optimizer

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Answers to the held-out prompts, sampled with a fixed seed (so two evaluations differ by
        the policy only), made and measured exactly as training's experience is."""
        assert self.eval_prompts is not None  # evaluated only with an eval_dataset: the command's are these prompts
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
        super().save_roles(directory)
