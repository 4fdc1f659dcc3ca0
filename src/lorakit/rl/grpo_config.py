"""The group-relative stage's arguments (`lorakit grpo`, lorakit.commands.grpo) with TRL's GRPOConfig names, PPO's
names accepted as mapped aliases, beside the rollout's shared flags (rl.rollout_arguments). The pipeline reads their
flag names."""

import math
from dataclasses import dataclass, field

from lorakit.core.cli import InputError
from lorakit.data.build_dataset import ConversationDataArguments
from lorakit.models.arguments import FlagTable, MappedFlag, ModelArguments, map_flags
from lorakit.rl.group_math import (
    ADVANTAGE_ESTIMATORS,
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    LOSS_TYPES,
    SCALE_REWARDS,
)
from lorakit.rl.rollout_arguments import RolloutArguments


@dataclass
class GRPOModelArguments(ModelArguments):
    """The shared model arguments (dtype, --load_in_kbits for QLoRA, LoRA shape, ...) with the actor's base in
    --model_name_or_path and its SFT adapter in --peft_path, plus an optional reward adapter on the same base."""

    # Required: typed str, as ModelArguments types it and every constructed instance holds it (__post_init__ refuses
    # None). The None default only marks "not given", so that --actor_model_name_or_path can map to it.
    model_name_or_path: str = field(  # type: ignore[assignment]
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
        self.mapped_flags: list[str] = []
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
    reward_timeout: float = field(
        default=600.0, metadata={"help": "Seconds one call of a reward function may take; past it the run stops with "
                                         "one line naming the function (exit status 2). 0: no limit. Changeable on "
                                         "resume."})
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
        notes: list[str] = []
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
        for flag in ("per_device_train_batch_size", "per_device_generation_batch_size"):
            if getattr(self, flag) is not None and getattr(self, flag) < 1:  # else a traceback in the rollout
                raise InputError(f"--{flag} {getattr(self, flag)}: give a number of answers, at least 1")
        if self.per_device_generation_batch_size is None:
            self.per_device_generation_batch_size = self.per_device_train_batch_size
        if not 0 <= self.reward_timeout < math.inf:  # NaN fails it too
            raise InputError(f"--reward_timeout {self.reward_timeout}: give the seconds a reward function call may "
                             "take (0: no limit)")
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


ARGUMENT_CLASSES = (GRPOModelArguments, GRPODataArguments, GRPOArguments)
