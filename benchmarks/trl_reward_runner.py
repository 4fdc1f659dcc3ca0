"""Child process of benchmarks/bench_reward.py: one reward-model training run, either

    trl_reward_runner.py trl  CONFIG.json   TRL's RewardTrainer (LoRA via peft_config), then its own
                                            evaluate() and save_model()
    trl_reward_runner.py ours SCRIPT ARGS.. scripts/training/run_reward.py run as __main__ with ARGS

Both sides get the same timing hook: transformers.Trainer.train is wrapped so that a callback
records, for every optimizer step, its wall time (perf_counter) and this process's CPU time
(process_time, all threads) from on_step_begin to on_step_end, plus the same two clocks around the
whole train() call. Nothing else in either trainer is changed. The figures are written as JSON to
$BENCH_TIMING_FILE.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time


def install_timing_hook(path: str) -> None:
    import torch
    import transformers
    from transformers import TrainerCallback

    record = {"steps": [], "torch_threads": torch.get_num_threads()}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = (time.perf_counter(), time.process_time())

        def on_step_end(self, args, state, control, **kwargs):
            wall, cpu = self.started
            record["steps"].append({"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu})

    original_train = transformers.Trainer.train

    def timed_train(self, *args, **kwargs):
        self.add_callback(StepTimer())
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return original_train(self, *args, **kwargs)
        finally:
            record["train_call_wall_s"] = time.perf_counter() - wall
            record["train_call_cpu_s"] = time.process_time() - cpu
            with open(path, "w", encoding="utf-8") as handle:
                json.dump(record, handle, indent=2)

    transformers.Trainer.train = timed_train


def run_trl(config_path: str) -> None:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    with open(config_path, encoding="utf-8") as handle:
        cfg = json.load(handle)
    out = cfg["output_dir"]
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    data = load_dataset("json", data_files={"train": cfg["train_file"], "eval": cfg["eval_file"]},
                        cache_dir=os.path.join(out, "hf_datasets"))
    args = RewardConfig(
        output_dir=out,
        max_steps=cfg["max_steps"],
        per_device_train_batch_size=cfg["batch_size"],
        per_device_eval_batch_size=cfg["batch_size"],
        learning_rate=cfg["learning_rate"],
        seed=cfg["seed"],
        max_length=cfg["max_length"],
        # RewardConfig's own defaults differ from TrainingArguments' (and from ours): bf16 on and
        # gradient checkpointing on. The benchmark trains both sides in fp32 without checkpointing.
        bf16=False,
        gradient_checkpointing=cfg["activation_checkpointing"],
        logging_steps=cfg["logging_steps"],
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        use_cpu=True,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": torch.float32},
    )
    peft_config = LoraConfig(
        task_type="SEQ_CLS",
        r=cfg["lora_rank"],
        lora_alpha=cfg["lora_alpha"],
        lora_dropout=cfg["lora_dropout"],
        target_modules=cfg["lora_targets"],
    )
    trainer = RewardTrainer(model=cfg["model"], args=args, train_dataset=data["train"], eval_dataset=data["eval"],
                            processing_class=tokenizer, peft_config=peft_config)
    kept = {"train_pairs": len(trainer.train_dataset), "eval_pairs": len(trainer.eval_dataset)}
    train_result = trainer.train()
    metrics = dict(train_result.metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    eval_metrics = trainer.evaluate()
    trainer.save_metrics("eval", eval_metrics)
    trainer.save_model(os.path.join(out, "trl_model"))  # the adapter + the score head (modules_to_save)
    with open(os.path.join(out, "trl_dataset_sizes.json"), "w", encoding="utf-8") as handle:
        json.dump(kept, handle)


def runner_main(run_trl_job) -> None:
    """`runner.py trl ARGS_FILE` runs TRL's job, `runner.py ours SCRIPT ARGS...` our script, both timed."""
    install_timing_hook(os.environ["BENCH_TIMING_FILE"])
    mode = sys.argv[1]
    if mode == "trl":
        run_trl_job(sys.argv[2])
    elif mode == "ours":
        script = sys.argv[2]
        sys.argv = [script] + sys.argv[3:]
        runpy.run_path(script, run_name="__main__")
    else:
        raise SystemExit(f"unknown mode {mode!r}: trl or ours")


if __name__ == "__main__":
    runner_main(run_trl)
