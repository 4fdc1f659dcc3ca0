"""The DPO stage's arguments (`lorakit dpo`, lorakit.commands.dpo): the preference loss's flags, named as TRL's
DPOConfig / CPOConfig names them, beside the shared model and preference-pair data arguments; the pipeline reads
their flag names."""

from dataclasses import dataclass, field
from typing import ClassVar

from lorakit.core.cli import InputError
from lorakit.models.arguments import ModelArguments
from lorakit.models.dpo_losses import LOSS_TYPES
from lorakit.trainers.arguments import CausalLMTrainingArguments, PreferenceDataArguments


@dataclass
class DPOArguments(CausalLMTrainingArguments):
    """Training arguments (--chunked_loss: the answers' log-probabilities) plus the preference loss (names as
    TRL's DPOConfig / CPOConfig)."""

    accepts_kernel_flags: ClassVar[bool] = False  # not proven here: trainers.arguments.check_kernel_flags

    loss_type: str = field(
        default="sigmoid",
        metadata={"help": "sigmoid (DPO), ipo, hinge, robust (with --label_smoothing), simpo (reference-free, "
                          "length-normalised, --simpo_gamma) or orpo (reference-free odds ratio + NLL).",
                  "choices": list(LOSS_TYPES)},
    )
    beta: float = field(default=0.1, metadata={"help": "Strength of the preference (DPO's beta; IPO's 1/tau)."})
    label_smoothing: float = field(
        default=0.0, metadata={"help": "robust/simpo: the share of pairs assumed flipped, in [0, 0.5)."}
    )
    simpo_gamma: float = field(default=0.5, metadata={"help": "simpo: the target reward margin."})
    rpo_alpha: float = field(
        default=0.0, metadata={"help": "Weight of the NLL of the chosen answers added to any loss (RPO)."}
    )
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={"help": "Compute the reference log-probs once before training, cached with the pairs; no "
                          "reference forward during training."},
    )
    share_pair_prefix: bool = field(
        default=True,
        metadata={"help": "One row per pair (the shared prompt once, then the chosen and the rejected answer). "
                          "Needs sdpa or eager attention; two rows per pair otherwise."},
    )

    def __post_init__(self) -> None:
        if self.beta <= 0:
            raise InputError(f"--beta must be positive, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise InputError(f"--label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.rpo_alpha < 0:
            raise InputError(f"--rpo_alpha must not be negative, got {self.rpo_alpha}")
        super().__post_init__()


# (model, data, training) arguments: main() parses them; the pipeline launcher reads their flag names.
ARGUMENT_CLASSES = (ModelArguments, PreferenceDataArguments, DPOArguments)
