#!/usr/bin/env python
"""Direct preference optimisation with LoRA (DPO and its variants: IPO, hinge, robust, SimPO, ORPO,
RPO's NLL term): the SFT model learns from preference pairs without a reward model or PPO. The
policy is the SFT model (a merged SFT model, or the base with --peft_path SFT_ADAPTER folded in in
memory) with a new LoRA; the reference is the same model with that LoRA disabled.

    torchrun --nproc_per_node 8 scripts/training/run_dpo.py \
        --model_name_or_path BASE --peft_path SFT_OUT/sft_lora_model --dataset_dir PAIRS \
        --max_seq_length 512 --output_dir OUT --do_train --deepspeed ds_configs/ds_zero2_no_offload.json ...

Reads the reward stage's pair formats (same readers, templates, --data_split phase 2). Writes
checkpoint-N/ (resumable) and OUT/dpo_lora_model/ (adapter + tokenizer); merge with
scripts/merge/merge_llama_with_lora.py --lora_model SFT_ADAPTER,OUT/dpo_lora_model (or just the
DPO adapter on a merged SFT model).
"""

import logging
from dataclasses import dataclass, field

from transformers.integrations import is_deepspeed_zero3_enabled

from lorakit.core.cli import InputError, run_cli
from lorakit.data.cache import data_cache_dir, report_prepared_data
from lorakit.models.dpo_losses import LOSS_TYPES, REFERENCE_FREE
from lorakit.models.loader import ModelArguments, load_model
from lorakit.trainers.checkpoints import SavePeftModelCallback
from lorakit.trainers.common import (
    CausalLMTrainingArguments,
    padding_multiple,
    start_run,
    train_and_finish,
)
from lorakit.trainers.dpo_trainer import DataCollatorForAnswerLogps, DPOTrainer, with_reference_logps
from lorakit.trainers.reward import RewardDataArguments, prepared_pairs, shares_pair_prefix

logger = logging.getLogger(__name__)


@dataclass
class DPOArguments(CausalLMTrainingArguments):
    """Training arguments (--chunked_loss: the answers' log-probabilities) plus the preference loss (names as
    TRL's DPOConfig / CPOConfig)."""

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

    def __post_init__(self):
        if self.beta <= 0:
            raise InputError(f"--beta must be positive, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise InputError(f"--label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.rpo_alpha < 0:
            raise InputError(f"--rpo_alpha must not be negative, got {self.rpo_alpha}")
        super().__post_init__()


# (model, data, training) arguments: main() parses them; the pipeline launcher reads their flag names.
ARGUMENT_CLASSES = (ModelArguments, RewardDataArguments, DPOArguments)


def check_reference(model_args, training_args) -> None:
    needs_reference = training_args.loss_type not in REFERENCE_FREE
    if model_args.full_finetuning and needs_reference and not training_args.precompute_ref_log_probs:
        raise InputError(f"--full_finetuning with --loss_type {training_args.loss_type}: the reference is the model "
                         "with its LoRA disabled; add --precompute_ref_log_probs, or use LoRA")
    if training_args.precompute_ref_log_probs and needs_reference and is_deepspeed_zero3_enabled():
        raise InputError("--precompute_ref_log_probs runs the model before DeepSpeed partitions it: use ZeRO-2, or "
                         "leave it out under ZeRO-3 (the reference is then the model with its LoRA disabled)")


def main():
    model_args, data_args, training_args, resume_checkpoint, tokenizer, config = start_run(
        ARGUMENT_CLASSES, task="answer_logps", fold_adapter=True)
    check_reference(model_args, training_args)
    train_dataset, eval_dataset = prepared_pairs(data_args, training_args, tokenizer, config)
    if data_args.prepare_data_only:  # the reference log-probs (--precompute_ref_log_probs) need the model
        return report_prepared_data()

    # The reference is base + --peft_path: that adapter is folded into the base, a new LoRA trains on top.
    model = load_model(model_args, training_args, tokenizer, task="answer_logps", config=config,
                       fold_adapter=True)
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    causal_lm.chunked_loss = training_args.chunked_loss  # read by model_utils.answer_logps_forward
    share_prefix = shares_pair_prefix(model, training_args)
    collator = DataCollatorForAnswerLogps(tokenizer.pad_token_id, padding_multiple(training_args),
                                          share_prefix=share_prefix)
    if training_args.precompute_ref_log_probs and training_args.loss_type not in REFERENCE_FREE:
        cache = data_cache_dir(data_args.data_cache_dir)
        train_dataset = with_reference_logps(train_dataset, model, collator, training_args, model_args, cache)
        if eval_dataset is not None:
            eval_dataset = with_reference_logps(eval_dataset, model, collator, training_args, model_args, cache)
    trainer = DPOTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=collator,
        callbacks=[] if model_args.full_finetuning else [SavePeftModelCallback("dpo_lora_model")],
    )
    train_and_finish(trainer, resume_checkpoint, model_args.full_finetuning, eval_dataset, len(train_dataset))


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    run_cli(main)


if __name__ == "__main__":
    entry_point()
