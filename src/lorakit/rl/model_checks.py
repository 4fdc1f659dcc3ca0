"""Checks every RL stage makes on the models it is given, before any weight is loaded: the tokenizer and config each
directory holds, that the roles share the actor's tokenizer, and that a reward model comes from the reward stage."""

import os
from typing import TYPE_CHECKING

from lorakit.core.cli import InputError
from lorakit.core.model_files import check_adapter_fits_base, checkpoint_weight_names, has_tokenizer, safetensors_names
from lorakit.data.cache import tokenizer_fingerprint
from lorakit.models.arguments import ModelArguments
from lorakit.models.loader import (
    load_model_config,
    load_tokenizer,
    read_adapter_config,
)
from lorakit.rl.role_policy import SCORE_KEY_SUFFIX

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase


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
    return bool(first and second and os.path.realpath(first) == os.path.realpath(second))
