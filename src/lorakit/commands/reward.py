"""Pairwise reward model with LoRA (DeepSpeed-Chat's step 2): the base or SFT-merged causal LM
loaded as a sequence classifier with one output, trained so that the chosen answer of each
pair scores above the rejected one.

    torchrun --nproc_per_node 8 scripts/training/run_reward.py \
        --model_name_or_path SFT_MERGED --dataset_dir PAIRS --max_seq_length 512 \
        --output_dir OUT --do_train --deepspeed ds_configs/ds_zero2_no_offload.json ...

Writes checkpoint-N/ (resumable), OUT/rm_lora_model/ (adapter + score head + tokenizer), the report of what the
model learned (OUT/rm_report.json, .md, .png: lorakit.trainers.reward_report) on the held-out pairs and --eval_sets,
and, with --merge_on_save, OUT/rm_merged_model/ (a plain model the PPO stage loads as reward/critic), merged by
scripts/merge/merge_llama_with_lora.py in a separate process once every rank is done.
"""

import logging
import os
import shlex
import shutil
import subprocess
import sys

import torch
from transformers import PreTrainedTokenizerBase

from lorakit.commands import command_line
from lorakit.core.cli import InputError, ReportedError, in_process_group, leave_process_group, run_cli
from lorakit.core.model_files import checkpoint_shapes
from lorakit.data.build_dataset import DataCollatorForPreferencePairs
from lorakit.data.cache import report_prepared_data
from lorakit.models.arguments import ModelArguments
from lorakit.models.loader import load_model
from lorakit.trainers.arguments import PreferenceDataArguments
from lorakit.trainers.checkpoints import SavePeftModelCallback, output_dir_of, rank_zero_decides
from lorakit.trainers.common import padding_multiple, start_run, train_and_finish
from lorakit.trainers.preference_pairs import PairRendering, pair_rendering, prepared_pairs, shares_pair_prefix
from lorakit.trainers.reward_config import ARGUMENT_CLASSES, RewardArguments
from lorakit.trainers.reward_report import (
    ReportSet,
    pair_tokenizer,
    prepare_report,
    read_eval_sets,
    write_reward_report,
)
from lorakit.trainers.reward_trainer import RewardTrainer, preference_metrics

logger = logging.getLogger(__name__)


def check_mergeable(model_args: ModelArguments, training_args: RewardArguments) -> None:
    """--merge_on_save reads the base's safetensors files: a base without any is refused before training, not
    after it."""
    base = model_args.model_name_or_path
    if training_args.merge_on_save and not model_args.full_finetuning and not checkpoint_shapes(base):
        raise InputError(f"{base}: --merge_on_save merges into safetensors weights and this --model_name_or_path has "
                         "none (pytorch_model*.bin?): re-save it with save_pretrained, or drop --merge_on_save")


def merge_after_every_rank(model_args: ModelArguments, training_args: RewardArguments) -> None:
    """--merge_on_save once the run is complete on every rank: the other ranks end (their last barrier), the main
    process destroys the process group and only then merges (save_merged), so that no rank waits at a barrier
    bounded by --ddp_timeout however long the merge of a large base takes."""
    is_main = training_args.should_save
    if in_process_group():
        if not is_main:
            leave_process_group()  # the last barrier, then this process ends
        torch.distributed.barrier()  # every rank's adapter, metrics and state are on disk
        torch.distributed.destroy_process_group()
        logger.info("every rank has finished: process group destroyed")
    if is_main:
        save_merged(model_args, training_args)


def save_merged(model_args: ModelArguments, training_args: RewardArguments) -> None:
    """OUT/rm_merged_model: the base + OUT/rm_lora_model folded by the streaming LoRA merge in a child process
    (tensor by tensor in bounded memory, in float32 rounded once to the base's dtype; the adapter's tokenizer
    and pad token; built in a temporary sibling and renamed into place when complete), replacing the one an
    earlier run left. A failed merge stops the run (exit status 1) with the merge's reason and the command that
    redoes it."""
    adapter = os.path.join(output_dir_of(training_args), "rm_lora_model")
    target = os.path.join(output_dir_of(training_args), "rm_merged_model")
    if os.path.isdir(target):
        logger.info("removing %s: merged from an earlier run's adapter", target)
        shutil.rmtree(target)
    command = [*command_line(sys.executable, "merge"), "--base_model", model_args.model_name_or_path,
               "--lora_model", adapter, "--output_dir", target]
    logger.info("merging in a separate process: %s", shlex.join(command))
    # Not a rank: its refusal goes to stderr, where it is read here, not to a launcher's per-rank error file.
    env = {name: value for name, value in os.environ.items() if name != "TORCHELASTIC_ERROR_FILE"}
    merge = subprocess.run(command, env=env, stderr=subprocess.PIPE, text=True, check=False)
    sys.stderr.write(merge.stderr)
    if merge.returncode != 0:
        reason = ([line for line in merge.stderr.splitlines() if line.strip()] or ["no message"])[-1]
        raise ReportedError(f"{target}: merging {adapter} into {model_args.model_name_or_path} failed (exit status "
                            f"{merge.returncode}: {reason.removeprefix('error: ')}); nothing was written there. The "
                            f"trained adapter is complete: merge it with {shlex.join(command)}")
    logger.info("merged reward model written to %s", target)


def checked_eval_sets(data_args: PreferenceDataArguments, training_args: RewardArguments,
                      tokenizer: PreTrainedTokenizerBase, rendering: PairRendering) -> list[ReportSet]:
    """--eval_sets read and tokenized on rank 0 (given to every rank) before anything is written: a bad file is
    refused (file:line: field) before the training data is cached."""
    has_held_out = bool(data_args.validation_file) or data_args.validation_split_percentage > 0
    return rank_zero_decides(lambda: read_eval_sets(training_args.eval_sets, has_held_out,
                                                    pair_tokenizer(tokenizer, rendering),
                                                    data_args.preprocessing_num_workers))


def main() -> None:
    run = start_run(ARGUMENT_CLASSES, task="reward")
    model_args, data_args, training_args = run.model_args, run.data_args, run.training_args
    resume_checkpoint, tokenizer, config = run.resume_checkpoint, run.tokenizer, run.config
    check_mergeable(model_args, training_args)
    rendering = pair_rendering(data_args, tokenizer, config)
    eval_sets = checked_eval_sets(data_args, training_args, tokenizer, rendering)
    train_dataset, eval_dataset = prepared_pairs(data_args, training_args, tokenizer, config, rendering)
    if data_args.prepare_data_only:
        return report_prepared_data()
    report_inputs = rank_zero_decides(lambda: prepare_report(data_args, training_args.seed, tokenizer, rendering,
                                                             eval_dataset, eval_sets))
    model = load_model(model_args, training_args, tokenizer, task="reward", config=config)
    share_prefix = shares_pair_prefix(model, training_args)
    trainer = RewardTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=DataCollatorForPreferencePairs(tokenizer.pad_token_id, padding_multiple(training_args),
                                                     share_prefix=share_prefix),
        compute_metrics=preference_metrics,
        callbacks=[] if model_args.full_finetuning else [SavePeftModelCallback("rm_lora_model")],
    )
    train_and_finish(trainer, resume_checkpoint, model_args.full_finetuning, eval_dataset, len(train_dataset))
    write_reward_report(trainer, report_inputs)
    if training_args.merge_on_save and not model_args.full_finetuning:
        merge_after_every_rank(model_args, training_args)


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    run_cli(main)


if __name__ == "__main__":
    entry_point()
