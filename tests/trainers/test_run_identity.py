"""A resume continues the same run or refuses (issue 29): the run identity holds each model's and adapter's weights
(a content fingerprint, memoized by stat signature: a second run only stats the files), the sample order, the
optimizer and precision, and each stage's objective; --resume_from_checkpoint false never resumes; a checkpoint
file damaged at the same size is refused; adapters record their base's weights, and merge and serving refuse
another base; a checkpoint of the earlier marker format resumes with one line naming what it could not check."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.commands import (
    PT_SCRIPT,
    REPO,
    TRAINING,
    assert_ok,
    check_refused,
    options_to_argv,
    run_in_process,
    run_script,
    script_env,
)
from helpers.run_outputs import snapshot
from helpers.tiny_runs import tiny_pt_args

PPO_SCRIPT = os.path.join(TRAINING, "run_ppo.py")
MERGE_SCRIPT = os.path.join(REPO, "scripts", "merge", "merge_llama_with_lora.py")
CHAT_SCRIPT = os.path.join(REPO, "scripts", "inference", "chat.py")
MARKER = "checkpoint_complete.json"
# Four steps, a checkpoint every two, only the newest kept: a finished run leaves checkpoint-4 alone.
RUN = {"max_steps": 4, "save_steps": 2, "save_total_limit": 1, "validation_split_percentage": 0}
# The identity a completion marker held before issue 29 (read from a checkpoint written by main at 9dfcade): these
# flags, each model flag's path and "config", and "processes"; no identity_version, no "hashes".
FLAGS_BEFORE_ISSUE_29 = (
    "seed", "data_seed", "full_finetuning", "lora_rank", "lora_alpha", "trainable", "modules_to_save",
    "load_in_kbits", "torch_dtype", "per_device_train_batch_size", "gradient_accumulation_steps", "block_size",
    "max_seq_length", "packing", "validation_split_percentage", "max_train_samples", "data_split", "data_phase",
    "train_on_last_turn_only", "loss_type", "shared_base", "max_prompt_seq_len", "max_answer_seq_len",
    "per_device_generation_batch_size", "generation_batches", "ppo_epochs", "enable_ema",
)


def scale_weights(directory, factor: float = 1.01) -> None:
    """Every safetensors file of directory rewritten with its tensors times factor: the same shapes and config."""
    from safetensors.torch import load_file, save_file

    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            path = os.path.join(directory, name)
            save_file({key: value * factor for key, value in load_file(path).items()}, path, metadata={"format": "pt"})


def check_refused_writing_nothing(script, args, expected, *directories):
    before = snapshot(*directories)
    result = run_in_process(script, args)
    check_refused(result, expected)
    assert snapshot(*directories) == before
    return result


@pytest.fixture(scope="module")
def finished(tiny_model_dir, pretrain_dir, tmp_path_factory):
    """(root, arguments of a run into OUT): a finished 4-step pretraining run in root/finished, on a copy of the
    tiny model in root/base (its weights are the run's), the data cache in root/cache."""
    root = tmp_path_factory.mktemp("identity")
    base = shutil.copytree(tiny_model_dir, root / "base")

    def args(output_dir, model_dir=base, **overrides):
        return tiny_pt_args(model_dir, pretrain_dir, output_dir, root / "cache", **{**RUN, **overrides})

    assert_ok(run_in_process(PT_SCRIPT, args(root / "finished")))
    return root, args


def copy_of_finished(finished, tmp_path):
    root, _ = finished
    return shutil.copytree(root / "finished", tmp_path / "out")


# ----------------------------------------------------------------------------- the core rule, fast


def test_weights_fingerprint_follows_content_and_is_only_stat_on_a_second_run(tmp_path, monkeypatch):
    from lorakit.core import fingerprints
    from lorakit.core.fingerprints import FingerprintMemo, save_weights_memo, weights_fingerprint

    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"x" * 1000)
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(fingerprints, "RACY_SECONDS", 0)  # memoized at once (else only 2 s after its last write)
    old = os.stat(model / "model.safetensors").st_mtime_ns
    first = weights_fingerprint(str(model))
    assert first is not None and weights_fingerprint(str(tmp_path)) is None  # no weight file: none

    memo = FingerprintMemo(str(tmp_path / "memo"))
    assert weights_fingerprint(str(model), memo) == first
    save_weights_memo(memo, str(tmp_path / "memo"))
    reads = []
    with monkeypatch.context() as patch:
        patch.setattr(fingerprints, "file_fingerprint", lambda path: reads.append(path) or "read")
        assert weights_fingerprint(str(model), FingerprintMemo(str(tmp_path / "memo"))) == first and reads == []

    with open(model / "model.safetensors", "r+b") as handle:  # the same size, the old mtime put back
        handle.seek(500)
        handle.write(b"y")
    os.utime(model / "model.safetensors", ns=(old, old))
    assert weights_fingerprint(str(model), FingerprintMemo(str(tmp_path / "memo"))) != first


def parsed_identity(classes, argv):
    from transformers import HfArgumentParser

    from lorakit.trainers.checkpoints import run_identity

    model_args, data_args, training_args = HfArgumentParser(classes).parse_args_into_dataclasses(args=argv)
    return run_identity(model_args, data_args, training_args)


def stage_classes(stage: str):
    import importlib

    from lorakit.commands import COMMANDS

    return importlib.import_module(COMMANDS[stage].config).ARGUMENT_CLASSES


# Per stage, a loss-defining flag and another value: each is in the identity, so a resume with it changed refuses.
OBJECTIVE_CASES = [
    ("dpo", "beta", "0.3"), ("dpo", "label_smoothing", "0.1"), ("dpo", "rpo_alpha", "0.5"),
    ("reward", "reward_center_coef", "0.01"), ("sft", "neftune_noise_alpha", "5"),
    ("sft", "label_smoothing_factor", "0.1"), ("ppo", "kl_ctl", "0.2"), ("ppo", "cliprange", "0.1"),
    ("ppo", "cliprange_value", "0.1"), ("ppo", "clip_reward_value", "1"), ("ppo", "gamma", "0.9"),
    ("ppo", "lam", "0.9"), ("ppo", "ema_beta", "0.9"), ("ppo", "unsup_coef", "1"), ("ppo", "target_kl", "6"),
    ("pt", "optim", "adafactor"), ("pt", "ignore_data_skip", None), ("pt", "dataloader_drop_last", None),
    ("sft", "train_sampling_strategy", "group_by_length"),
]


@pytest.mark.parametrize(("stage", "flag", "value"), OBJECTIVE_CASES)
def test_each_stage_records_its_objective_and_sample_order(stage, flag, value):
    from lorakit.trainers.checkpoints import check_identity

    base = ["--output_dir", "unused", "--model_name_or_path", "hub/model"]
    if stage == "ppo":
        base += ["--data_path", "unused.jsonl", "--reward_model_name_or_path", "hub/reward"]
    changed = base + ([f"--{flag}"] if value is None else [f"--{flag}", value])
    before, after = parsed_identity(stage_classes(stage), base), parsed_identity(stage_classes(stage), changed)
    differences, note = check_identity("checkpoint-4", {"identity_version": 2, "identity": before}, after)
    assert note is None and [d.split(" ")[0] for d in differences] == [f"--{flag}"]


def test_a_flag_added_to_the_identity_since_a_marker_is_named_not_compared():
    """A checkpoint written before --lora_experts joined the identity resumes, with one line naming it."""
    from lorakit.trainers.checkpoints import check_identity

    current = parsed_identity(stage_classes("sft"), ["--output_dir", "unused", "--model_name_or_path", "hub/model"])
    before = {name: value for name, value in current.items() if name != "--lora_experts"}
    differences, note = check_identity("checkpoint-4", {"identity_version": 2, "identity": before}, current)
    assert differences == [] and note == ("checkpoint-4: written before --lora_experts joined the run identity: "
                                          "resuming without checking them")
    # A model flag the marker's run did not give is still a difference, as before.
    with_adapter = {**current, "--peft_path": "adapter", "--peft_path config": "c", "--peft_path weights": "w"}
    differences, _ = check_identity("checkpoint-4", {"identity_version": 2, "identity": before}, with_adapter)
    assert [d.split(" ")[0] for d in differences] == ["--peft_path"] * 3


def test_deepspeed_records_stage_offload_and_precision_not_the_file(tmp_path):
    from lorakit.trainers.checkpoints import deepspeed_identity

    zero2 = json.loads(open(os.path.join(REPO, "ds_configs", "ds_zero2_no_offload.json")).read())
    zero3 = deepspeed_identity(os.path.join(REPO, "ds_configs", "ds_zero3_offload.json"))
    assert deepspeed_identity(None) is None
    assert deepspeed_identity(zero2)["zero_stage"] == 2 and zero3["zero_stage"] == 3
    assert zero3["offload_optimizer"] == "cpu" and deepspeed_identity(zero2)["offload_optimizer"] is None
    retuned = {**zero2, "train_micro_batch_size_per_gpu": 7, "gradient_clipping": 0.5, "steps_per_print": 1}
    assert deepspeed_identity(retuned) == deepspeed_identity(zero2)
    assert deepspeed_identity({**zero2, "bf16": {"enabled": True}}) != deepspeed_identity(zero2)


# ----------------------------------------------------------------------------- resuming another run refuses


def test_a_base_rebuilt_with_other_weights_is_refused_on_resume(finished, tmp_path):
    root, args = finished
    base = shutil.copytree(root / "base", tmp_path / "base")
    assert_ok(run_in_process(PT_SCRIPT, args(tmp_path / "run", model_dir=base)))
    scale_weights(base)  # config.json unchanged
    result = check_refused_writing_nothing(PT_SCRIPT, args(tmp_path / "run", model_dir=base),
                                           "--model_name_or_path weights", tmp_path, root / "cache")
    assert "re-saved in another layout" in result.stderr


def test_a_retrained_peft_path_is_refused_on_resume(finished, tmp_path):
    root, args = finished
    adapter = shutil.copytree(root / "finished" / "pt_lora_model", tmp_path / "adapter")
    run = args(tmp_path / "run", peft_path=adapter)
    assert_ok(run_in_process(PT_SCRIPT, run))
    scale_weights(adapter)
    check_refused_writing_nothing(PT_SCRIPT, run, "--peft_path weights", tmp_path, root / "cache")


def test_a_retrained_ppo_reward_adapter_is_refused_on_resume(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForSequenceClassification

    reward = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    get_peft_model(reward, LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"])
                   ).save_pretrained(str(tmp_path / "rm"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"instruction": f"问题 {n} question"}) + "\n" for n in range(8)))
    options = {"actor_model_name_or_path": tiny_model_dir, "reward_model_name_or_path": tiny_model_dir,
               "reward_lora_model": tmp_path / "rm", "data_path": prompts, "template": "human_assistant",
               "max_prompt_seq_len": 16, "max_answer_seq_len": 8, "per_device_generation_batch_size": 4,
               "per_device_training_batch_size": 4, "lora_rank": 4, "lora_dropout": 0.0,
               "trainable": "q_proj,v_proj", "torch_dtype": "float32", "report_to": "none", "max_steps": 1,
               "save_strategy": "steps", "save_steps": 1, "output_dir": tmp_path / "out", "seed": 1,
               "data_cache_dir": tmp_path / "cache"}
    run = ["--use_cpu"] + options_to_argv(options)
    assert_ok(run_in_process(PPO_SCRIPT, run))
    scale_weights(tmp_path / "rm")
    check_refused_writing_nothing(PPO_SCRIPT, run, "--reward_lora_model weights", tmp_path)


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("train_sampling_strategy", "sequential", '--train_sampling_strategy "random" (checkpoint) vs "sequential"'),
    ("group_by_length", True, '--train_sampling_strategy "random" (checkpoint) vs "group_by_length"'),
    ("dataloader_drop_last", True, "--dataloader_drop_last false (checkpoint) vs true"),
    ("ignore_data_skip", True, "--ignore_data_skip false (checkpoint) vs true"),
    ("optim", "adafactor", '--optim "adamw_torch_fused" (checkpoint) vs "adafactor"'),
    ("bf16", True, "--bf16 false (checkpoint) vs true"),
])
def test_a_changed_sample_order_optimizer_or_precision_is_refused(finished, tmp_path, flag, value, expected):
    root, args = finished
    out = copy_of_finished(finished, tmp_path)
    check_refused_writing_nothing(PT_SCRIPT, args(out, **{flag: value}), expected, tmp_path, root / "cache")


@pytest.mark.slow
def test_turning_deepspeed_on_is_refused(finished, tmp_path):
    """A subprocess: DeepSpeed's configuration stays in the process that parsed it."""
    root, args = finished
    out = copy_of_finished(finished, tmp_path)
    before = snapshot(tmp_path, root / "cache")
    result = run_script(args(out, deepspeed=f"{REPO}/ds_configs/ds_zero2_no_offload.json"))
    check_refused(result, '--deepspeed null (checkpoint) vs {"zero_stage": 2')
    assert snapshot(tmp_path, root / "cache") == before


def test_the_changeable_settings_resume(finished, tmp_path):
    _, args = finished
    out = copy_of_finished(finished, tmp_path)
    result = run_in_process(PT_SCRIPT, args(out, learning_rate=1e-3, max_steps=6, save_steps=3, logging_steps=2,
                                            save_total_limit=2, lr_scheduler_type="linear"))
    assert_ok(result)
    assert f"resuming from {out / 'checkpoint-4'}" in result.stdout
    assert (out / "checkpoint-6" / MARKER).is_file()


# ----------------------------------------------------------------------------- --resume_from_checkpoint false


def test_resume_from_checkpoint_false_never_resumes(finished, tmp_path):
    root, args = finished
    out = copy_of_finished(finished, tmp_path)
    check_refused_writing_nothing(PT_SCRIPT, args(out, resume_from_checkpoint="false"),
                                  "--resume_from_checkpoint false, but --output_dir is not empty (it holds "
                                  "checkpoint-4); pass --overwrite_output_dir", tmp_path, root / "cache")
    result = run_in_process(PT_SCRIPT, args(out, resume_from_checkpoint="false", overwrite_output_dir=True,
                                            max_steps=2))
    assert_ok(result)
    assert "resuming from" not in result.stdout
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and not (out / "checkpoint-4").exists()


# ----------------------------------------------------------------------------- checkpoint files and weights


def test_a_checkpoint_file_damaged_at_the_same_size_is_refused_at_resume(finished, tmp_path):
    root, args = finished
    out = copy_of_finished(finished, tmp_path)
    weights = out / "checkpoint-4" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    check_refused_writing_nothing(PT_SCRIPT, args(out, max_steps=6),
                                  "adapter_model.safetensors is not what was saved (its content hash differs",
                                  tmp_path, root / "cache")


def test_a_checkpoint_whose_update_went_non_finite_is_not_marked_complete(finished, tmp_path, monkeypatch):
    import torch

    from lorakit.trainers import checkpoints

    _, args = finished
    write_adapter = checkpoints.save_adapter

    def poison_at_checkpoint_4(model, tokenizer, path, is_main_process):
        if "checkpoint-4" in path:
            with torch.no_grad():
                next(p for p in model.parameters() if p.requires_grad).fill_(float("nan"))
        write_adapter(model, tokenizer, path, is_main_process)

    monkeypatch.setattr(checkpoints, "save_adapter", poison_at_checkpoint_4)
    result = run_in_process(PT_SCRIPT, args(tmp_path / "out", save_total_limit=None))
    assert result.returncode == 3, result.stderr[-2000:]
    assert "trainable weights hold NaN or infinite values" in result.stderr
    assert not (tmp_path / "out" / "checkpoint-4" / MARKER).exists()
    assert (tmp_path / "out" / "checkpoint-2" / MARKER).is_file()


def as_written_before_issue_29(checkpoint) -> None:
    """Rewrite checkpoint's marker as the code before issue 29 wrote it (FLAGS_BEFORE_ISSUE_29)."""
    marker = json.loads((checkpoint / MARKER).read_text())
    kept = {f"--{flag}" for flag in FLAGS_BEFORE_ISSUE_29} | {"processes"}
    marker["identity"] = {name: value for name, value in marker["identity"].items()
                          if name in kept or (name.startswith("--") and not name.endswith(" weights")
                                              and name.split(" ")[0][2:].endswith(("_path", "_model")))}
    del marker["identity_version"], marker["hashes"]
    (checkpoint / MARKER).write_text(json.dumps(marker, indent=1))


def test_a_checkpoint_of_the_earlier_format_resumes_with_one_line_naming_what_was_not_checked(finished, tmp_path):
    _, args = finished
    out = copy_of_finished(finished, tmp_path)
    as_written_before_issue_29(out / "checkpoint-4")
    result = run_in_process(PT_SCRIPT, args(out, max_steps=6, save_steps=3))
    assert_ok(result)
    lines = [line for line in result.stdout.splitlines() if "written by an earlier version of the toolkit" in line]
    assert len(lines) == 1 and "--model_name_or_path weights" in lines[0] and "--deepspeed" in lines[0]
    assert f"resuming from {out / 'checkpoint-4'}" in result.stdout
    assert json.loads((out / "checkpoint-6" / MARKER).read_text())["identity_version"] == 2


# The last commit before issue 29: its code writes the earlier marker format.
BEFORE_ISSUE_29 = "9dfcade"


@pytest.mark.slow
def test_a_checkpoint_written_by_the_code_before_issue_29_resumes_with_its_warning(tiny_model_dir, pretrain_dir,
                                                                                  tmp_path):
    """The real thing behind as_written_before_issue_29: the package of commit BEFORE_ISSUE_29 (from git) writes
    the checkpoint, this code resumes it."""
    old = tmp_path / "old"
    old.mkdir()
    # Its scripts too: today's import the command modules of today's package, which the old package does not have.
    archive = subprocess.run(f"git -C {REPO} archive {BEFORE_ISSUE_29} src scripts | tar -x -C {old}", shell=True,
                             capture_output=True, text=True)
    # A clone has the history (a shallow one does not: this test says so instead of passing without its check).
    assert archive.returncode == 0, f"commit {BEFORE_ISSUE_29} is not in this clone: {archive.stderr.strip()}"
    args = tiny_pt_args(tiny_model_dir, pretrain_dir, tmp_path / "out", tmp_path / "cache", **RUN)
    old_script = old / Path(PT_SCRIPT).relative_to(REPO)
    written = subprocess.run([sys.executable, old_script, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                             env={**script_env(), "PYTHONPATH": str(old / "src")})
    assert_ok(written)
    marker = json.loads((tmp_path / "out" / "checkpoint-4" / MARKER).read_text())
    assert "identity_version" not in marker and "hashes" not in marker
    assert {f"--{flag}" for flag in FLAGS_BEFORE_ISSUE_29} >= {
        name for name in marker["identity"] if not name.startswith("--model_name_or_path") and name != "processes"}
    result = run_in_process(PT_SCRIPT, tiny_pt_args(tiny_model_dir, pretrain_dir, tmp_path / "out",
                                                    tmp_path / "cache", **{**RUN, "max_steps": 6, "save_steps": 3}))
    assert_ok(result)
    lines = [line for line in result.stdout.splitlines() if "written by an earlier version of the toolkit" in line]
    assert len(lines) == 1 and "--model_name_or_path weights" in lines[0]


# ----------------------------------------------------------------------------- an adapter on another base


def other_base_and_adapter(finished, tmp_path):
    """(a base of the same shape with other weights, the finished run's adapter)."""
    root, _ = finished
    other = shutil.copytree(root / "base", tmp_path / "other_base")
    scale_weights(other)
    return other, root / "finished" / "pt_lora_model"


def test_the_merge_refuses_an_adapter_trained_on_another_base(finished, tmp_path, caplog):
    root, _ = finished
    other, adapter = other_base_and_adapter(finished, tmp_path)
    recorded = json.loads((adapter / "lorakit_base.json").read_text())
    assert recorded["base_model_name_or_path"] == os.path.realpath(root / "base")
    check_refused(run_in_process(MERGE_SCRIPT, ["--base_model", other, "--lora_model", adapter,
                                                "--output_dir", tmp_path / "merged"]),
                  f"{adapter}: the --lora_model adapter was trained on {os.path.realpath(root / 'base')}")
    assert not (tmp_path / "merged").exists()
    allowed = run_in_process(MERGE_SCRIPT, ["--base_model", other, "--lora_model", adapter, "--output_dir",
                                            tmp_path / "merged", "--allow_other_base"])
    assert_ok(allowed)
    assert "--allow_other_base: used anyway" in caplog.text
    assert_ok(run_in_process(MERGE_SCRIPT, ["--base_model", root / "base", "--lora_model", adapter,
                                            "--output_dir", tmp_path / "merged_right"]))


def test_an_adapter_made_elsewhere_merges_with_a_warning(finished, tmp_path, caplog):
    root, _ = finished
    adapter = shutil.copytree(root / "finished" / "pt_lora_model", tmp_path / "adapter")
    os.remove(adapter / "lorakit_base.json")
    result = run_in_process(MERGE_SCRIPT, ["--base_model", root / "base", "--lora_model", adapter,
                                           "--output_dir", tmp_path / "merged"])
    assert_ok(result)
    assert "records no base (one made elsewhere" in caplog.text


def test_serving_refuses_an_adapter_trained_on_another_base(finished, tmp_path):
    other, adapter = other_base_and_adapter(finished, tmp_path)
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "你好"}) + "\n")
    predictions = tmp_path / "predictions.jsonl"
    check_refused(run_in_process(CHAT_SCRIPT, ["--base_model", other, "--lora_model", adapter, "--data_file", data,
                                               "--predictions_file", predictions, "--template", "alpaca"]),
                  "pass --allow_other_base to use it anyway")
    assert not predictions.exists()
