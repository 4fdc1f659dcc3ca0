"""Supervised fine-tuning with LoRA on conversations (alpaca, sharegpt or messages records),
loss on the assistant answers only, optionally packed into padding-free rows.

    torchrun --nproc_per_node 8 scripts/training/run_sft_with_peft.py \
        --model_name_or_path BASE --dataset_dir SFT_DATA --max_seq_length 1024 \
        --output_dir OUT --do_train --deepspeed ds_configs/ds_zero2_no_offload.json ...

Writes checkpoint-N/ (resumable, with checkpoint-N/sft_lora_model) and OUT/sft_lora_model/,
whose tokenizer carries the chat template used in training.
"""

import logging
from typing import Any

from transformers import PreTrainedTokenizerBase, TrainerCallback, set_seed

from lorakit.core.cli import InputError, run_cli
from lorakit.data.build_dataset import (
    DataCollatorForSupervisedDataset,
    build_sft_dataset,
    cached_packed_rows,
    check_packing_attention,
)
from lorakit.data.cache import data_cache_dir, report_prepared_data
from lorakit.data.splits import ValidationSplit, first_samples, held_out_check, split_validation
from lorakit.models.loader import choose_pad_token, load_model
from lorakit.records.chat_templates import ChatTemplate, parse_template_kwargs, use_template
from lorakit.records.readers import find_record_files
from lorakit.trainers.causal_lm import build_trainer
from lorakit.trainers.checkpoints import SavePeftModelCallback
from lorakit.trainers.common import padding_multiple, resolve_sequence_length, start_run, train_and_finish
from lorakit.trainers.sft_config import ARGUMENT_CLASSES, SFTDataArguments
from lorakit.trainers.token_batches import check_token_budget

logger = logging.getLogger(__name__)


def build_datasets(data_args: SFTDataArguments, tokenizer: PreTrainedTokenizerBase, chat_template: ChatTemplate,
                   max_length: int, seed: int) -> ValidationSplit:
    train_files = find_record_files(data_args.dataset_dir, data_args.data_path)
    unsplit = find_record_files(None, data_args.sft_only_data_path)
    if not train_files and not unsplit:
        raise InputError("no training data: give --dataset_dir, --data_path or --sft_only_data_path")
    common: dict[str, Any] = {"tokenizer": tokenizer, "template": chat_template.text,
                              "template_kwargs": chat_template.kwargs, "max_length": max_length,
                              "cache_dir": data_cache_dir(data_args.data_cache_dir),
                              "num_proc": data_args.preprocessing_num_workers}
    train = build_sft_dataset(
        train_files + unsplit, train_on_last_turn_only=data_args.train_on_last_turn_only,
        data_split=data_args.data_split, data_phase=data_args.data_phase, seed=seed, unsplit_files=tuple(unsplit),
        check=None if data_args.validation_file else held_out_check(data_args.validation_split_percentage, seed,
                                                                    "samples"),
        **common,
    )
    if data_args.validation_file:
        evaluation = build_sft_dataset(find_record_files(None, [data_args.validation_file]), **common)
    else:
        train, evaluation = split_validation(train, data_args.validation_split_percentage, seed, "samples")
    return ValidationSplit(train, evaluation)


def main() -> None:
    run = start_run(ARGUMENT_CLASSES)
    model_args, data_args, training_args = run.model_args, run.data_args, run.training_args
    resume_checkpoint, tokenizer, config = run.resume_checkpoint, run.tokenizer, run.config
    if training_args.packing:
        check_packing_attention(model_args.attn_implementation)
    max_length = resolve_sequence_length("--max_seq_length", data_args.max_seq_length, config)
    if training_args.max_tokens_per_batch:
        check_token_budget(training_args.max_tokens_per_batch, max_length, padding_multiple(training_args))
    chat_template = use_template(data_args.template, tokenizer,
                                 parse_template_kwargs(data_args.template_kwargs, data_args.enable_thinking))
    pad_id = choose_pad_token(tokenizer, chat_template)  # before loading: the model config takes it
    set_seed(training_args.seed)

    with training_args.main_process_first(desc="tokenize and pack the supervised data"):
        train_dataset, eval_dataset = build_datasets(data_args, tokenizer, chat_template, max_length,
                                                     training_args.seed)
        train_dataset = first_samples(train_dataset, data_args.max_train_samples)
        if training_args.packing:
            train_dataset = cached_packed_rows(train_dataset, max_length, data_cache_dir(data_args.data_cache_dir))
    if data_args.prepare_data_only:
        return report_prepared_data()
    eval_dataset = first_samples(eval_dataset, data_args.max_eval_samples)
    logger.info("train rows: %d, eval samples: %d", len(train_dataset), len(eval_dataset) if eval_dataset else 0)

    model = load_model(model_args, training_args, tokenizer, config=config)
    # A KV cache in a training forward would also stop position_ids from separating packed samples.
    model.config.use_cache = False
    callbacks: list[TrainerCallback] = [] if model_args.full_finetuning else [SavePeftModelCallback("sft_lora_model")]
    # The model's attention: under a flash one, packed batches carry their samples' bounds.
    collator = DataCollatorForSupervisedDataset(pad_id, padding_multiple(training_args),
                                                model.config._attn_implementation)
    trainer = build_trainer(model, training_args, tokenizer, train_dataset, eval_dataset, collator, callbacks)
    train_and_finish(trainer, resume_checkpoint, model_args.full_finetuning, eval_dataset, len(train_dataset))


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    run_cli(main)


if __name__ == "__main__":
    entry_point()
