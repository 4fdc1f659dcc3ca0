"""Continued pretraining run as users run it (python / torchrun subprocesses) on the tiny model."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_deepspeed_resume import RunsCode

from helpers.commands import (
    KILL_WRAPPER,
    PT_SCRIPT,
    REPO,
    TRAINING,
    assert_ok,
    check_refused,
    free_port,
    run_script,
    script_env,
)
from helpers.kill_points import resume_proof
from helpers.run_outputs import adapter_weights, log_history, losses_of, snapshot
from helpers.tiny_runs import tiny_pt_args
from lorakit.trainers.deepspeed_resume import check_deepspeed_files, weights_only_loads


def test_loss_falls_and_eval_perplexity_falls(tiny_model_dir, pretrain_dir, tmp_path):
    out = tmp_path / "out"
    args = tiny_pt_args(
        tiny_model_dir, pretrain_dir, out, tmp_path / "cache",
        max_steps=30, learning_rate=1e-2, save_steps=15,
        eval_strategy="steps", eval_steps=30, eval_on_start=True,
    )
    assert_ok(run_script(args))

    history = log_history(out)
    losses = [entry["loss"] for entry in history if "loss" in entry]
    assert len(losses) == 30
    assert sum(losses[-10:]) / 10 < 0.9 * sum(losses[:10]) / 10, losses
    evals = [entry for entry in history if "eval_loss" in entry]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 30
    assert evals[-1]["eval_perplexity"] < 0.5 * evals[0]["eval_perplexity"]
    assert evals[-1]["eval_accuracy"] > evals[0]["eval_accuracy"]

    # run_clm's result files, and the adapter laid out without double nesting.
    for name in ("train_results.json", "eval_results.json", "all_results.json", "trainer_state.json"):
        assert (out / name).is_file(), name
    eval_results = json.loads((out / "eval_results.json").read_text())
    assert {"eval_loss", "eval_accuracy", "eval_perplexity"} <= set(eval_results)
    for adapter in (out / "pt_lora_model", out / "checkpoint-15" / "pt_lora_model"):
        assert (adapter / "adapter_model.safetensors").is_file()
        assert (adapter / "tokenizer_config.json").is_file()
        assert not (adapter / "pt_lora_model").exists()
    # A checkpoint's adapter directory links the Trainer's copy of the same bytes instead of a second copy.
    assert os.path.samefile(out / "checkpoint-15" / "pt_lora_model" / "adapter_model.safetensors",
                            out / "checkpoint-15" / "adapter_model.safetensors")
    final = adapter_weights(out / "pt_lora_model")
    last_checkpoint = adapter_weights(out / "checkpoint-30" / "pt_lora_model")
    assert all(torch.equal(final[key], last_checkpoint[key]) for key in final)


@pytest.mark.parametrize("config", ["ds_zero2_no_offload", "ds_zero3_no_offload", "ds_zero3_offload"])
@pytest.mark.slow
def test_deepspeed_two_processes(config, tiny_model_dir, varied_pretrain_dir, tmp_path, request):
    if config == "ds_zero2_no_offload":  # the session's run, which test_multinode compares two nodes with
        run = request.getfixturevalue("zero2_two_process_pretraining")
        out, record, result = run["out"], run["record"], run["result"]
    else:
        out, record = tmp_path / "out", tmp_path / "batches"
        args = tiny_pt_args(tiny_model_dir, varied_pretrain_dir, out, tmp_path / "cache", max_steps=6,
                            save_steps=3, deepspeed=os.path.join(REPO, "ds_configs", f"{config}.json"))
        result = run_script(args, nproc=2, wrapper=[KILL_WRAPPER, "--record_batches", str(record)])
    assert_ok(result)

    # Both ranks trained, on different blocks.
    rank0 = (record / "rank0.txt").read_text().split()
    rank1 = (record / "rank1.txt").read_text().split()
    assert len(rank0) == len(rank1) == 6 * 4
    assert len(set(rank0)) == len(set(rank1)) == 6 * 4  # distinct blocks: within one epoch
    assert not set(rank0) & set(rank1)

    # One run, one adapter: at the end and in each checkpoint, nowhere else, full shapes.
    adapters = sorted(str(p.parent.relative_to(out)) for p in out.rglob("adapter_model.safetensors"))
    assert adapters == ["checkpoint-3", "checkpoint-3/pt_lora_model", "checkpoint-6",
                        "checkpoint-6/pt_lora_model", "pt_lora_model"]
    linked = [os.path.samefile(out / step / "pt_lora_model" / "adapter_model.safetensors",
                               out / step / "adapter_model.safetensors") for step in ("checkpoint-3", "checkpoint-6")]
    assert linked == [True, True]
    weights = adapter_weights(out / "pt_lora_model")
    lora_a = weights["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert lora_a.shape == (8, 64)
    losses = [entry["loss"] for entry in log_history(out) if "loss" in entry]
    assert len(losses) == 6 and all(0 < loss < 10 for loss in losses)

    # Its DeepSpeed files load weights-only with DeepSpeed's own few classes allowed (trainers.deepspeed_resume);
    # under ZeRO-3, a resume of a checkpoint with a planted pickle is refused on every rank, its code never run.
    for step in ("checkpoint-3", "checkpoint-6"):
        check_deepspeed_files(str(out / step))
    if config == "ds_zero3_no_offload":
        args = tiny_pt_args(tiny_model_dir, varied_pretrain_dir, out, tmp_path / "cache", max_steps=8, save_steps=3,
                            deepspeed=os.path.join(REPO, "ds_configs", f"{config}.json"))
        resume_of_a_planted_checkpoint_is_refused(out / "checkpoint-6", args, tmp_path / "the planted code ran")


def resume_of_a_planted_checkpoint_is_refused(checkpoint, args, ran) -> None:
    """Rank 1's optimizer states of `checkpoint` given a pickle that runs code (its completion marker rewritten to
    match, as whoever sends a checkpoint can): both ranks refuse the resume in one line naming the file, exit 2,
    nothing written, the code not run. Through launch.py, which reports the ranks' one line once."""
    from lorakit.core.fingerprints import file_fingerprint

    planted = checkpoint / "global_step6" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    with weights_only_loads():
        states = torch.load(planted, weights_only=True)
    states["planted"] = RunsCode(str(ran))
    torch.save(states, planted)
    marker_path = checkpoint / "checkpoint_complete.json"
    marker = json.loads(marker_path.read_text())
    name = str(planted.relative_to(checkpoint))
    marker["files"][name], marker["hashes"][name] = planted.stat().st_size, file_fingerprint(str(planted))
    marker_path.write_text(json.dumps(marker))
    before = snapshot(checkpoint.parent)
    command = [sys.executable, os.path.join(TRAINING, "launch.py"), "--nproc_per_node", "2", "--master_port",
               str(free_port()), PT_SCRIPT, *map(str, args)]
    result = subprocess.run(command, cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=300)
    check_refused(result, f"{planted}: this DeepSpeed checkpoint file pickles the global os.makedirs, which")
    assert not ran.exists() and snapshot(checkpoint.parent) == before


@pytest.mark.parametrize("kbits", [4, 8])
def test_qlora_kbits(kbits, tiny_model_dir, pretrain_dir, tmp_path):
    out = tmp_path / "out"
    args = tiny_pt_args(tiny_model_dir, pretrain_dir, out, tmp_path / "cache", max_steps=6, save_steps=6,
                        load_in_kbits=kbits, validation_split_percentage=0)
    assert_ok(run_script(args))
    # LoRA on the quantized base learns the repeated sentences: the first step's loss is the base model's, and
    # the last steps' (single batches, so averaged) lie clearly below it. Measured: 6.7 -> 3.7 on average.
    losses = losses_of(out)
    assert len(losses) == 6 and sum(losses[-3:]) / 3 < 0.7 * losses[0], losses
    weights = adapter_weights(out / "pt_lora_model")
    assert any(key.endswith("lora_B.weight") and weights[key].abs().sum() > 0 for key in weights)


def test_extended_vocabulary_trains_new_rows(tiny_model_dir, extended_tokenizer_dir, pretrain_dir, tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "out"
    tokenizer = AutoTokenizer.from_pretrained(extended_tokenizer_dir)
    (tmp_path / "data").mkdir()
    text = "我们 预训练 低秩适配 模型 强化学习 奖励模型 训练 the quick brown fox\n" * 60
    (tmp_path / "data" / "new_words.txt").write_text(text, encoding="utf-8")
    # Old transformers-4 flags from users' shell scripts are accepted and mapped.
    args = tiny_pt_args(
        tiny_model_dir, tmp_path / "data", out, tmp_path / "cache",
        tokenizer_name_or_path=extended_tokenizer_dir, modules_to_save="embed_tokens,lm_head",
        max_steps=4, save_steps=4, validation_split_percentage=0, learning_rate=1e-2,
        evaluation_strategy="no", warmup_ratio=0.1, save_safetensors="True", group_by_length=True,
    )
    result = run_script(args)
    assert_ok(result)
    assert "--evaluation_strategy no -> --eval_strategy" in result.stdout

    weights = adapter_weights(out / "pt_lora_model")
    embed = next(v for k, v in weights.items() if "embed_tokens" in k)
    head = next(v for k, v in weights.items() if "lm_head" in k)
    assert embed.shape == head.shape == (len(tokenizer), 64)
    base = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    old_rows = base["model.embed_tokens.weight"].shape[0]
    new_ids = tokenizer.convert_tokens_to_ids(["预训练", "低秩适配"])
    assert min(new_ids) >= old_rows
    initial = base["model.embed_tokens.weight"].mean(dim=0)
    # The new rows started at the mean and were trained away from it.
    for row in new_ids:
        assert (embed[row] - initial).abs().max() > 1e-3


def test_new_rows_start_at_mean(tiny_model_dir, extended_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from lorakit.models.arguments import ModelArguments
    from lorakit.models.loader import load_model
    from lorakit.trainers.arguments import ToolkitTrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(extended_tokenizer_dir)
    model_args = ModelArguments(model_name_or_path=tiny_model_dir, tokenizer_name_or_path=extended_tokenizer_dir,
                                torch_dtype="float32", modules_to_save="embed_tokens,lm_head")
    training_args = ToolkitTrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to="none")
    model = load_model(model_args, training_args, tokenizer)
    base = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    for name, key in (("embed_tokens", "model.embed_tokens.weight"), ("lm_head", "lm_head.weight")):
        module = (getattr(model.base_model.model.model, name) if name == "embed_tokens"
                  else model.base_model.model.lm_head)
        trained_copy = module.modules_to_save["default"].weight.detach()
        old = base[key]
        assert trained_copy.shape[0] == len(tokenizer)
        assert torch.equal(trained_copy[: old.shape[0]], old)
        assert torch.allclose(trained_copy[old.shape[0]:], old.mean(dim=0).expand(len(tokenizer) - old.shape[0], -1))


def test_new_rows_start_at_their_pieces_mean_with_subword_init(tiny_model_dir, extended_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from lorakit.models.arguments import ModelArguments
    from lorakit.models.loader import load_model
    from lorakit.trainers.arguments import ToolkitTrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(extended_tokenizer_dir)
    base_tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model_args = ModelArguments(model_name_or_path=tiny_model_dir, tokenizer_name_or_path=extended_tokenizer_dir,
                                torch_dtype="float32", modules_to_save="embed_tokens,lm_head",
                                new_embeddings_init="subword_mean")
    training_args = ToolkitTrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to="none")
    model = load_model(model_args, training_args, tokenizer)
    base = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    old_rows = base["model.embed_tokens.weight"].shape[0]
    checked = 0
    for new_id in range(old_rows, len(tokenizer)):
        word = tokenizer.convert_ids_to_tokens(new_id)
        # The base tokenizer's own segmentation of the new word, as the pieces it is made of.
        pieces = [token.id for token in base_tokenizer.backend_tokenizer.model.tokenize(word)]
        assert len(pieces) >= 2 and max(pieces) < old_rows
        for name, key in (("embed_tokens", "model.embed_tokens.weight"), ("lm_head", "lm_head.weight")):
            module = (model.base_model.model.model.embed_tokens if name == "embed_tokens"
                      else model.base_model.model.lm_head)
            row = module.modules_to_save["default"].weight.detach()[new_id]
            assert torch.allclose(row, base[key][pieces].mean(dim=0), atol=1e-6)
            assert not torch.allclose(row, base[key].mean(dim=0), atol=1e-3)
        checked += 1
    assert checked == len(tokenizer) - old_rows > 0


@pytest.fixture(scope="module", params=[1, 2], ids=["one_process", "zero3_two_processes"])
def pretraining_resume(request, tiny_model_dir, pretrain_dir, tmp_path_factory):
    """An uninterrupted run and the same run killed at seeded random steps and while writing a checkpoint, rerun
    after each kill until it finished (and, forked, one killed as it ends): each process forked (one process), or
    under torchrun with ZeRO-3 (helpers/kill_points.py)."""
    root = tmp_path_factory.mktemp(f"pt_resume{request.param}")
    extra = {"deepspeed": os.path.join(REPO, "ds_configs", "ds_zero3_no_offload.json")} if request.param == 2 else {}

    def args_for(output_dir):
        return tiny_pt_args(tiny_model_dir, pretrain_dir, output_dir, root / "cache", save_steps=2, **extra)

    return resume_proof(request.param, PT_SCRIPT, args_for, root, seed=f"pretraining-{request.param}", total=10,
                        save_steps=2)


@pytest.mark.slow
def test_resume_after_kills_at_random_steps_runs_only_the_remaining_steps_and_equals_uninterrupted(pretraining_resume):
    """Each rerun resumed (its own step log starts after the last checkpoint, not at step 1) and the adapter is
    bit-identical to the uninterrupted run's (dropout's RNG included)."""
    pretraining_resume.check_processes_after_random_kills()
    assert "resuming from" in pretraining_resume.resumed_output()
    pretraining_resume.check_bit_identical("pt_lora_model")


@pytest.mark.slow
def test_resume_after_a_kill_while_writing_a_checkpoint_starts_from_the_last_complete_one(pretraining_resume):
    pretraining_resume.check_process_after_mid_save_kill()


@pytest.mark.parametrize("pretraining_resume", [1], indirect=True, ids=["one_process"])
@pytest.mark.slow
def test_rerun_of_a_run_killed_after_its_last_step_trains_no_step_and_equals_uninterrupted(pretraining_resume):
    pretraining_resume.check_process_after_end_kill()
    pretraining_resume.check_bit_identical("pt_lora_model", run_name="ended")


@pytest.mark.slow
def test_continue_adapter_with_gradient_checkpointing(tiny_model_dir, pretrain_dir, tmp_path):
    cache = tmp_path / "cache"
    common = {"validation_split_percentage": 0, "learning_rate": 1e-2, "save_strategy": "no"}
    first = tmp_path / "first"
    assert_ok(run_script(tiny_pt_args(tiny_model_dir, pretrain_dir, first, cache, max_steps=10, **common)))

    second = tmp_path / "second"
    args = tiny_pt_args(tiny_model_dir, pretrain_dir, second, cache, max_steps=2, lora_dropout=0.0,
                        peft_path=first / "pt_lora_model", gradient_checkpointing=True, **common)
    result = run_script(args)
    assert_ok(result)
    assert "continuing LoRA adapter" in result.stdout
    # Same seed, same first batch: the continued adapter starts where the first run ended.
    first_loss = [e["loss"] for e in log_history(first) if "loss" in e][0]
    continued_loss = [e["loss"] for e in log_history(second) if "loss" in e][0]
    assert continued_loss < 0.8 * first_loss, (continued_loss, first_loss)
    before, after = adapter_weights(first / "pt_lora_model"), adapter_weights(second / "pt_lora_model")
    assert before.keys() == after.keys()
    assert max((before[k] - after[k]).abs().max().item() for k in before) > 0  # and it trained on
