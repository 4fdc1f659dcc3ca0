"""The continued-pretraining stage's arguments (`lorakit pt`, lorakit.commands.pt): its data flags beside the
shared model and causal-LM training arguments; the pipeline reads their flag names."""

from dataclasses import dataclass, field

from lorakit.data.build_dataset import (
    PREPARE_DATA_ONLY_HELP,
    check_prepare_data_only,
)
from lorakit.models.arguments import ModelArguments
from lorakit.trainers.arguments import CausalLMTrainingArguments


@dataclass
class PretrainingDataArguments:
    dataset_dir: str | None = field(
        default=None, metadata={"help": "Directory of *.txt (one document a line) and *.jsonl (field 'text') files."}
    )
    data_cache_dir: str | None = field(
        default=None, metadata={"help": "Where tokenized blocks are cached (default: the datasets cache)."}
    )
    block_size: int | None = field(
        default=None, metadata={"help": "Tokens per training block (default: min(1024, model's max positions))."}
    )
    validation_split_percentage: float = field(
        default=0.05, metadata={"help": "Held-out share of blocks for eval: a fraction if < 1, else a percentage."}
    )
    preprocessing_num_workers: int = field(default=1, metadata={"help": "Processes used to tokenize."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep at most this many train blocks."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep at most this many eval blocks."})
    prepare_data_only: bool = field(default=False, metadata={"help": PREPARE_DATA_ONLY_HELP})

    def __post_init__(self) -> None:
        check_prepare_data_only(self)


# (model, data, training) arguments: main() parses them; the pipeline launcher reads their flag names.
ARGUMENT_CLASSES = (ModelArguments, PretrainingDataArguments, CausalLMTrainingArguments)
