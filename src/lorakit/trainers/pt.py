#!/usr/bin/env python
"""Continued pretraining of a LLaMA-family model with LoRA (optionally with trainable, resized
embeddings for an extended vocabulary), on every *.txt / *.jsonl file in --dataset_dir.

    torchrun --nproc_per_node 8 scripts/training/run_clm_pt_with_peft.py \
        --model_name_or_path BASE --dataset_dir DATA --data_cache_dir CACHE --block_size 1024 \
        --output_dir OUT --do_train --deepspeed ds_configs/ds_zero2_no_offload.json ...

Writes checkpoint-N/ (resumable, with checkpoint-N/pt_lora_model) and OUT/pt_lora_model/.
"""

import logging
from dataclasses import dataclass, field

from transformers import set_seed

from lorakit.core.cli import run_cli
from lorakit.data.build_dataset import (
    PREPARE_DATA_ONLY_HELP,
    DataCollatorForPretraining,
    build_pretraining_blocks,
    check_prepare_data_only,
)
from lorakit.data.cache import data_cache_dir, report_prepared_data
from lorakit.data.splits import first_samples, held_out_check, split_validation
from lorakit.models.arguments import ModelArguments
from lorakit.models.loader import load_model
from lorakit.trainers.arguments import CausalLMTrainingArguments
from lorakit.trainers.causal_lm import build_trainer
from lorakit.trainers.checkpoints import SavePeftModelCallback
from lorakit.trainers.common import resolve_sequence_length, start_run, train_and_finish

logger = logging.getLogger(__name__)


@dataclass
class DataArguments:
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
ARGUMENT_CLASSES = (ModelArguments, DataArguments, CausalLMTrainingArguments)


def main() -> None:
    model_args, data_args, training_args, resume_checkpoint, tokenizer, config = start_run(ARGUMENT_CLASSES)
    block_size = resolve_sequence_length("--block_size", data_args.block_size, config)
    set_seed(training_args.seed)

    with training_args.main_process_first(desc="tokenize and group the pretraining data"):
        blocks = build_pretraining_blocks(
            data_args.dataset_dir, tokenizer, block_size, data_cache_dir(data_args.data_cache_dir),
            data_args.preprocessing_num_workers,
            check=held_out_check(data_args.validation_split_percentage, training_args.seed, "blocks"),
        )
    if data_args.prepare_data_only:
        return report_prepared_data()
    train_dataset, eval_dataset = split_validation(blocks, data_args.validation_split_percentage, training_args.seed)
    train_dataset = first_samples(train_dataset, data_args.max_train_samples)
    eval_dataset = first_samples(eval_dataset, data_args.max_eval_samples)
    logger.info("train blocks: %d, eval blocks: %d", len(train_dataset), len(eval_dataset) if eval_dataset else 0)

    model = load_model(model_args, training_args, tokenizer, config=config)
    callbacks = [] if model_args.full_finetuning else [SavePeftModelCallback("pt_lora_model")]
    trainer = build_trainer(model, training_args, tokenizer, train_dataset, eval_dataset, DataCollatorForPretraining(),
                            callbacks)
    train_and_finish(trainer, resume_checkpoint, model_args.full_finetuning, eval_dataset, len(train_dataset))


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    run_cli(main)


if __name__ == "__main__":
    entry_point()
