"""What the group-relative stage refuses before it loads a weight, and the rollout's shape per process
(GroupSchedule): groups that stay whole on their process, a reward to train on, and checkpoints only at rollout
boundaries."""

import math
from typing import TYPE_CHECKING, NamedTuple

from lorakit.core.cli import InputError
from lorakit.models.loader import check_load_plan, check_model_inputs
from lorakit.rl.grpo_config import GRPOArguments, GRPODataArguments, GRPOModelArguments
from lorakit.rl.model_checks import check_reward_source, check_same_tokenizer, config_of, same_directory, tokenizer_of
from lorakit.rl.rollout_arguments import check_save_steps

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase


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
