"""Arguments of short LoRA runs of the pretraining and SFT scripts on conftest's tiny model."""

import json
import os

from helpers.commands import KILL_WRAPPER, options_to_argv

TINY_TRAINING_OPTIONS = {
    "per_device_train_batch_size": 4,
    "per_device_eval_batch_size": 8,
    "learning_rate": 3e-3,
    "max_steps": 10,
    "warmup_steps": 0,
    "lr_scheduler_type": "constant",
    "logging_steps": 1,
    "save_steps": 5,
    "seed": 42,
    "lora_rank": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.05,
    "torch_dtype": "float32",
    "report_to": "none",
    "dataloader_num_workers": 0,
}


def tiny_pt_args(model_dir, data_dir, output_dir, cache_dir, **overrides) -> list:
    """Arguments of a short LoRA pretraining run on the tiny model."""
    options = {"model_name_or_path": model_dir, "dataset_dir": data_dir, "data_cache_dir": cache_dir,
               "output_dir": output_dir, "block_size": 32, "validation_split_percentage": 10,
               **TINY_TRAINING_OPTIONS, **overrides}
    return ["--do_train", "--use_cpu"] + options_to_argv(options)


def tiny_sft_args(model_dir, output_dir, cache_dir, **overrides) -> list:
    """Arguments of a short LoRA SFT run on the tiny model."""
    options = {"model_name_or_path": model_dir, "data_cache_dir": cache_dir, "output_dir": output_dir,
               "max_seq_length": 256, **TINY_TRAINING_OPTIONS, **overrides}
    return ["--do_train", "--use_cpu"] + options_to_argv(options)


def small_chunks_wrapper(model_dir, positions: int) -> list:
    """helpers/run_and_kill.py setting the chunked loss to `positions` positions a chunk on model_dir's
    vocabulary (the tiny model's would otherwise fit a whole batch in one chunk)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as handle:
        vocabulary = json.load(handle)["vocab_size"]
    return [KILL_WRAPPER, "--logits_per_chunk", str(positions * vocabulary)]
