"""The SFT stage's arguments (`lorakit sft`, lorakit.commands.sft): its data flags (DeepSpeed-Chat's split, data used
whole) and training flags (packing, token budgets); the pipeline reads their flag names."""

from dataclasses import dataclass, field

from lorakit.models.arguments import ModelArguments
from lorakit.trainers.arguments import CausalLMTrainingArguments, DeepSpeedChatDataArguments


@dataclass
class SFTDataArguments(DeepSpeedChatDataArguments):
    sft_only_data_path: list[str] | None = field(
        default=None, metadata={"help": "Data files used whole for SFT, never split.", "nargs": "+"}
    )
    train_on_last_turn_only: bool = field(
        default=False, metadata={"help": "Train only the last answer of each conversation."}
    )


@dataclass
class SFTArguments(CausalLMTrainingArguments):
    packing: bool = field(default=False, metadata={"help": "Pack samples into padding-free rows of max_seq_length."})
    max_tokens_per_batch: int | None = field(
        default=None,
        metadata={"help": "Token-budget batching: each micro-batch holds as many rows (packed rows with --packing, "
                          "else samples) as fit this many tokens, rows x their padded width, in place of "
                          "--per_device_train_batch_size rows. At least --max_seq_length. The loss is the mean over "
                          "the labelled tokens of the whole accumulated batch, as without it."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.packing and self.train_sampling_strategy == "random":
            # Packed rows differ by the few tokens no sample fitted into; batching rows of similar
            # length keeps what padding is left under 2% instead of ~5% with random batches.
            self.train_sampling_strategy = "group_by_length"
            self.mapped_flags.append("--packing -> --train_sampling_strategy group_by_length")


# (model, data, training) arguments: main() parses them; the pipeline launcher reads their flag names.
ARGUMENT_CLASSES = (ModelArguments, SFTDataArguments, SFTArguments)
