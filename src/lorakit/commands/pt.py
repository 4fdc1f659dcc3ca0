"""Continued pretraining of a LLaMA-family model with LoRA (optionally with trainable, resized
embeddings for an extended vocabulary), on every *.txt / *.jsonl file in --dataset_dir.

    torchrun --nproc_per_node 8 scripts/training/run_clm_pt_with_peft.py \
        --model_name_or_path BASE --dataset_dir DATA --data_cache_dir CACHE --block_size 1024 \
        --output_dir OUT --do_train --deepspeed ds_configs/ds_zero2_no_offload.json ...

Writes checkpoint-N/ (resumable, with checkpoint-N/pt_lora_model) and OUT/pt_lora_model/.
"""

import logging

from transformers import TrainerCallback, set_seed

from lorakit.core.cli import run_cli
from lorakit.data.build_dataset import (
    DataCollatorForPretraining,
    build_pretraining_blocks,
)
from lorakit.data.cache import data_cache_dir, report_prepared_data
from lorakit.data.splits import first_samples, held_out_check, split_validation
from lorakit.models.loader import load_model
from lorakit.trainers.causal_lm import build_trainer
from lorakit.trainers.checkpoints import SavePeftModelCallback
from lorakit.trainers.common import resolve_sequence_length, start_run, train_and_finish
from lorakit.trainers.pt_config import ARGUMENT_CLASSES

logger = logging.getLogger(__name__)


def main() -> None:
    run = start_run(ARGUMENT_CLASSES)
    model_args, data_args, training_args = run.model_args, run.data_args, run.training_args
    resume_checkpoint, tokenizer, config = run.resume_checkpoint, run.tokenizer, run.config
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
    assert train_dataset is not None  # first_samples keeps a dataset it is given (typed Dataset | None for any)
    eval_dataset = first_samples(eval_dataset, data_args.max_eval_samples)
    logger.info("train blocks: %d, eval blocks: %d", len(train_dataset), len(eval_dataset) if eval_dataset else 0)

    model = load_model(model_args, training_args, tokenizer, config=config)
    callbacks: list[TrainerCallback] = [] if model_args.full_finetuning else [SavePeftModelCallback("pt_lora_model")]
    trainer = build_trainer(model, training_args, tokenizer, train_dataset, eval_dataset, DataCollatorForPretraining(),
                            callbacks)
    train_and_finish(trainer, resume_checkpoint, model_args.full_finetuning, eval_dataset, len(train_dataset))


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    run_cli(main)


if __name__ == "__main__":
    entry_point()
