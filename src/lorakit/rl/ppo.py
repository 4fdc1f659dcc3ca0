#!/usr/bin/env python
"""PPO against a reward model with LoRA (DeepSpeed-Chat's step 3, InstructGPT's RL stage).

Four roles: the actor (the SFT policy with a LoRA adapter, trained), the reference (the actor's
frozen starting point), the reward model (frozen, from run_reward.py) and the critic (a value
model initialised from the reward model, trained). With --shared_base (the default when all of
them sit on one base model) ONE frozen base carries several peft adapters: four roles for the
memory of one base. Otherwise each role is its own model, as in DeepSpeed-Chat.

    torchrun --nproc_per_node 8 scripts/training/run_ppo.py \
        --actor_model_name_or_path BASE --actor_lora_model SFT_OUT/sft_lora_model \
        --reward_model_name_or_path BASE --reward_lora_model RM_OUT/rm_lora_model \
        --dataset_dir PROMPTS --max_prompt_seq_len 256 --max_answer_seq_len 256 \
        --output_dir OUT --max_steps 1000 --deepspeed ds_configs/ds_zero2_no_offload.json ...

The Trainer's "dataset" is the experience itself: each PPO iteration takes
--generation_batches batches of --per_device_generation_batch_size prompts per process,
generates answers with the current actor, scores them (actor and reference log-probs, critic
values, reward score), computes KL-penalised rewards and GAE advantages, and hands the Trainer
--ppo_epochs passes over the experience in micro-batches of --per_device_training_batch_size.
--max_steps counts optimizer steps, as everywhere: one iteration is
ppo_epochs * generation_batches * per_device_generation_batch_size
/ (per_device_training_batch_size * gradient_accumulation_steps) of them (logged at start).

Writes OUT/ppo_lora_model (actor adapter + tokenizer; it continues --actor_lora_model when one
was given, so base + ppo_lora_model is the PPO policy), OUT/actor_ema (with --enable_ema),
OUT/critic (critic adapter + value head, in rm_lora_model's layout) and resumable
OUT/checkpoint-N (at iteration boundaries, with the iteration counter, KL controller and EMA).

This module holds the arguments, the prompt reading and the checks on the inputs; the roles are
in rl.policy, the Trainer in rl.ppo_trainer and the PPO math in rl.ppo_math.
"""

import logging
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from transformers import set_seed

from lorakit.core.cli import InputError, parse_args, run_cli
from lorakit.core.model_files import check_adapter_fits_base, checkpoint_weight_names, has_tokenizer, safetensors_names
from lorakit.data.build_dataset import ConversationDataArguments, build_pretraining_blocks
from lorakit.data.cache import cache_key, data_cache_dir, report_prepared_data, tokenizer_fingerprint
from lorakit.data.conversation_tokenizer import ConversationTokenizer
from lorakit.data.prompts import build_prompt_sets
from lorakit.data.run_record import note_data
from lorakit.models.adapters import planned_expert_targets, saved_expert_targets
from lorakit.models.arguments import FlagTable, MappedFlag, ModelArguments, map_flags
from lorakit.models.loader import (
    check_load_plan,
    check_model_inputs,
    choose_pad_token,
    load_model_config,
    load_tokenizer,
    read_adapter_config,
)
from lorakit.records.chat_templates import parse_template_kwargs, use_template
from lorakit.rl.health import read_sft_answers
from lorakit.rl.policy import (
    SCORE_KEY_SUFFIX,
    actor_model_args,
    check_frozen_roles_fit,
    critic_model_args,
    load_separate_policy,
    load_shared_policy,
    role_model_args,
)
from lorakit.rl.ppo_trainer import PPOTrainer
from lorakit.rl.rollout_arguments import RolloutArguments, check_save_steps
from lorakit.trainers.checkpoints import SavePeftModelCallback
from lorakit.trainers.common import check_held_out_data, resolve_resume_checkpoint, setup_logging, train_and_finish

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- arguments


@dataclass
class PPOModelArguments(ModelArguments):
    """The shared model arguments (dtype, --load_in_kbits for QLoRA, LoRA shape, --modules_to_save,
    --new_embeddings_init, ...) plus the four roles' models, named as in DeepSpeed-Chat's step 3.
    --model_name_or_path and --peft_path, the other stages' names for what PPO trains, are the
    actor's: given, they are mapped to --actor_model_name_or_path / --actor_lora_model (logged), as
    are DeepSpeed-Chat's --actor_lora_dim / --critic_lora_dim to --lora_rank (PPO_MODEL_FLAGS)."""

    model_name_or_path: str | None = field(default=None, metadata={"help": "Same as --actor_model_name_or_path."})
    peft_path: str | None = field(default=None, metadata={"help": "Same as --actor_lora_model."})
    tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "Tokenizer directory (default: the SFT adapter's, else the actor base's)."}
    )
    lora_dropout: float = field(
        default=0.0,
        metadata={"help": "Dropout on the LoRA input. 0 (DeepSpeed-Chat's choice): experience is scored without "
                          "dropout, so any dropout in the update adds noise to PPO's probability ratio."},
    )
    actor_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Actor base model (or a merged SFT model). Required."}
    )
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Reward base model (with --reward_lora_model), or a merged reward model "
                                        "(rm_merged_model). Required."}
    )
    actor_lora_model: str | None = field(
        default=None,
        metadata={"help": "The SFT adapter on the actor base: the policy PPO starts from and the reference."},
    )
    reward_lora_model: str | None = field(
        default=None, metadata={"help": "The reward adapter (rm_lora_model of run_reward.py: LoRA + score head)."}
    )
    critic_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A full reward/value model to start the critic from (default: the reward model)."},
    )
    shared_base: bool | None = field(
        default=None,
        metadata={"help": "One frozen base with actor/critic/reward(/reference) adapters. Default: true when the "
                          "actor and reward share a base and the reward comes as an adapter."},
    )
    offload_reference_model: bool = field(
        default=False,
        metadata={"help": "Separate placement: keep the reference and reward models on the CPU between their passes."},
    )
    actor_lora_dim: int | None = field(default=None, metadata={"help": "DeepSpeed-Chat: mapped to --lora_rank."})
    critic_lora_dim: int | None = field(default=None, metadata={"help": "DeepSpeed-Chat: mapped to --lora_rank."})

    def __post_init__(self) -> None:
        # Logging is not configured yet; main() hands these to setup_logging with the Trainer's own.
        super().__post_init__()
        map_flags(self, PPO_MODEL_FLAGS, self.mapped_flags)
        for flag in ("actor_model_name_or_path", "reward_model_name_or_path"):
            if getattr(self, flag) is None:
                raise InputError(f"--{flag} is required")
        if self.full_finetuning:
            raise InputError("--full_finetuning: PPO trains LoRA adapters (actor, critic) on frozen bases")


def role_lora_dim_flag(dim: int) -> MappedFlag:
    """DeepSpeed-Chat's --actor_lora_dim / --critic_lora_dim: the rank of PPO's new LoRA adapters."""
    if dim < 1:
        raise InputError(f"--actor_lora_dim / --critic_lora_dim {dim}: PPO trains LoRA adapters (actor, critic); "
                         "give a rank of at least 1")
    return MappedFlag("lora_rank", dim, "one --lora_rank shapes every new PPO adapter; the actor and critic continue "
                                        "the SFT and reward adapters at their own ranks")


# Other names of PPO's model flags -> what each means here, applied by models.arguments.map_flags: the other
# stages' names of the actor's model and adapter, and DeepSpeed-Chat's per-role LoRA ranks.
PPO_MODEL_FLAGS: FlagTable = {
    "model_name_or_path": lambda path: MappedFlag("actor_model_name_or_path", path),
    "peft_path": lambda path: MappedFlag("actor_lora_model", path),
    "actor_lora_dim": role_lora_dim_flag,
    "critic_lora_dim": role_lora_dim_flag,
}


@dataclass
class PPODataArguments(ConversationDataArguments):
    data_phase: int = field(default=3, metadata={"help": "Which part of --data_split this stage takes (3 = PPO)."})
    max_prompt_seq_len: int = field(default=256, metadata={"help": "Prompt tokens; longer prompts lose their start."})
    max_answer_seq_len: int = field(default=256, metadata={"help": "Most tokens generated per answer."})
    unsupervised_dataset_dir: str | None = field(
        default=None,
        metadata={"help": "Pretraining text (*.txt / *.jsonl 'text') for the ptx loss mixed into the actor's."},
    )
    unsup_coef: float = field(
        default=27.8, metadata={"help": "Weight of the ptx language-model loss (InstructGPT's gamma)."})


@dataclass
class PPOArguments(RolloutArguments):
    """TrainingArguments plus DeepSpeed-Chat's step-3 options. --per_device_training_batch_size
    and --actor_learning_rate set the Trainer's own batch size and learning rate; the Trainer's
    names for them are accepted too (mapped, logged), giving both with different values is refused."""

    per_device_train_batch_size: int | None = field(
        default=None, metadata={"help": "The Trainer's name of --per_device_training_batch_size."})
    learning_rate: float | None = field(
        default=None, metadata={"help": "The Trainer's name of --actor_learning_rate."})
    per_device_generation_batch_size: int = field(
        default=8, metadata={"help": "Prompts per generation batch per process."})
    per_device_training_batch_size: int | None = field(
        default=None, metadata={"help": "Sequences per PPO micro-batch per process (default 8)."})
    generation_batches: int = field(default=1, metadata={"help": "Generation batches of experience per PPO iteration."})
    ppo_epochs: int = field(default=1, metadata={"help": "Passes over each iteration's experience."})
    actor_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the actor's adapter (default 1e-4)."})
    critic_learning_rate: float = field(
        default=5e-5, metadata={"help": "Learning rate of the critic's adapter and value head."})
    kl_ctl: float = field(default=0.1, metadata={"help": "KL penalty coefficient (initial value when adaptive)."})
    target_kl: float | None = field(
        default=None, metadata={"help": "Adaptive KL control towards this KL per answer."})
    kl_horizon: int = field(default=10000, metadata={"help": "Adaptive KL controller horizon, in answers."})
    clip_reward_value: float = field(default=5.0, metadata={"help": "Reward scores are clamped to +-this."})
    cliprange: float = field(default=0.2, metadata={"help": "PPO policy ratio clip range."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Value clip range around the experience's values."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    missing_eos_penalty: float | None = field(
        default=None,
        metadata={"help": "Subtracted from the score of an answer that hit --max_answer_seq_len without EOS."},
    )
    actor_zero_stage: int | None = field(default=None, metadata={"help": "DeepSpeed-Chat: mapped to --zero_stage."})
    critic_zero_stage: int | None = field(default=None, metadata={"help": "DeepSpeed-Chat: mapped to --zero_stage."})
    def __post_init__(self) -> None:
        # The Trainer's names for what PPO calls --per_device_training_batch_size and --actor_learning_rate, and
        # DeepSpeed-Chat's per-role ZeRO stages, are mapped before TrainingArguments fills DeepSpeed's "auto"
        # batch size and learning rate from them and --zero_stage picks the config.
        notes = []
        map_flags(self, PPO_TRAINER_FLAGS, notes)
        for trainer_flag, ppo_flag, default in (("per_device_train_batch_size", "per_device_training_batch_size", 8),
                                                ("learning_rate", "actor_learning_rate", 1e-4)):
            value = default if getattr(self, ppo_flag) is None else getattr(self, ppo_flag)
            setattr(self, trainer_flag, value)
            setattr(self, ppo_flag, value)
        super().__post_init__()
        self.mapped_flags[:0] = notes


ONE_ENGINE = "one DeepSpeed engine trains the actor's and the critic's adapters together"
# Other names of PPO's trainer flags -> what each means here, applied by models.arguments.map_flags.
PPO_TRAINER_FLAGS: FlagTable = {
    "per_device_train_batch_size": lambda size: MappedFlag("per_device_training_batch_size", size),
    "learning_rate": lambda rate: MappedFlag("actor_learning_rate", rate),
    "actor_zero_stage": lambda stage: MappedFlag("zero_stage", stage, ONE_ENGINE),
    "critic_zero_stage": lambda stage: MappedFlag("zero_stage", stage, ONE_ENGINE),
}


# ----------------------------------------------------------------------------- prompts


# ----------------------------------------------------------------------------- model checks


def tokenizer_of(model_dir: str, adapter_dir: str | None, trust_remote_code: bool) -> "PreTrainedTokenizerBase":
    """The tokenizer saved with an adapter (it carries the stage's chat template), else the model's."""
    return load_tokenizer(ModelArguments(model_name_or_path=adapter_dir if has_tokenizer(adapter_dir) else model_dir,
                                         trust_remote_code=trust_remote_code))


def config_of(model_dir: str, trust_remote_code: bool) -> "PreTrainedConfig":
    return load_model_config(ModelArguments(model_name_or_path=model_dir, trust_remote_code=trust_remote_code))


def check_same_tokenizer(actor_tokenizer: "PreTrainedTokenizerBase", other: "PreTrainedTokenizerBase", role: str,
                         where: str) -> None:
    if tokenizer_fingerprint(actor_tokenizer) != tokenizer_fingerprint(other):
        detail = (f"{len(other)} tokens vs the actor's {len(actor_tokenizer)}" if len(other) != len(actor_tokenizer)
                  else "same size, different tokens or ids")
        raise InputError(f"{where}: the {role} model's tokenizer differs from the actor's ({detail}); "
                         "PPO scores the actor's token ids, so every role needs the actor's tokenizer")


def check_reward_source(model_dir: str, adapter_dir: str | None, flag: str) -> None:
    """A reward/critic source must carry a trained score head: a base model alone would get a
    random one, and PPO would optimise noise."""
    if adapter_dir:
        adapter_config = read_adapter_config(adapter_dir)
        check_adapter_fits_base(adapter_dir, model_dir, "--reward_lora_model")
        weights = os.path.join(adapter_dir, "adapter_model.safetensors")
        keys = safetensors_names(weights) if os.path.isfile(weights) else []
        if adapter_config.get("task_type") != "SEQ_CLS" or not any(k.endswith(SCORE_KEY_SUFFIX) for k in keys):
            raise InputError(f"{adapter_dir}: not a reward adapter (no score head in adapter_model.safetensors); "
                             "give rm_lora_model of run_reward.py")
        return
    if not any(k.endswith(SCORE_KEY_SUFFIX) for k in checkpoint_weight_names(model_dir)):
        raise InputError(f"{model_dir}: {flag} is not a reward model (no score head in its weights); give the reward "
                         "adapter with --reward_lora_model, or run_reward.py's rm_merged_model")


def same_directory(first: str | None, second: str | None) -> bool:
    return bool(first) and bool(second) and os.path.realpath(first) == os.path.realpath(second)


class CheckedModels(NamedTuple):
    """What check_models read and decided: the actor's tokenizer, {role: model config}, and the placement."""

    tokenizer: "PreTrainedTokenizerBase"
    configs: dict[str, "PreTrainedConfig"]
    shared_base: bool


def check_models(model_args: PPOModelArguments, data_args: PPODataArguments) -> CheckedModels:
    """Refuse, before any weight is loaded, role combinations that would train silently wrong.
    Returns (actor tokenizer, {role: model config}, shared_base); the configs go on to the
    loaders, so a run reads each once."""
    trust_remote_code = model_args.trust_remote_code
    configs = {"actor": config_of(model_args.actor_model_name_or_path, trust_remote_code),
               "reward": config_of(model_args.reward_model_name_or_path, trust_remote_code)}
    if model_args.tokenizer_name_or_path:
        tokenizer = load_tokenizer(ModelArguments(model_name_or_path=model_args.actor_model_name_or_path,
                                                  tokenizer_name_or_path=model_args.tokenizer_name_or_path,
                                                  trust_remote_code=trust_remote_code))
    else:
        tokenizer = tokenizer_of(model_args.actor_model_name_or_path, model_args.actor_lora_model, trust_remote_code)
    check_model_inputs(actor_model_args(model_args), configs["actor"], tokenizer, adapter_flag="--actor_lora_model")
    reward_dir = (model_args.reward_lora_model if has_tokenizer(model_args.reward_lora_model)
                  else model_args.reward_model_name_or_path)
    reward_tokenizer = tokenizer_of(model_args.reward_model_name_or_path, model_args.reward_lora_model,
                                    trust_remote_code)
    check_same_tokenizer(tokenizer, reward_tokenizer, "reward", reward_dir)
    check_reward_source(model_args.reward_model_name_or_path, model_args.reward_lora_model,
                        "--reward_model_name_or_path")
    if model_args.critic_model_name_or_path:
        configs["critic"] = config_of(model_args.critic_model_name_or_path, trust_remote_code)
        check_same_tokenizer(tokenizer, tokenizer_of(model_args.critic_model_name_or_path, None, trust_remote_code),
                             "critic", model_args.critic_model_name_or_path)
        check_reward_source(model_args.critic_model_name_or_path, None, "--critic_model_name_or_path")
    check_lengths(data_args, configs)
    return CheckedModels(tokenizer, configs, shared_placement(model_args, configs["actor"]))


def check_role_loading(model_args: PPOModelArguments, training_args: PPOArguments,
                       tokenizer: "PreTrainedTokenizerBase", configs: dict[str, "PreTrainedConfig"]) -> None:
    """What loading the roles would refuse, refused before any data is read (models.loader.check_load_plan): the
    actor (its SFT adapter, the reference's, continued) and the critic as they are made trainable, and the frozen
    reward model where the critic does not start from it."""
    check_load_plan(actor_model_args(model_args), training_args, configs["actor"], tokenizer,
                    adapter_flag="--actor_lora_model")
    check_load_plan(critic_model_args(model_args), training_args, configs.get("critic", configs["reward"]), tokenizer,
                    task="reward", adapter_flag="--reward_lora_model")
    if model_args.critic_model_name_or_path:
        reward = role_model_args(model_args, model_args.reward_model_name_or_path, model_args.reward_lora_model)
        check_load_plan(reward, training_args, configs["reward"], tokenizer, task="reward", trainable=False,
                        adapter_flag="--reward_lora_model")


def check_lengths(data_args: PPODataArguments, configs: dict[str, "PreTrainedConfig"]) -> None:
    total = data_args.max_prompt_seq_len + data_args.max_answer_seq_len
    for flag, value in (("--max_prompt_seq_len", data_args.max_prompt_seq_len),
                        ("--max_answer_seq_len", data_args.max_answer_seq_len)):
        if value < 1:
            raise InputError(f"{flag} must be at least 1, got {value}")
    for role, config in configs.items():
        positions = getattr(config, "max_position_embeddings", None)
        if positions is not None and total > positions:
            raise InputError(f"--max_prompt_seq_len {data_args.max_prompt_seq_len} + --max_answer_seq_len "
                             f"{data_args.max_answer_seq_len} = {total} exceeds the {role} model's "
                             f"max_position_embeddings {positions} (config.json)")


def shared_placement(model_args: PPOModelArguments, actor_config: "PreTrainedConfig") -> bool:
    """--shared_base as given, else whether every role can sit on the actor's base: the same base, the reward model
    an adapter, and (a mixture of experts) the roles' adapters training the same expert weights, which peft needs
    of adapters sharing fused experts (else separate models, logged)."""
    shareable = (same_directory(model_args.actor_model_name_or_path, model_args.reward_model_name_or_path)
                 and model_args.reward_lora_model is not None
                 and (model_args.critic_model_name_or_path is None
                      or same_directory(model_args.critic_model_name_or_path, model_args.reward_model_name_or_path)))
    mismatch = shareable and expert_mismatch(model_args, actor_config)
    if mismatch and model_args.shared_base is None:
        logger.info("placement: separate models, as %s", mismatch)
        return False
    shared = shareable if model_args.shared_base is None else model_args.shared_base
    if shared and not shareable:
        raise InputError("--shared_base true needs the reward model as an adapter (--reward_lora_model) on the actor's "
                         "base (--reward_model_name_or_path = --actor_model_name_or_path) and no other critic model")
    if shared and mismatch:
        raise InputError(f"--shared_base true: {mismatch}; drop --shared_base (separate models) or train both "
                         "adapters with the same --lora_experts")
    return shared


def expert_mismatch(model_args: PPOModelArguments, actor_config: "PreTrainedConfig") -> str | None:
    """Why the actor's and the reward model's adapters cannot share one mixture-of-experts base (peft holds
    several adapters on fused experts only when they train the same ones), or None."""
    reward = saved_expert_targets(model_args.reward_lora_model)
    actor = (saved_expert_targets(model_args.actor_lora_model) if model_args.actor_lora_model
             else planned_expert_targets(actor_config, model_args, reward))
    if actor == reward:
        return None
    return (f"the actor's adapter trains the experts {', '.join(actor) or '(none)'} and the reward model's "
            f"{', '.join(reward) or '(none)'}: one base holds adapters of fused experts only when they train the same")


def check_schedule(training_args: PPOArguments, num_prompts: int) -> int:
    """Optimizer steps per PPO iteration; refuses batch sizes that do not tile the experience and
    checkpoints that would fall inside an iteration (its experience could not be restored)."""
    experience = training_args.generation_batches * training_args.per_device_generation_batch_size
    micro = training_args.per_device_training_batch_size
    for flag in ("generation_batches", "per_device_generation_batch_size", "per_device_training_batch_size",
                 "ppo_epochs"):
        if getattr(training_args, flag) < 1:
            raise InputError(f"--{flag} must be at least 1")
    if experience % micro:
        raise InputError(f"--generation_batches {training_args.generation_batches} x "
                         f"--per_device_generation_batch_size {training_args.per_device_generation_batch_size} = "
                         f"{experience} sequences per iteration is not "
                         f"a multiple of --per_device_training_batch_size {micro}")
    micro_batches = training_args.ppo_epochs * experience // micro
    accumulation = training_args.gradient_accumulation_steps
    if micro_batches % accumulation:
        raise InputError(f"{micro_batches} micro-batches per PPO iteration is not a multiple of "
                         f"--gradient_accumulation_steps {accumulation}")
    steps_per_iteration = micro_batches // accumulation
    if training_args.max_steps <= 0:
        # DeepSpeed-Chat's epochs: passes over the prompts.
        prompts_per_iteration = experience * training_args.world_size
        iterations = math.ceil(training_args.num_train_epochs * num_prompts / prompts_per_iteration)
        training_args.max_steps = max(1, iterations) * steps_per_iteration
    check_save_steps(training_args, steps_per_iteration, "PPO iteration")
    return steps_per_iteration


# ----------------------------------------------------------------------------- main


# main() parses them; the pipeline launcher reads their flag names.
ARGUMENT_CLASSES = (PPOModelArguments, PPODataArguments, PPOArguments)


def main() -> None:
    model_args, data_args, training_args = parse_args(ARGUMENT_CLASSES)
    training_args.mapped_flags += model_args.mapped_flags
    setup_logging(training_args)
    check_held_out_data(data_args, training_args, "prompts")
    resume_checkpoint = None if data_args.prepare_data_only else resolve_resume_checkpoint(training_args, model_args,
                                                                                         data_args)
    tokenizer, configs, shared = check_models(model_args, data_args)
    sft_answers = read_sft_answers(training_args.sft_answers_file)
    check_role_loading(model_args, training_args, tokenizer, configs)
    if not shared:
        check_frozen_roles_fit(model_args, training_args, tokenizer, configs)
    chat_template = use_template(data_args.template, tokenizer,
                                 parse_template_kwargs(data_args.template_kwargs, data_args.enable_thinking))
    choose_pad_token(tokenizer, chat_template)
    prompt_sets = build_prompt_sets(data_args, tokenizer, chat_template, training_args.seed)
    prompts, eval_prompts = prompt_sets.train, prompt_sets.evaluation
    # Tokenized in memory, not cached: their fingerprint is the run's record of its prompts (a resume checks it).
    note_data(f"ppo-prompts-{cache_key({'train': prompts, 'eval': eval_prompts})}")
    # The reward model reads its score at the end of an answer's turn (run_reward.py trains it so).
    answers = ConversationTokenizer(tokenizer, chat_template.text, data_args.max_answer_seq_len,
                                    template_kwargs=chat_template.kwargs)
    after_turn_end_ids, answer_end_id = answers.after_turn_end_ids(), answers.answer_end_id()
    logger.info("answers end with %r and are scored after the template's turn end %r",
                tokenizer.convert_ids_to_tokens(answer_end_id), tokenizer.decode(after_turn_end_ids))
    steps_per_iteration = check_schedule(training_args, len(prompts))
    ptx_blocks = None
    if data_args.unsupervised_dataset_dir:
        with training_args.main_process_first(desc="tokenize the ptx data"):
            ptx_blocks = build_pretraining_blocks(
                data_args.unsupervised_dataset_dir, tokenizer,
                data_args.max_prompt_seq_len + data_args.max_answer_seq_len, data_cache_dir(data_args.data_cache_dir),
                data_args.preprocessing_num_workers)
    if data_args.prepare_data_only:  # the prompts are tokenized in memory at each launch: only ptx data is cached
        return report_prepared_data()
    set_seed(training_args.seed)

    logger.info("placement: %s", "shared base (one frozen base, one adapter per role)" if shared else "separate models")
    if shared and model_args.offload_reference_model:
        logger.info("--offload_reference_model has nothing to move with --shared_base: "
                    "the reference is the shared base")
    load = load_shared_policy if shared else load_separate_policy
    model = load(model_args, training_args, tokenizer, configs)
    trainer = PPOTrainer(
        model=model,
        args=training_args,
        processing_class=tokenizer,
        eval_dataset=eval_prompts,
        callbacks=[SavePeftModelCallback("ppo_lora_model")],
        prompts=prompts,
        eval_prompts=eval_prompts,
        ptx_blocks=ptx_blocks,
        data_args=data_args,
        tokenizer=tokenizer,
        steps_per_iteration=steps_per_iteration,
        after_turn_end_ids=after_turn_end_ids,
        answer_end_id=answer_end_id,
        sft_answers=sft_answers,
    )
    train_and_finish(trainer, resume_checkpoint, False, eval_prompts, len(prompts))


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    run_cli(main)


if __name__ == "__main__":
    entry_point()
