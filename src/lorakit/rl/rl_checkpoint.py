"""RL checkpoints (PPO's and GRPO's): only what the stage trains (the actor's adapter, and PPO's critic adapter and
value head; the frozen base is not the run's to save) and the state that makes a resumed run continue exactly
(iteration counter, which fixes the prompts and sampling seeds of every later iteration, and the KL controller);
plus, in one place, the Trainer's private methods the RL trainers override to save and resume them."""

import json
import os
from collections.abc import Iterable
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lorakit.core.cli import InputError
from lorakit.models.zero3 import gathered
from lorakit.rl.rl_math import KLController
from lorakit.trainers.causal_lm import PreparedForTraining, ResumableTrainer
from lorakit.trainers.deepspeed_resume import load_deepspeed_checkpoint

# The file names keep PPO's prefix, which GRPO's checkpoints carry too: checkpoints written before these modules were
# named for RL resume as they are.
RL_STATE_NAME = "ppo_state.json"
TRAINABLE_WEIGHTS_NAME = "ppo_trainable.safetensors"


def save_trainable_weights(model: torch.nn.Module, directory: str, should_save: bool) -> None:
    """directory/ppo_trainable.safetensors (collective under ZeRO-3: every rank calls it)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with gathered([p for _, p in trainable]):
        if should_save:
            os.makedirs(directory, exist_ok=True)
            save_file({n: p.detach().cpu().contiguous() for n, p in trainable},
                      os.path.join(directory, TRAINABLE_WEIGHTS_NAME), metadata={"format": "pt"})


def load_trainable_weights(model: torch.nn.Module, checkpoint: str) -> None:
    path = os.path.join(checkpoint, TRAINABLE_WEIGHTS_NAME)
    if not os.path.isfile(path):
        raise InputError(f"{checkpoint}: not a PPO checkpoint (no {TRAINABLE_WEIGHTS_NAME})")
    weights = load_file(path)
    expected = {n for n, p in model.named_parameters() if p.requires_grad}
    if set(weights) != expected:
        raise InputError(f"{path}: the checkpoint's trained weights do not match this run's roles "
                         f"({len(set(weights) ^ expected)} names differ); resume with the same model options")
    model.load_state_dict(weights, strict=False)


def write_rl_state(directory: str, iteration: int, steps_per_iteration: int, kl_controller: KLController,
                    seed: int) -> None:
    state = {"iteration": iteration, "steps_per_iteration": steps_per_iteration,
             "kl_controller": kl_controller.state_dict(), "seed": seed}
    with open(os.path.join(directory, RL_STATE_NAME), "w", encoding="utf-8") as handle:
        json.dump(state, handle, indent=2)


def read_rl_state(checkpoint: str, steps_per_iteration: int) -> dict[str, Any]:
    """The checkpoint's PPO state, refused when it ran another number of steps per iteration (its
    iteration counter would then point elsewhere in the prompt stream)."""
    path = os.path.join(checkpoint, RL_STATE_NAME)
    if not os.path.isfile(path):
        raise InputError(f"{checkpoint}: not a PPO checkpoint (no {RL_STATE_NAME})")
    with open(path, encoding="utf-8") as handle:
        state = json.load(handle)
    if state["steps_per_iteration"] != steps_per_iteration:
        raise InputError(f"{path}: the checkpoint ran {state['steps_per_iteration']} optimizer steps per iteration, "
                         f"this run {steps_per_iteration}; resume with the same batch options")
    return state


class RLTrainerPrivateOverrides(ResumableTrainer):
    """The transformers Trainer's private methods PPO overrides, all of them here, written against
    transformers 5.23.0 (Trainer._save_optimizer_and_scheduler, _load_from_checkpoint,
    _prepare_for_training, and the _load_optimizer_and_scheduler / _load_scaler they call): check
    them first when upgrading transformers. A ResumableTrainer, so that they are checked against the
    Trainer's (RLTrainer's MRO is as it was: these overrides, ResumableTrainer, Trainer); the class
    using it defines after_prepare(max_steps, resume_from_checkpoint), PPO's own resume, run once the
    model is prepared and the Trainer's state loaded."""

    def after_prepare(self, max_steps: int, resume_from_checkpoint: str | None) -> None:
        raise NotImplementedError

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self.is_deepspeed_enabled:
            return super()._save_optimizer_and_scheduler(output_dir)
        from accelerate.utils import DeepSpeedSchedulerWrapper
        from transformers.trainer import SCHEDULER_NAME

        # The Trainer leaves frozen weights out of DeepSpeed's checkpoint only for a PeftModel;
        # our module holds a frozen base too. model_wrapped is DeepSpeed's (untyped) engine here; the Trainer types
        # it as the module the engine wraps.
        engine: Any = self.model_wrapped
        engine.save_checkpoint(output_dir, exclude_frozen_parameters=True)
        if self.args.should_save and not isinstance(self.lr_scheduler, DeepSpeedSchedulerWrapper):
            assert self.lr_scheduler is not None  # the Trainer makes it before the first step, and so the first save
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        load_trainable_weights(self.model if model is None else model, resume_from_checkpoint)

    def _prepare_for_training(self, max_steps: int, train_dataloader: Iterable[Any],
                              resume_from_checkpoint: str | None) -> PreparedForTraining:
        if self.is_deepspeed_enabled and resume_from_checkpoint is not None:
            model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)
            # Not strict: the checkpoint holds the trained weights only (see _save_optimizer_and_scheduler). Its
            # files are read weights-only, as every stage's DeepSpeed resume reads them.
            load_deepspeed_checkpoint(self.model_wrapped, resume_from_checkpoint, load_module_strict=False)
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
            self._load_scaler(resume_from_checkpoint)
        else:
            model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        self.after_prepare(max_steps, resume_from_checkpoint)
        return PreparedForTraining(model, train_dataloader)
