#!/usr/bin/env python
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import EvalPrediction, PreTrainedConfig, PreTrainedTokenizerBase, TrainingArguments, set_seed

from lorakit.commands import command_line
from lorakit.core.cli import InputError, ReportedError, in_process_group, leave_process_group, run_cli
from lorakit.core.model_files import checkpoint_shapes
from lorakit.data.build_dataset import (
    DataCollatorForPreferencePairs,
    build_preference_dataset,
)
from lorakit.data.cache import data_cache_dir, report_prepared_data
from lorakit.data.splits import ValidationSplit, first_samples, held_out_check, split_validation
from lorakit.models.arguments import ModelArguments
from lorakit.models.heads import MASKABLE_ATTENTION, score_pairs
from lorakit.models.loader import choose_pad_token, load_model
from lorakit.records.chat_templates import ChatTemplate, parse_template_kwargs, use_template
from lorakit.records.readers import find_record_files
from lorakit.trainers.arguments import DeepSpeedChatDataArguments, ToolkitTrainingArguments
from lorakit.trainers.causal_lm import ResumableTrainer
from lorakit.trainers.checkpoints import SavePeftModelCallback, rank_zero_decides
from lorakit.trainers.common import padding_multiple, resolve_sequence_length, start_run, train_and_finish
from lorakit.trainers.reward_report import (
    PairRendering,
    ReportSet,
    pair_tokenizer,
    prepare_report,
    read_eval_sets,
    write_reward_report,
)

if TYPE_CHECKING:
    from lorakit.trainers.dpo import DPOArguments

logger = logging.getLogger(__name__)

@dataclass
class RewardDataArguments(DeepSpeedChatDataArguments):
    data_phase: int = field(default=2, metadata={"help": "Which part of --data_split this stage takes (2 = reward)."})


@dataclass
class RewardArguments(ToolkitTrainingArguments):
    reward_center_coef: float = field(
        default=0.0, metadata={"help": "Weight of mean((r_chosen + r_rejected)^2): keeps rewards centred on 0."}
    )
    merge_on_save: bool = field(
        default=False, metadata={"help": "Also write OUT/rm_merged_model: base + adapter merged, for PPO."}
    )
    share_pair_prefix: bool = field(
        default=True,
        metadata={"help": "One row per pair: the tokens chosen and rejected share (system prompt, question) run "
                          "once, the same scores for fewer tokens. Needs sdpa or eager attention; off otherwise."},
    )
    eval_sets: list[str] | None = field(
        default=None,
        metadata={"help": "Pair files, or directories of them, the end-of-training report (rm_report.*) also scores: "
                          "each file a set named by its stem (RewardBench's subsets as they are). Evaluation only.",
                  "nargs": "+"},
    )


class RewardTrainer(ResumableTrainer):
    """Pairwise loss -logsigmoid(r_chosen - r_rejected - margin) over batches holding each
    pair's chosen and rejected sequences together (one forward for both)."""

    def compute_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor | tuple[torch.Tensor, Any]:
        chosen, rejected = score_pairs(model, inputs)
        loss = -F.logsigmoid(chosen - rejected - inputs["margin"]).mean()
        if self.args.reward_center_coef:
            loss = loss + self.args.reward_center_coef * (chosen + rejected).pow(2).mean()
        return (loss, {"chosen": chosen, "rejected": rejected}) if return_outputs else loss

    def prediction_step(
        self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, scores = self.compute_loss(model, inputs, return_outputs=True)
        if prediction_loss_only:
            return loss.detach(), None, None
        pair_scores = torch.stack([scores["chosen"], scores["rejected"]], dim=1)
        # compute_metrics only runs when there are labels: the "label" of a pair is its order.
        return loss.detach(), pair_scores, torch.zeros(pair_scores.shape[0], device=pair_scores.device)


def preference_metrics(eval_prediction: EvalPrediction) -> dict[str, float]:
    scores = np.asarray(eval_prediction.predictions)
    chosen, rejected = scores[:, 0], scores[:, 1]
    return {
        "accuracy": float((chosen > rejected).mean()),
        "chosen_score": float(chosen.mean()),
        "rejected_score": float(rejected.mean()),
        "margin": float((chosen - rejected).mean()),
    }


def build_datasets(data_args: RewardDataArguments, tokenizer: PreTrainedTokenizerBase, chat_template: ChatTemplate,
                   max_length: int, seed: int) -> ValidationSplit:
    files = find_record_files(data_args.dataset_dir, data_args.data_path)
    if not files:
        raise InputError("no training data: give --dataset_dir or --data_path")
    common = {"tokenizer": tokenizer, "template": chat_template.text, "template_kwargs": chat_template.kwargs,
              "max_length": max_length, "cache_dir": data_cache_dir(data_args.data_cache_dir),
              "num_proc": data_args.preprocessing_num_workers}
    check = None if data_args.validation_file else held_out_check(data_args.validation_split_percentage, seed, "pairs")
    train = build_preference_dataset(files, data_split=data_args.data_split, data_phase=data_args.data_phase,
                                     seed=seed, check=check, **common)
    if data_args.validation_file:
        return ValidationSplit(train, build_preference_dataset(find_record_files(None, [data_args.validation_file]),
                                                            **common))
    return split_validation(train, data_args.validation_split_percentage, seed, "pairs")


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
    adapter = os.path.join(training_args.output_dir, "rm_lora_model")
    target = os.path.join(training_args.output_dir, "rm_merged_model")
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


# (model, data, training) arguments: main() parses them; the pipeline launcher reads their flag names.
ARGUMENT_CLASSES = (ModelArguments, RewardDataArguments, RewardArguments)


def pair_rendering(data_args: RewardDataArguments, tokenizer: PreTrainedTokenizerBase,
                   config: PreTrainedConfig) -> PairRendering:
    """The chat template (the pad token chosen for it) and the sequence length the pairs are tokenized with."""
    max_length = resolve_sequence_length("--max_seq_length", data_args.max_seq_length, config)
    chat_template = use_template(data_args.template, tokenizer,
                                 parse_template_kwargs(data_args.template_kwargs, data_args.enable_thinking))
    choose_pad_token(tokenizer, chat_template)
    return PairRendering(chat_template, max_length)


def prepared_pairs(data_args: RewardDataArguments, training_args: TrainingArguments, tokenizer: PreTrainedTokenizerBase,
                   config: PreTrainedConfig, rendering: PairRendering | None = None) -> ValidationSplit:
    """(train pairs, eval pairs or None), tokenized with the chat template (the pad token chosen for it), the
    main process first; shared with the DPO stage, which reads the same pairs."""
    chat_template, max_length = rendering or pair_rendering(data_args, tokenizer, config)
    set_seed(training_args.seed)
    with training_args.main_process_first(desc="tokenize the preference pairs"):
        train_dataset, eval_dataset = build_datasets(data_args, tokenizer, chat_template, max_length,
                                                     training_args.seed)
    train_dataset = first_samples(train_dataset, data_args.max_train_samples)
    eval_dataset = first_samples(eval_dataset, data_args.max_eval_samples)
    logger.info("train pairs: %d, eval pairs: %d", len(train_dataset), len(eval_dataset) if eval_dataset else 0)
    return ValidationSplit(train_dataset, eval_dataset)


def checked_eval_sets(data_args: RewardDataArguments, training_args: RewardArguments,
                      tokenizer: PreTrainedTokenizerBase, rendering: PairRendering) -> list[ReportSet]:
    """--eval_sets read and tokenized on rank 0 (given to every rank) before anything is written: a bad file is
    refused (file:line: field) before the training data is cached."""
    has_held_out = bool(data_args.validation_file) or data_args.validation_split_percentage > 0
    return rank_zero_decides(lambda: read_eval_sets(training_args.eval_sets, has_held_out,
                                                    pair_tokenizer(tokenizer, rendering),
                                                    data_args.preprocessing_num_workers))


def shares_pair_prefix(model: nn.Module, training_args: "RewardArguments | DPOArguments") -> bool:
    """One row per pair (the prompt once) where the attention implementation takes the pair mask."""
    attention = model.config._attn_implementation
    share_prefix = training_args.share_pair_prefix and attention in MASKABLE_ATTENTION
    if training_args.share_pair_prefix and not share_prefix:
        logger.info("%s attention takes no custom mask: each pair's prompt is run twice (two rows)", attention)
    return share_prefix


def main() -> None:
    model_args, data_args, training_args, resume_checkpoint, tokenizer, config = start_run(ARGUMENT_CLASSES,
                                                                                           task="reward")
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
