#!/usr/bin/env python
"""Group-relative RL with LoRA: GRPO (with Dr. GRPO's and DAPO's losses), RLOO and REINFORCE++, rewarded by
programs (`--reward_funcs`), a learned reward model (`--reward_lora_model`), or both.

    torchrun --nproc_per_node 8 scripts/training/run_grpo.py \
        --model_name_or_path BASE --peft_path SFT_OUT/sft_lora_model \
        --dataset_dir PROMPTS --reward_funcs exact_match --num_generations 8 --max_completion_length 256 \
        --per_device_train_batch_size 8 --gradient_accumulation_steps 4 --beta 0 \
        --output_dir OUT --max_steps 500 --deepspeed ds_configs/ds_zero2_no_offload.json ...

Flags take TRL's names (GRPOConfig), which users of this method bring; PPO's names are accepted as mapped aliases
with a log line (--kl_ctl -> --beta, --cliprange -> --epsilon, --ppo_epochs -> --num_iterations,
--max_answer_seq_len -> --max_completion_length, --actor_model_name_or_path / --actor_lora_model -> --model_name_or_path
/ --peft_path).

Each iteration (one rollout), every process takes per_device_train_batch_size x gradient_accumulation_steps /
num_generations prompts of its own stretch of the prompt stream, samples num_generations answers to each with the
current actor (rl.rollout's engine; the group of a prompt stays on its process), scores them (rl.reward_functions'
weighted sum, plus the reward model's score), turns the scores into advantages (rl.group_math: --advantage_estimator)
and trains --num_iterations optimizer steps on them (each of gradient_accumulation_steps micro-batches of
per_device_train_batch_size answers), as TRL's GRPOTrainer does with its default steps_per_generation.

Roles: the actor (the base with a LoRA adapter: new, or continuing --peft_path); the reference, only when --beta > 0
(the base with the adapter disabled, or a frozen copy of --peft_path); the reward model, only with
--reward_lora_model (an adapter of run_reward.py on the same base). No critic. Writes OUT/grpo_lora_model (actor
adapter + tokenizer), OUT/actor_ema (--enable_ema) and resumable OUT/checkpoint-N.

This module holds the arguments and the checks on the inputs; the Trainer is rl.grpo_trainer, the math
rl.group_math, the rewards rl.reward_functions.
"""

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from transformers import set_seed

from lorakit.core.cli import InputError, parse_args, run_cli
from lorakit.data.build_dataset import ConversationDataArguments
from lorakit.data.cache import cache_key
from lorakit.data.conversation_tokenizer import ConversationTokenizer
from lorakit.data.prompts import build_prompt_sets
from lorakit.data.run_record import note_data
from lorakit.models.arguments import FlagTable, MappedFlag, ModelArguments, map_flags
from lorakit.models.loader import check_load_plan, check_model_inputs, choose_pad_token
from lorakit.records.chat_templates import parse_template_kwargs, use_template
from lorakit.rl.group_math import (
    ADVANTAGE_ESTIMATORS,
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    LOSS_TYPES,
    SCALE_REWARDS,
)
from lorakit.rl.group_policy import load_group_policy
from lorakit.rl.health import read_sft_answers
from lorakit.rl.ppo import check_reward_source, check_same_tokenizer, config_of, same_directory, tokenizer_of
from lorakit.rl.reward_functions import check_record_fields, load_reward_functions
from lorakit.rl.rollout_arguments import RolloutArguments, check_save_steps
from lorakit.trainers.checkpoints import SavePeftModelCallback
from lorakit.trainers.common import check_held_out_data, resolve_resume_checkpoint, setup_logging, train_and_finish

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- arguments


@dataclass
class GRPOModelArguments(ModelArguments):
    """The shared model arguments (dtype, --load_in_kbits for QLoRA, LoRA shape, ...) with the actor's base in
    --model_name_or_path and its SFT adapter in --peft_path, plus an optional reward adapter on the same base."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "The actor's base model (or a merged SFT model). Required."})
    lora_dropout: float = field(
        default=0.0,
        metadata={"help": "Dropout on the LoRA input. 0: answers are scored without dropout, so any dropout in the "
                          "update adds noise to the importance ratio."},
    )
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "The reward model's base: the actor's (--model_name_or_path), if given."})
    reward_lora_model: str | None = field(
        default=None, metadata={"help": "A reward adapter (rm_lora_model of run_reward.py) on the actor's base: its "
                                        "score is added to the reward functions' (weight 1)."})
    actor_model_name_or_path: str | None = field(default=None, metadata={"help": "PPO's name of --model_name_or_path."})
    actor_lora_model: str | None = field(default=None, metadata={"help": "PPO's name of --peft_path."})

    def __post_init__(self) -> None:
        super().__post_init__()
        map_flags(self, GRPO_MODEL_FLAGS, self.mapped_flags)
        if self.model_name_or_path is None:
            raise InputError("--model_name_or_path is required (the actor's base)")
        if self.full_finetuning:
            raise InputError("--full_finetuning: GRPO trains a LoRA adapter on a frozen base")


GRPO_MODEL_FLAGS: FlagTable = {
    "actor_model_name_or_path": lambda path: MappedFlag("model_name_or_path", path),
    "actor_lora_model": lambda path: MappedFlag("peft_path", path),
}


@dataclass
class GRPODataArguments(ConversationDataArguments):
    data_phase: int = field(default=3, metadata={"help": "Which part of --data_split this stage takes (3 = RL)."})
    max_prompt_seq_len: int = field(default=256, metadata={"help": "Prompt tokens; longer prompts lose their start."})
    max_prompt_length: int | None = field(default=None, metadata={"help": "TRL's name of --max_prompt_seq_len."})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mapped_flags = []
        map_flags(self, {"max_prompt_length": lambda length: MappedFlag("max_prompt_seq_len", length)},
                  self.mapped_flags)


def choices(names: tuple[str, ...]) -> list[str]:
    return list(names)


@dataclass
class GRPOArguments(RolloutArguments):
    """TrainingArguments plus the group-relative methods' flags, named as TRL's GRPOConfig names them."""

    num_generations: int = field(default=8, metadata={"help": "Answers sampled per prompt (the group)."})
    max_completion_length: int = field(default=256, metadata={"help": "Most tokens generated per answer."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient to the reference; 0: no reference pass."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range of the importance ratio."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clip range (DAPO's clip-higher, e.g. 0.28); default --epsilon."})
    num_iterations: int = field(default=1, metadata={"help": "Optimizer steps (updates) per rollout."})
    loss_type: str = field(
        default="dapo", metadata={"help": "grpo: each answer's token mean, averaged; dr_grpo: token sum over "
                                          "answers x --max_completion_length; dapo: token mean over the optimizer "
                                          "step's global batch.", "choices": choices(LOSS_TYPES)})
    scale_rewards: str = field(
        default="group", metadata={"help": "GRPO's advantage divides by the std of the group, of the batch, or "
                                           "none (Dr. GRPO).", "choices": choices(SCALE_REWARDS)})
    advantage_estimator: str = field(
        default="grpo", metadata={"help": "grpo, rloo (leave-one-out), reinforce_pp (REINFORCE++: KL in the reward, "
                                          "global normalisation), reinforce_pp_baseline (group-mean baseline first).",
                                  "choices": choices(ADVANTAGE_ESTIMATORS)})
    kl_estimator: str | None = field(
        default=None, metadata={"help": "k1, k2 or k3; default k3 in the loss (GRPO, RLOO), k1 in the reward "
                                        "(REINFORCE++).", "choices": choices(KL_ESTIMATORS)})
    importance_sampling_level: str = field(
        default="token", metadata={"help": "token, or sequence (GSPO's ratio of the answer's mean log-ratio).",
                                   "choices": choices(IMPORTANCE_SAMPLING_LEVELS)})
    dynamic_sampling: bool = field(
        default=False, metadata={"help": "DAPO's dynamic sampling: groups whose answers all scored the same are "
                                         "left out of the update (their share is always logged)."})
    mask_truncated_completions: bool = field(
        default=False, metadata={"help": "Leave answers cut at --max_completion_length out of the update (they are "
                                         "scored and count in their group's statistics; TRL's option)."})
    reward_funcs: list[str] = field(
        default_factory=list, metadata={"help": "Reward functions: built-ins (exact_match, think_format, overlong) "
                                                "or module:function / path.py:function, called as TRL calls them."})
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per --reward_funcs entry (default 1 each)."})
    overlong_buffer: int | None = field(
        default=None, metadata={"help": "The overlong reward's soft zone in tokens (default a quarter of "
                                        "--max_completion_length)."})
    log_completions: int = field(
        default=0, metadata={"help": "Log a prompt, its answers and their rewards every this many iterations."})
    per_device_generation_batch_size: int | None = field(
        default=None, metadata={"help": "Answers per generate() call per process (default "
                                        "--per_device_train_batch_size)."})
    kl_ctl: float | None = field(default=None, metadata={"help": "PPO's name of --beta."})
    cliprange: float | None = field(default=None, metadata={"help": "PPO's name of --epsilon."})
    ppo_epochs: int | None = field(default=None, metadata={"help": "PPO's name of --num_iterations."})
    max_answer_seq_len: int | None = field(default=None, metadata={"help": "PPO's name of --max_completion_length."})

    def __post_init__(self) -> None:
        notes = []
        map_flags(self, GRPO_TRAINER_FLAGS, notes)
        for flag in ("max_completion_length", "num_iterations"):
            if getattr(self, flag) < 1:
                raise InputError(f"--{flag} must be at least 1, got {getattr(self, flag)}")
        if self.beta < 0 or not math.isfinite(self.beta):
            raise InputError(f"--beta {self.beta}: give a KL coefficient of 0 or more")
        if self.num_generations < 2:
            raise InputError(f"--num_generations {self.num_generations}: a group needs at least 2 answers to compare")
        kl_in_reward = self.advantage_estimator.startswith("reinforce_pp")
        if self.kl_estimator is None:
            self.kl_estimator = "k1" if kl_in_reward else "k3"
        if self.kl_estimator == "k1" and self.beta > 0 and not kl_in_reward:
            raise InputError("--kl_estimator k1 in the loss: its gradient is not a KL penalty (its expectation is 0); "
                             "use k3 (GRPO's) or k2, or REINFORCE++, which pays k1 in the reward")
        if self.dynamic_sampling and kl_in_reward:
            raise InputError(f"--dynamic_sampling with --advantage_estimator {self.advantage_estimator}: REINFORCE++ "
                             "has no group baseline, a group whose answers scored alike still teaches; use grpo or "
                             "rloo")
        if self.per_device_generation_batch_size is None:
            self.per_device_generation_batch_size = self.per_device_train_batch_size
        # The rollout's names (rl.experience): micro-batches of the old policy's pass, one sampling pass per rollout.
        self.per_device_training_batch_size, self.generation_batches = self.per_device_train_batch_size, 1
        super().__post_init__()
        self.mapped_flags[:0] = notes


GRPO_TRAINER_FLAGS: FlagTable = {
    "kl_ctl": lambda value: MappedFlag("beta", value),
    "cliprange": lambda value: MappedFlag("epsilon", value),
    "ppo_epochs": lambda value: MappedFlag("num_iterations", value),
    "max_answer_seq_len": lambda value: MappedFlag("max_completion_length", value),
}


# ----------------------------------------------------------------------------- checks


class GroupSchedule:
    """One rollout's shape per process: its prompts, its answers (prompts x num_generations), and the optimizer
    steps it trains (num_iterations, each of gradient_accumulation_steps micro-batches)."""

    def __init__(self, training_args: GRPOArguments) -> None:
        answers = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
        if answers % training_args.num_generations:
            raise InputError(f"--per_device_train_batch_size {training_args.per_device_train_batch_size} x "
                             f"--gradient_accumulation_steps {training_args.gradient_accumulation_steps} = {answers} "
                             f"answers per process per rollout is not a multiple of --num_generations "
                             f"{training_args.num_generations}: each prompt's group must stay whole on its process")
        self.prompts, self.answers = answers // training_args.num_generations, answers
        self.steps = training_args.num_iterations


class ActorFiles(NamedTuple):
    """What check_grpo_models read of the actor: its tokenizer and its model config."""

    tokenizer: "PreTrainedTokenizerBase"
    config: "PreTrainedConfig"


def check_grpo_models(model_args: GRPOModelArguments, data_args: GRPODataArguments, training_args: GRPOArguments
                      ) -> ActorFiles:
    """The actor's tokenizer and config, after refusing, before any weight is loaded, what would train wrong: no
    reward at all, a reward model not on the actor's base, a reward adapter without a score head, lengths past the
    model's positions."""
    if not training_args.reward_funcs and not model_args.reward_lora_model:
        raise InputError("no reward: give --reward_funcs (e.g. exact_match) and/or --reward_lora_model")
    trust = model_args.trust_remote_code
    config = config_of(model_args.model_name_or_path, trust)
    tokenizer = tokenizer_of(model_args.model_name_or_path, model_args.peft_path, trust)
    if model_args.tokenizer_name_or_path:
        tokenizer = tokenizer_of(model_args.tokenizer_name_or_path, None, trust)
    check_model_inputs(model_args, config, tokenizer, adapter_flag="--peft_path")
    if model_args.reward_lora_model:
        base = model_args.reward_model_name_or_path or model_args.model_name_or_path
        if not same_directory(base, model_args.model_name_or_path):
            raise InputError(f"--reward_model_name_or_path {base}: the reward model must be an adapter on the actor's "
                             "base (--reward_model_name_or_path = --model_name_or_path)")
        check_reward_source(base, model_args.reward_lora_model, "--reward_model_name_or_path")
        check_same_tokenizer(tokenizer, tokenizer_of(base, model_args.reward_lora_model, trust), "reward",
                             model_args.reward_lora_model)
    total = data_args.max_prompt_seq_len + training_args.max_completion_length
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and total > positions:
        raise InputError(f"--max_prompt_seq_len {data_args.max_prompt_seq_len} + --max_completion_length "
                         f"{training_args.max_completion_length} = {total} exceeds the model's max_position_embeddings "
                         f"{positions} (config.json)")
    check_load_plan(model_args, training_args, config, tokenizer, adapter_flag="--peft_path")
    return ActorFiles(tokenizer, config)


def check_save_schedule(training_args: GRPOArguments, steps_per_iteration: int, num_prompts: int,
                        prompts_per_rollout: int) -> None:
    """--max_steps from epochs over the prompts when not given; a checkpoint inside a rollout's steps refused."""
    if training_args.max_steps <= 0:
        rollouts = math.ceil(training_args.num_train_epochs * num_prompts
                             / (prompts_per_rollout * training_args.world_size))
        training_args.max_steps = max(1, rollouts) * steps_per_iteration
    check_save_steps(training_args, steps_per_iteration, "rollout (--num_iterations)")


# ----------------------------------------------------------------------------- main


ARGUMENT_CLASSES = (GRPOModelArguments, GRPODataArguments, GRPOArguments)


def main() -> None:
    from lorakit.rl.grpo_trainer import GRPOTrainer

    model_args, data_args, training_args = parse_args(ARGUMENT_CLASSES)
    training_args.mapped_flags += model_args.mapped_flags + data_args.mapped_flags
    setup_logging(training_args)
    check_held_out_data(data_args, training_args, "prompts")
    schedule = GroupSchedule(training_args)
    rewards = load_reward_functions(training_args.reward_funcs, training_args.reward_weights,
                                    training_args.max_completion_length, training_args.overlong_buffer)
    resume_checkpoint = resolve_resume_checkpoint(training_args, model_args, data_args)
    tokenizer, config = check_grpo_models(model_args, data_args, training_args)
    sft_answers = read_sft_answers(training_args.sft_answers_file)
    chat_template = use_template(data_args.template, tokenizer,
                                 parse_template_kwargs(data_args.template_kwargs, data_args.enable_thinking))
    choose_pad_token(tokenizer, chat_template)
    prompt_sets = build_prompt_sets(data_args, tokenizer, chat_template, training_args.seed)
    check_record_fields(rewards, prompt_sets.train_records + (prompt_sets.evaluation_records or []))
    note_data(f"grpo-prompts-{cache_key({'train': prompt_sets.train, 'eval': prompt_sets.evaluation})}")
    answers = ConversationTokenizer(tokenizer, chat_template.text, training_args.max_completion_length,
                                    template_kwargs=chat_template.kwargs)
    check_save_schedule(training_args, schedule.steps, len(prompt_sets.train), schedule.prompts)
    set_seed(training_args.seed)
    model = load_group_policy(model_args, training_args, tokenizer, config)
    trainer = GRPOTrainer(
        model=model,
        args=training_args,
        processing_class=tokenizer,
        eval_dataset=prompt_sets.evaluation,
        callbacks=[SavePeftModelCallback("grpo_lora_model")],
        prompts=prompt_sets.train,
        eval_prompts=prompt_sets.evaluation,
        records=prompt_sets.train_records,
        eval_records=prompt_sets.evaluation_records,
        rewards=rewards,
        schedule=schedule,
        tokenizer=tokenizer,
        max_prompt_len=data_args.max_prompt_seq_len,
        after_turn_end_ids=answers.after_turn_end_ids(),
        answer_end_id=answers.answer_end_id(),
        sft_answers=sft_answers,
    )
    train_and_finish(trainer, resume_checkpoint, False, prompt_sets.evaluation, len(prompt_sets.train))


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    run_cli(main)
