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

The stage's batches and Trainer live here beside its arguments: preference pairs as the reward stage lays them out
(one row per pair with the shared prefix once, or two rows), each answer's log-probability summed over its own
tokens (the model's head runs on answer positions only: models.heads.answer_logps_forward), the loss of
models.dpo_losses, and TRL's metric names.

Reference: the same model with its LoRA adapter disabled (peft's disable_adapter, under no_grad),
or the log-probabilities computed once before training (precomputed_reference_logps) and carried
in the batches, after which no reference forward runs.
"""


from lorakit.core.cli import run_cli
from lorakit.data.cache import data_cache_dir, report_prepared_data
from lorakit.models.dpo_losses import REFERENCE_FREE
from lorakit.models.heads import use_chunked_loss
from lorakit.models.loader import load_model
from lorakit.trainers.checkpoints import SavePeftModelCallback
from lorakit.trainers.common import padding_multiple, start_run, train_and_finish
from lorakit.trainers.dpo_config import ARGUMENT_CLASSES
from lorakit.trainers.dpo_trainer import DataCollatorForAnswerLogps, DPOTrainer, check_reference, with_reference_logps
from lorakit.trainers.preference_pairs import prepared_pairs, shares_pair_prefix


def main() -> None:
    run = start_run(ARGUMENT_CLASSES, task="answer_logps", fold_adapter=True)
    model_args, data_args, training_args = run.model_args, run.data_args, run.training_args
    resume_checkpoint, tokenizer, config = run.resume_checkpoint, run.tokenizer, run.config
    check_reference(model_args, training_args)
    train_dataset, eval_dataset = prepared_pairs(data_args, training_args, tokenizer, config)
    if data_args.prepare_data_only:  # the reference log-probs (--precompute_ref_log_probs) need the model
        return report_prepared_data()

    # The reference is base + --peft_path: that adapter is folded into the base, a new LoRA trains on top.
    model = load_model(model_args, training_args, tokenizer, task="answer_logps", config=config,
                       fold_adapter=True)
    use_chunked_loss(model, training_args.chunked_loss)  # read by models.heads.answer_logps_forward
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
