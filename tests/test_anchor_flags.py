"""Peers' command lines run unchanged (issue 18): Chinese-LLaMA-Alpaca-2's run_pt.sh and run_sft.sh, flag for
flag (paths and step counts substituted), train on the tiny model under torchrun with DeepSpeed on a CPU; every
flag of theirs and of DeepSpeed-Chat's step scripts that transformers 5 does not know is mapped (the parsed
arguments and the 'flag mapped' note) or refused in one line naming our equivalent."""

import json
import math
import os

import pytest
import torch
from transformers import AutoTokenizer
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from helpers.commands import (
    REPO,
    SFT_SCRIPT,
    assert_ok,
    check_refused,
    free_port,
    run_in_process,
    run_script,
)
from helpers.run_outputs import adapter_weights, log_history
from lorakit.core.cli import InputError, parse_args
from lorakit.demo.sft_tasks import arithmetic_records
from lorakit.models.arguments import ModelArguments
from lorakit.records.chat_templates import named_template

ZERO2 = os.path.join(REPO, "ds_configs", "ds_zero2_no_offload.json")
CHAT_SCRIPT = os.path.join(REPO, "scripts", "inference", "chat.py")
MERGE_SCRIPT = os.path.join(REPO, "scripts", "merge", "merge_llama_with_lora.py")


def torchrun_one_process() -> list:
    """The anchor's launcher line: torchrun --nnodes 1 --nproc_per_node 1 (DeepSpeed needs a launcher)."""
    return ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "1", "--master_port", str(free_port())]


def lora_options(output_dir) -> list:
    """The tail both anchor scripts share, in their order (values theirs, the output directory ours)."""
    return ["--output_dir", output_dir, "--overwrite_output_dir", "--ddp_timeout", "30000",
            "--logging_first_step", "True", "--lora_rank", "64", "--lora_alpha", "128",
            "--trainable", "q_proj,v_proj,k_proj,o_proj,gate_proj,down_proj,up_proj", "--lora_dropout", "0.05",
            "--modules_to_save", "embed_tokens,lm_head", "--torch_dtype", "float16"]


def run_pt_sh(model_dir, data_dir, cache_dir, output_dir) -> list:
    """Chinese-LLaMA-Alpaca-2's scripts/training/run_pt.sh; steps 200 -> 2, accumulation 8 -> 2, block 512 -> 32."""
    return ["--deepspeed", ZERO2, "--model_name_or_path", model_dir, "--tokenizer_name_or_path", model_dir,
            "--dataset_dir", data_dir, "--data_cache_dir", cache_dir, "--validation_split_percentage", "0.001",
            "--per_device_train_batch_size", "1", "--do_train", "--seed", "14159", "--fp16",
            "--num_train_epochs", "1", "--lr_scheduler_type", "cosine", "--learning_rate", "2e-4",
            "--warmup_ratio", "0.05", "--weight_decay", "0.01", "--logging_strategy", "steps", "--logging_steps", "1",
            "--save_strategy", "steps", "--save_total_limit", "3", "--save_steps", "2",
            "--gradient_accumulation_steps", "2", "--preprocessing_num_workers", "8", "--block_size", "32",
            *lora_options(output_dir), "--load_in_kbits", "16", "--save_safetensors", "False",
            "--gradient_checkpointing", "--ddp_find_unused_parameters", "False", "--max_steps", "2"]


def run_sft_sh(model_dir, data_dir, validation_file, output_dir) -> list:
    """Chinese-LLaMA-Alpaca-2's scripts/training/run_sft.sh; steps 100/200 -> 2, accumulation 8 -> 2,
    length 512 -> 256 (the tiny model's positions)."""
    return ["--deepspeed", ZERO2, "--model_name_or_path", model_dir, "--tokenizer_name_or_path", model_dir,
            "--dataset_dir", data_dir, "--per_device_train_batch_size", "1", "--per_device_eval_batch_size", "1",
            "--do_train", "--do_eval", "--seed", "14159", "--fp16", "--num_train_epochs", "1",
            "--lr_scheduler_type", "cosine", "--learning_rate", "1e-4", "--warmup_ratio", "0.03",
            "--weight_decay", "0", "--logging_strategy", "steps", "--logging_steps", "1", "--save_strategy", "steps",
            "--save_total_limit", "3", "--evaluation_strategy", "steps", "--eval_steps", "2", "--save_steps", "2",
            "--gradient_accumulation_steps", "2", "--preprocessing_num_workers", "8", "--max_seq_length", "256",
            *lora_options(output_dir), "--validation_file", validation_file, "--load_in_kbits", "16",
            "--save_safetensors", "False", "--gradient_checkpointing", "--ddp_find_unused_parameters", "False",
            "--max_steps", "2"]


ON_CPU = not torch.accelerator.is_available()
# What both command lines must report; on a CPU, --fp16 and float16 weights become float32 (a GPU keeps them).
COMMON_NOTES = ["--gradient_checkpointing -> --activation_checkpointing",
                "--save_safetensors False accepted"] + (
    ["--fp16 -> float32 compute", "--torch_dtype float16 -> --torch_dtype float32"] if ON_CPU else [])


def check_anchor_run(result, output_dir, adapter: str, notes: list) -> None:
    """Trained: two finite losses, a DeepSpeed checkpoint, the rank-64 adapter with its embeddings (in float32 on
    a CPU); every mapping reported."""
    assert_ok(result)
    for note in notes:
        assert f"flag mapped: {note}" in result.stdout, note
    losses = [entry["loss"] for entry in log_history(output_dir) if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) and loss > 0 for loss in losses), losses
    assert (output_dir / "checkpoint-2" / "global_step2").is_dir()  # DeepSpeed's engine saved it
    weights = adapter_weights(output_dir / adapter)
    lora_a = next(value for key, value in weights.items() if key.endswith("q_proj.lora_A.weight"))
    assert lora_a.shape[0] == 64
    assert any("embed_tokens" in key for key in weights) and any("lm_head" in key for key in weights)
    if ON_CPU:
        assert {value.dtype for value in weights.values()} == {torch.float32}


@pytest.mark.slow
def test_run_pt_sh_trains(tiny_model_dir, pretrain_dir, tmp_path):
    out = tmp_path / "out"
    result = run_script(run_pt_sh(tiny_model_dir, pretrain_dir, str(tmp_path / "cache"), str(out)),
                        wrapper=torchrun_one_process())
    check_anchor_run(result, out, "pt_lora_model", COMMON_NOTES + ["--warmup_ratio 0.05 -> --warmup_steps 0.05"])


@pytest.mark.slow  # 36 s on 2 cores: the wrappers' bad-input tests stay in the fast tier
def test_run_sft_sh_trains_and_evaluates(tiny_model_dir, tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in arithmetic_records(32, 0)))
    (tmp_path / "valid.json").write_text(json.dumps(arithmetic_records(4, 99)))
    out = tmp_path / "out"
    args = run_sft_sh(tiny_model_dir, str(tmp_path / "train"), str(tmp_path / "valid.json"), str(out))
    result = run_script(args, script=SFT_SCRIPT, wrapper=torchrun_one_process())
    check_anchor_run(result, out, "sft_lora_model", COMMON_NOTES + ["--warmup_ratio 0.03 -> --warmup_steps 0.03",
                                                                    "--evaluation_strategy steps -> --eval_strategy"])
    evaluated = [entry["step"] for entry in log_history(out) if "eval_loss" in entry]
    assert evaluated[0] == 2 and all(math.isfinite(e["eval_loss"]) for e in log_history(out) if "eval_loss" in e)


# ----------------------------------------------------------------------------- DeepSpeed-Chat's step flags


def stage_classes(stage: str) -> tuple:
    from lorakit.rl import ppo_config
    from lorakit.trainers import reward_config, sft_config
    from lorakit.trainers.arguments import PreferenceDataArguments

    return {"sft": (ModelArguments, sft_config.SFTDataArguments, sft_config.SFTArguments),
            "reward": (ModelArguments, PreferenceDataArguments, reward_config.RewardArguments),
            "ppo": (ppo_config.PPOModelArguments, ppo_config.PPODataArguments, ppo_config.PPOArguments)}[stage]


def parse_stage(stage: str, argv: list, output_dir) -> tuple:
    """(the parsed dataclasses, every 'flag mapped' note) of a stage's command line, in this process."""
    models = (["--actor_model_name_or_path", "a", "--reward_model_name_or_path", "r"] if stage == "ppo"
              else ["--model_name_or_path", "m"])
    parsed = parse_args(stage_classes(stage), models + ["--output_dir", str(output_dir), *argv])
    # A ZeRO-3 config registers itself process-wide (is_deepspeed_zero3_enabled): not for the tests that follow.
    unset_hf_deepspeed_config()
    return parsed, [note for arguments in parsed for note in getattr(arguments, "mapped_flags", [])]


def value_of(parsed: tuple, name: str):
    return getattr(next(arguments for arguments in parsed if hasattr(arguments, name)), name)


def ds_config(name: str) -> str:
    return os.path.realpath(os.path.join(REPO, "ds_configs", name))  # the package's file, which ds_configs/ links to


DEEPSPEED_CHAT_MAPPED = [
    # (stage: step 1 SFT, 2 reward, 3 PPO; their flags; what they set here; the note)
    ("sft", ["--zero_stage", "2"], {"deepspeed": ds_config("ds_zero2_no_offload.json")},
     "--zero_stage 2 -> --deepspeed"),
    ("sft", ["--zero_stage", "3"], {"deepspeed": ds_config("ds_zero3_no_offload.json")},
     "--zero_stage 3 -> --deepspeed"),
    ("reward", ["--zero_stage", "3", "--offload"], {"deepspeed": ds_config("ds_zero3_offload.json")},
     "--zero_stage 3 --offload -> --deepspeed"),
    ("sft", ["--zero_stage", "0"], {"deepspeed": None}, "--zero_stage 0 -> no --deepspeed"),
    # DeepSpeed-Chat's bare --deepspeed switch, before another flag and last on the line.
    ("sft", ["--deepspeed", "--zero_stage", "2"], {"deepspeed": ds_config("ds_zero2_no_offload.json")},
     "--deepspeed (DeepSpeed-Chat's switch) accepted"),
    ("reward", ["--zero_stage", "3", "--deepspeed"], {"deepspeed": ds_config("ds_zero3_no_offload.json")},
     "--zero_stage 3 -> --deepspeed"),
    ("sft", ["--deepspeed"], {"deepspeed": None}, "--deepspeed (DeepSpeed-Chat's switch) accepted"),
    ("sft", ["--lora_dim", "128"], {"lora_rank": 128, "full_finetuning": False}, "--lora_dim 128 -> --lora_rank 128"),
    ("reward", ["--lora_dim", "0"], {"full_finetuning": True}, "--lora_dim 0 -> --full_finetuning"),
    ("sft", ["--lora_module_name", "decoder.layers."], {"trainable": "all-linear"},
     "--lora_module_name decoder.layers. -> --trainable all-linear"),
    ("reward", ["--lora_module_name", "layers."], {"trainable": "all-linear"}, "-> --trainable all-linear"),
    ("sft", ["--only_optimize_lora"], {"trainable": "all-linear"}, "--only_optimize_lora accepted"),
    ("sft", ["--max_seq_len", "512"], {"max_seq_length": 512}, "--max_seq_len 512 -> --max_seq_length 512"),
    ("reward", ["--max_seq_len", "128"], {"max_seq_length": 128}, "--max_seq_len 128 -> --max_seq_length 128"),
    ("reward", ["--num_padding_at_beginning", "1"], {}, "--num_padding_at_beginning 1 accepted"),
    ("sft", ["--num_warmup_steps", "100"], {"warmup_steps": 100}, "--num_warmup_steps 100 -> --warmup_steps 100"),
    ("sft", ["--dtype", "fp16"], {"fp16": not ON_CPU}, "--dtype fp16 -> --fp16"),
    ("reward", ["--dtype", "bf16", "--use_cpu"], {"bf16": True}, "--dtype bf16 -> --bf16"),
    ("sft", ["--dtype", "fp32"], {"fp16": False, "bf16": False}, "--dtype fp32 -> no --fp16/--bf16"),
    ("sft", ["--gradient_checkpointing"], {"activation_checkpointing": True},
     "--gradient_checkpointing -> --activation_checkpointing"),
    ("ppo", ["--actor_zero_stage", "3", "--critic_zero_stage", "3", "--offload"],
     {"deepspeed": ds_config("ds_zero3_offload.json")}, "--critic_zero_stage 3 -> --zero_stage 3"),
    ("ppo", ["--actor_lora_dim", "64", "--critic_lora_dim", "64"], {"lora_rank": 64},
     "--actor_lora_dim 64 -> --lora_rank 64"),
    ("ppo", ["--enable_hybrid_engine"], {}, "--enable_hybrid_engine -> rollouts decode"),
    ("ppo", ["--num_padding_at_beginning", "1", "--only_optimize_lora"], {}, "--num_padding_at_beginning 1 accepted"),
    ("ppo", ["--model_name_or_path", "a", "--per_device_train_batch_size", "4", "--learning_rate", "1e-5"],
     {"per_device_training_batch_size": 4, "actor_learning_rate": 1e-5},
     "--learning_rate 1e-05 -> --actor_learning_rate"),
]


@pytest.mark.parametrize("stage, argv, expected, note", DEEPSPEED_CHAT_MAPPED)
def test_deepspeed_chat_flags_are_mapped(stage, argv, expected, note, tmp_path):
    parsed, notes = parse_stage(stage, argv, tmp_path / "out")
    assert {name: value_of(parsed, name) for name in expected} == expected
    assert any(note in line for line in notes), notes


DEEPSPEED_CHAT_REFUSED = [
    ("sft", ["--zero_stage", "1"], "--zero_stage 1: ds_configs/ ships no DeepSpeed config for it"),
    ("reward", ["--zero_stage", "2", "--offload"], "pass it with --deepspeed"),
    ("sft", ["--offload"], "--offload goes with --zero_stage 3"),
    ("sft", ["--zero_stage", "2", "--deepspeed", "my_ds.json"], "--zero_stage 2 and --deepspeed my_ds.json both given"),
    ("sft", ["--lora_module_name", "q_proj"], "name the layers with --trainable"),
    ("sft", ["--lora_dim", "16", "--lora_rank", "4"], "--lora_dim 16 means --lora_rank 16"),
    ("reward", ["--dtype", "fp16", "--bf16"], "--dtype fp16 and --bf16 both given"),
    ("sft", ["--warmup_ratio", "0.1", "--num_warmup_steps", "10"], "--num_warmup_steps 10 and --warmup_ratio 0.1"),
    ("ppo", ["--actor_zero_stage", "3", "--critic_zero_stage", "2"], "means --zero_stage 2; give only one (one "
     "DeepSpeed engine"),
    ("ppo", ["--actor_lora_dim", "64", "--critic_lora_dim", "128"], "means --lora_rank 128"),
    ("ppo", ["--actor_lora_dim", "0"], "PPO trains LoRA adapters"),
]


@pytest.mark.parametrize("stage, argv, message", DEEPSPEED_CHAT_REFUSED)
def test_deepspeed_chat_flags_without_an_equivalent_are_refused(stage, argv, message, tmp_path):
    with pytest.raises(InputError) as refused:
        parse_stage(stage, argv, tmp_path / "out")
    assert message in str(refused.value)


def test_a_refusal_is_one_line_and_exit_2(tiny_model_dir, tmp_path):
    """The parse-time refusals go through run_cli like any bad input: one line, exit 2, nothing written."""
    out = tmp_path / "out"
    result = run_in_process(SFT_SCRIPT, ["--model_name_or_path", tiny_model_dir, "--output_dir", out,
                                         "--zero_stage", "2", "--offload"])
    check_refused(result, "--zero_stage 2 --offload: ds_configs/ ships no DeepSpeed config")
    assert not out.exists()
    merged = tmp_path / "merged"
    result = run_in_process(MERGE_SCRIPT, ["--base_model", tiny_model_dir, "--lora_model", tiny_model_dir,
                                           "--output_dir", merged, "--output_type", "pth"])
    check_refused(result, "--output_type pth: the merge writes the huggingface layout only")
    assert not merged.exists()


# ----------------------------------------------------------------------------- inference flags


def chat_arguments(argv: list) -> tuple:
    from lorakit.serve import chat_config as chat

    parsed = parse_args((chat.InferenceModelArguments, chat.ChatArguments), ["--base_model", "b", *argv])
    return parsed, [note for arguments in parsed for note in arguments.mapped_flags]


INFERENCE_MAPPED = [
    (["--tokenizer_path", "tok"], {"tokenizer_path": "tok"}, None),
    (["--load_in_8bit"], {"load_in_kbits": 8}, "--load_in_8bit -> --load_in_kbits 8"),
    (["--load_in_4bit"], {"load_in_kbits": 4}, "--load_in_4bit -> --load_in_kbits 4"),
    (["--only_cpu"], {"device": "cpu"}, "--only_cpu -> --device cpu"),
    (["--gpus", ""], {"device": "cpu"}, "--gpus '' -> --device cpu"),
    (["--gpus", "1"], {"device": "cuda:1" if torch.cuda.is_available() else "cpu"}, "--gpus 1 -> --device"),
    (["--with_prompt"], {}, "--with_prompt accepted: every prompt is rendered with the chat template"),
    (["--interactive"], {}, "--interactive accepted: without --data_file the chat is interactive"),
]


@pytest.mark.parametrize("argv, expected, note", INFERENCE_MAPPED)
def test_inference_flags_are_mapped(argv, expected, note):
    parsed, notes = chat_arguments(argv)
    assert {name: value_of(parsed, name) for name in expected} == expected
    assert note is None or any(note in line for line in notes), notes


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0,1"], "choose it with --device cuda:N"),
    (["--load_in_8bit", "--load_in_4bit"], "--load_in_4bit and --load_in_8bit both given"),
    (["--only_cpu", "--device", "cuda"], "--only_cpu means --device cpu"),
    (["--interactive", "--data_file", "prompts.jsonl"], "--interactive and --data_file both given"),
])
def test_inference_flags_without_an_equivalent_are_refused(argv, message):
    with pytest.raises(InputError) as refused:
        chat_arguments(argv)
    assert message in str(refused.value)


def test_chat_runs_with_the_anchor_inference_flags(tiny_model_dir, tmp_path):
    """inference_hf.py's flags answer a file of prompts: the tokenizer comes from --tokenizer_path (the only
    directory with a chat template, so the run would be refused without it), on the CPU; --gpus 0,1 is refused
    through run_cli in one line."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = named_template("llama2", tokenizer)
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    prompts, predictions = tmp_path / "prompts.jsonl", tmp_path / "predictions.jsonl"
    prompts.write_text('{"prompt": "What is 2 + 3?"}\n{"prompt": "你好"}\n', encoding="utf-8")
    base = ["--base_model", tiny_model_dir, "--tokenizer_path", tmp_path / "tokenizer", "--only_cpu", "--with_prompt"]
    result = run_in_process(CHAT_SCRIPT, base + ["--data_file", prompts, "--predictions_file", predictions,
                                                 "--max_new_tokens", "3", "--temperature", "0"])
    assert_ok(result)
    assert "flag mapped: --only_cpu -> --device cpu" in result.stderr
    assert "flag mapped: --with_prompt accepted" in result.stderr
    answers = [json.loads(line) for line in predictions.read_text(encoding="utf-8").splitlines()]
    assert [answer["prompt"] for answer in answers] == ["What is 2 + 3?", "你好"]
    check_refused(run_in_process(CHAT_SCRIPT, base[:4] + ["--gpus", "0,1"]), "--gpus 0,1: the model runs on one device")
