"""The group-relative stages' roles on one frozen base (rl.role_policy.SharedBasePolicy without a critic): the actor
(the trained "default" adapter: new, or continuing --peft_path), the reference only where the KL to it is paid (a
frozen copy of --peft_path, or the base with no adapter active), and the reward model only where one is given (its
adapter and score head, frozen)."""

import logging
from typing import TYPE_CHECKING

from lorakit.core.cli import InputError
from lorakit.core.model_files import expert_parameter_targets
from lorakit.models.adapters import log_trainable
from lorakit.models.loader import keep_trainable_float32, load_model
from lorakit.rl.role_policy import (
    SharedBasePolicy,
    add_reward_adapter,
    base_model,
    frozen_dtype,
    new_score_head,
    peft_model_of,
    reward_adapter_parts,
)

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

    from lorakit.rl.grpo_config import GRPOArguments, GRPOModelArguments

logger = logging.getLogger(__name__)


def check_same_experts(actor: list[str], reward: list[str], reward_dir: str) -> None:
    """peft holds several adapters on a mixture of experts' fused experts only when they train the same ones: the
    reward adapter, on the actor's base here, must (else one line, before peft's own error)."""
    if actor != reward:
        raise InputError(f"--reward_lora_model {reward_dir} trains the experts {', '.join(reward) or '(none)'}, the "
                         f"actor's adapter {', '.join(actor) or '(none)'}: one base holds adapters of fused experts "
                         "only when they train the same; train both with the same --lora_experts")


def load_group_policy(model_args: "GRPOModelArguments", training_args: "GRPOArguments",
                      tokenizer: "PreTrainedTokenizerBase", config: "PreTrainedConfig") -> SharedBasePolicy:
    """The actor via the shared loader (on a quantized base with --load_in_kbits), then the reference and reward
    adapters it needs on the same base; only the actor's adapter is trainable."""
    from peft import LoraConfig, TaskType

    policy = peft_model_of(load_model(model_args, training_args, tokenizer, config=config, adapter_flag="--peft_path"))
    reference = None
    if model_args.peft_path and training_args.beta > 0:
        policy.load_adapter(model_args.peft_path, adapter_name="reference", is_trainable=False)
        reference = "reference"
    score_head = None
    if model_args.reward_lora_model:
        lora_weights, score_weights = reward_adapter_parts(model_args.reward_lora_model)
        reward_config = LoraConfig.from_pretrained(model_args.reward_lora_model)
        reward_config.task_type, reward_config.modules_to_save = TaskType.CAUSAL_LM, None
        actor_config = policy.peft_config["default"]
        assert isinstance(actor_config, LoraConfig)  # load_model's adapter: a new LoRA or --peft_path's, a LoRA
        check_same_experts(expert_parameter_targets(actor_config.target_parameters),
                           expert_parameter_targets(reward_config.target_parameters), model_args.reward_lora_model)
        add_reward_adapter(policy, "reward", reward_config, lora_weights, model_args.reward_lora_model)
        causal_lm = base_model(policy)
        score_head = new_score_head(causal_lm.config.hidden_size, score_weights, frozen_dtype(causal_lm),
                                    trainable=False)
    # peft's add/load_adapter re-freeze whatever is not the active adapter: the actor's flags set once, here.
    for name, param in policy.named_parameters():
        param.requires_grad = ".default." in name
    base_model(policy).config.use_cache = False
    model = SharedBasePolicy(policy, score_head=score_head, value_head=None, reference_adapter=reference,
                             reward_adapter_dir=model_args.reward_lora_model)
    logger.info("roles: the actor%s%s on one base", "" if training_args.beta == 0 else
                (", the reference (" + ("a frozen copy of --peft_path" if reference else "the base alone") + ")"),
                ", the reward model (--reward_lora_model)" if score_head is not None else "")
    keep_trainable_float32(model, training_args)
    log_trainable(model)
    return model
