"""What the PPO stage refuses before it loads a weight, each in one line: roles that do not fit together (tokenizers,
bases, experts), lengths past a model's positions, where the roles can share one base, and batch sizes that do not
tile an iteration's experience."""

import logging
import math
from typing import TYPE_CHECKING, NamedTuple

from lorakit.core.cli import InputError
from lorakit.core.model_files import has_tokenizer
from lorakit.models.adapters import planned_expert_targets, saved_expert_targets
from lorakit.models.arguments import ModelArguments
from lorakit.models.loader import (
    check_load_plan,
    check_model_inputs,
    load_tokenizer,
)
from lorakit.rl.model_checks import check_reward_source, check_same_tokenizer, config_of, same_directory, tokenizer_of
from lorakit.rl.ppo_config import PPOArguments, PPODataArguments, PPOModelArguments
from lorakit.rl.ppo_policy import actor_model_args, critic_model_args
from lorakit.rl.role_policy import role_model_args
from lorakit.rl.rollout_arguments import check_save_steps

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase


logger = logging.getLogger(__name__)


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
    assert model_args.reward_lora_model is not None  # asked of a shareable placement only: the reward an adapter
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
    assert micro is not None  # PPOArguments.__post_init__ sets it (default 8)
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
