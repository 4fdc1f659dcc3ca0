"""The actor's exponential moving average (DeepSpeed-Chat's --enable_ema): float32 CPU copies of
the actor's trainable weights, averaged after every optimizer step, saved as actor_ema in
ppo_lora_model's layout (and read back from a checkpoint's actor_ema on resume)."""

import os
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from lorakit.core.cli import InputError
from lorakit.models.zero3 import gathered
from lorakit.rl.ppo_policy import SeparatePolicy
from lorakit.rl.rl_math import ema_update
from lorakit.rl.role_policy import RolePolicy, SharedBasePolicy

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

EMA_DIR_NAME = "actor_ema"


def actor_peft_model(model: RolePolicy) -> "PeftModel":
    """The peft model holding the actor's adapter ("default"): the shared base's, or the separate actor."""
    if isinstance(model, SharedBasePolicy):
        return model.policy
    if isinstance(model, SeparatePolicy):
        return model.actor
    raise TypeError(f"{type(model).__name__}: no actor adapter known to save an EMA of")


class ActorEMA:
    """The average of a RolePolicy's actor weights with decay beta per step. Inactive (every method a
    no-op, nothing saved) until start(), which copies the current weights unless load() already
    read a checkpoint's."""

    def __init__(self, model: RolePolicy, beta: float) -> None:
        self.model, self.beta = model, beta
        self.weights: dict[str, torch.Tensor] | None = None

    @property
    def active(self) -> bool:
        return self.weights is not None

    def start(self) -> None:
        if self.weights is None:
            named = self.model.actor_named_parameters()
            with gathered([p for _, p in named]):
                self.weights = {name: p.detach().float().cpu().clone() for name, p in named}

    def update(self) -> None:
        """One optimizer step's average (collective under ZeRO-3: every rank calls it)."""
        if self.weights is None:
            return
        named = self.model.actor_named_parameters()
        with gathered([p for _, p in named]):
            ema_update([self.weights[name] for name, _ in named], [p.detach().float().cpu() for _, p in named],
                       self.beta)

    def save(self, directory: str, tokenizer: "PreTrainedTokenizerBase") -> None:
        """directory/actor_ema: the actor's adapter config, the averaged weights, the tokenizer."""
        if self.weights is None:
            return
        from peft import get_peft_model_state_dict

        actor = actor_peft_model(self.model)
        weights = get_peft_model_state_dict(actor, state_dict=dict(self.weights), adapter_name="default")
        path = os.path.join(directory, EMA_DIR_NAME)
        os.makedirs(path, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        actor.peft_config["default"].save_pretrained(path)
        tokenizer.save_pretrained(path)

    def load(self, checkpoint: str) -> None:
        """The average saved in checkpoint/actor_ema: an --enable_ema run resumes only from a checkpoint of one
        (the run identity compares --enable_ema first), never restarting the average silently."""
        path = os.path.join(checkpoint, EMA_DIR_NAME, "adapter_model.safetensors")
        if not os.path.isfile(path):
            raise InputError(f"{checkpoint}: no {EMA_DIR_NAME} to continue the actor's average (--enable_ema) from")
        saved = load_file(path)
        # Saved without peft's adapter name: map each saved key back to our parameter names.
        weights = {}
        for name, _ in self.model.actor_named_parameters():
            key = name.replace(".default.", ".")
            if key not in saved:
                raise InputError(f"{path}: no weight {key}; resume with the same model options")
            weights[name] = saved[key].float()
        self.weights = weights
