"""Child process of benchmarks/bench_dpo.py: one DPO training run, either

    trl_dpo_runner.py trl  CONFIG.json   TRL's DPOTrainer (LoRA via peft_config, the reference = the base
                                         with the adapter disabled), then its own evaluate()
    trl_dpo_runner.py ours SCRIPT ARGS.. scripts/training/run_dpo.py run as __main__ with ARGS

Both sides get trl_reward_runner's timing hook (each optimizer step's wall and CPU time, written
to $BENCH_TIMING_FILE); nothing else in either trainer is changed.
"""

from __future__ import annotations

import json
import os

from trl_reward_runner import runner_main


def run_trl(config_path: str) -> None:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    with open(config_path, encoding="utf-8") as handle:
        cfg = json.load(handle)
    out = cfg["output_dir"]
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    data = load_dataset("json", data_files={"train": cfg["train_file"], "eval": cfg["eval_file"]},
                        cache_dir=os.path.join(out, "hf_datasets"))
    args = DPOConfig(
        output_dir=out, max_steps=cfg["max_steps"], per_device_train_batch_size=cfg["batch_size"],
        per_device_eval_batch_size=cfg["batch_size"], learning_rate=cfg["learning_rate"], seed=cfg["seed"],
        max_length=cfg["max_length"], beta=cfg["beta"], loss_type=["sigmoid"],
        # DPOConfig turns bf16 and gradient checkpointing on by default: both sides run fp32 without.
        bf16=False, gradient_checkpointing=False, logging_steps=1, save_strategy="no", eval_strategy="no",
        report_to="none", use_cpu=True, dataloader_num_workers=0, model_init_kwargs={"dtype": torch.float32},
    )
    peft_config = LoraConfig(task_type="CAUSAL_LM", r=cfg["lora_rank"], lora_alpha=cfg["lora_alpha"],
                             lora_dropout=cfg["lora_dropout"], target_modules=cfg["lora_targets"])
    trainer = DPOTrainer(model=cfg["model"], args=args, train_dataset=data["train"], eval_dataset=data["eval"],
                         processing_class=tokenizer, peft_config=peft_config)
    train_result = trainer.train()
    metrics = dict(train_result.metrics)
    metrics["train_samples"] = len(trainer.train_dataset)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    eval_metrics = trainer.evaluate()
    eval_metrics["eval_samples"] = len(trainer.eval_dataset)
    trainer.save_metrics("eval", eval_metrics)


if __name__ == "__main__":
    runner_main(run_trl)
