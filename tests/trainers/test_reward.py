"""Reward model: the score's position, a learnable preference, DeepSpeed, resume, reload, bad input."""

import json
import os
import random
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from helpers.commands import REPO, TRAINING, assert_ok, check_refused, refuse, run_script
from helpers.corpora import CHINESE, ENGLISH, GOOD_PAIR, marker_pairs
from helpers.kill_points import resume_proof
from helpers.run_outputs import adapter_weights, log_history
from helpers.tiny_runs import tiny_sft_args

RM_SCRIPT = os.path.join(TRAINING, "run_reward.py")


def tiny_rm_args(model_dir, output_dir, cache_dir, **overrides):
    options = {"template": "human_assistant", "lora_dropout": 0.0, **overrides}
    return tiny_sft_args(model_dir, output_dir, cache_dir, **options)


def test_score_is_read_at_the_last_real_token_whatever_the_padding(tiny_model_dir, tiny_tokenizer_dir):
    from peft import PeftModel

    from lorakit.models.arguments import ModelArguments
    from lorakit.models.heads import score_sequences
    from lorakit.models.loader import load_model
    from lorakit.trainers.arguments import ToolkitTrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    model_args = ModelArguments(model_name_or_path=tiny_model_dir, torch_dtype="float32", lora_dropout=0.0)
    model = load_model(model_args, ToolkitTrainingArguments(output_dir="unused", use_cpu=True, report_to="none"),
                       tokenizer, task="reward").eval()
    with torch.no_grad():  # a trained-looking adapter: LoRA B starts at zero
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    assert isinstance(model, PeftModel)
    sequence = tokenizer("我们 今天 学习 the quick fox")["input_ids"] + [tokenizer.eos_token_id]
    longer = tokenizer("北京 上海 天气 很好 人民 日报 经济 发展 科学 技术")["input_ids"] + [tokenizer.eos_token_id]
    n, pad, width = len(sequence), 0, len(longer) + 3
    assert width > n

    def score(rows, masks):
        return score_sequences(model, torch.tensor(rows), torch.tensor(masks))

    alone = score([sequence], [[1] * n])[0]
    right = score([sequence + [pad] * (width - n), longer + [pad] * 3],
                  [[1] * n + [0] * (width - n), [1] * len(longer) + [0] * 3])
    left = score([[pad] * (width - n) + sequence, [pad] * 3 + longer],
                 [[0] * (width - n) + [1] * n, [0] * 3 + [1] * len(longer)])
    eos_padded = score([sequence + [tokenizer.eos_token_id] * 4], [[1] * n + [0] * 4])[0]  # pad id == EOS
    for value in (right[0], left[0], eos_padded):
        assert abs(value.item() - alone.item()) <= 1e-5
    assert abs(right[1].item() - left[1].item()) <= 1e-5
    assert abs(alone.item() - right[1].item()) > 1e-3  # different texts score differently


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prefix_rows_give_the_scores_and_gradients_of_separate_rows(attention, tiny_model_dir,
                                                                           tiny_tokenizer_dir):
    """A pair as one row (shared prefix once, then chosen, then rejected, the rejected answer
    masked from the chosen one) scores both answers as two padded rows do, with the same
    gradients, and holds fewer tokens. Pairs: a long shared prompt, an answer that extends the
    other, and two sequences that differ from their first token."""
    from lorakit.data.build_dataset import DataCollatorForPreferencePairs
    from lorakit.models.arguments import ModelArguments
    from lorakit.models.heads import score_pairs
    from lorakit.models.loader import load_model
    from lorakit.trainers.arguments import ToolkitTrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    model_args = ModelArguments(model_name_or_path=tiny_model_dir, torch_dtype="float32", lora_dropout=0.0,
                                attn_implementation=attention)
    torch.manual_seed(0)  # the new score head and the LoRA B draws below: the same whatever ran before
    model = load_model(model_args, ToolkitTrainingArguments(output_dir="unused", use_cpu=True, report_to="none"),
                       tokenizer, task="reward")
    assert model.config._attn_implementation == attention
    with torch.no_grad():  # a trained-looking adapter: LoRA B starts at zero
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)

    def ids(text):
        return tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]

    prompt = "北京 上海 天气 很好 人民 日报 经济 发展 科学 技术 the quick fox"
    pairs = [{"chosen_input_ids": ids(prompt + " 我们 今天 学习"), "rejected_input_ids": ids(prompt + " 人民 经济")},
             {"chosen_input_ids": ids("我们 今天")[:-1], "rejected_input_ids": ids("我们 今天 学习 科学")},
             {"chosen_input_ids": ids("科学 技术"), "rejected_input_ids": ids("the fox jumps over 今天 很好")}]
    results = {}
    for share_prefix in (False, True):
        model.zero_grad()
        batch = DataCollatorForPreferencePairs(tokenizer.unk_token_id, 1, share_prefix=share_prefix)(pairs)
        chosen, rejected = score_pairs(model.train(), batch)
        (chosen.sum() - 2 * rejected.sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[share_prefix] = (chosen.detach(), rejected.detach(), grads, batch["input_ids"].numel())
    (chosen, rejected, grads, tokens), (shared_chosen, shared_rejected, shared_grads, shared_tokens) = results.values()
    torch.testing.assert_close(shared_chosen, chosen, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(shared_rejected, rejected, atol=1e-5, rtol=1e-5)
    assert (chosen - rejected).abs().min() > 1e-3  # the answers score differently
    assert grads.keys() == shared_grads.keys() and any("score" in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4)
    assert shared_tokens < 0.8 * tokens


@pytest.fixture(scope="module")
def marker_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm_data")
    (root / "train.jsonl").write_text("\n".join(json.dumps(p, ensure_ascii=False) for p in marker_pairs(400, 0)))
    (root / "valid.jsonl").write_text("\n".join(json.dumps(p, ensure_ascii=False) for p in marker_pairs(60, 1)))
    return str(root / "train.jsonl"), str(root / "valid.jsonl")


def test_learns_a_marker_preference_and_reloads_exactly(tiny_model_dir, marker_files, tmp_path):
    from peft import PeftModel

    from lorakit.data.build_dataset import DataCollatorForPreferencePairs, build_preference_dataset
    from lorakit.models.heads import reward_model_class, score_sequences
    from lorakit.records.chat_templates import named_template

    train, valid = marker_files
    out = tmp_path / "out"
    args = tiny_rm_args(tiny_model_dir, out, tmp_path / "cache", data_path=train, validation_file=valid,
                        max_steps=40, learning_rate=1e-2, per_device_train_batch_size=8, save_steps=40,
                        merge_on_save=True)
    assert_ok(run_script(args, script=RM_SCRIPT))
    results = json.loads((out / "eval_results.json").read_text())
    assert results["eval_accuracy"] >= 0.95, results
    assert results["eval_margin"] > 0

    # The saved adapter + score head, and the merged model, reproduce the eval scores.
    tokenizer = AutoTokenizer.from_pretrained(out / "rm_lora_model")
    pairs = build_preference_dataset([valid], tokenizer, named_template("human_assistant", tokenizer), 256,
                                     str(tmp_path / "cache"))
    batch = DataCollatorForPreferencePairs(tokenizer.pad_token_id)([pairs[i] for i in range(len(pairs))])
    config = AutoModelForSequenceClassification.from_pretrained(out / "rm_merged_model").config
    base = reward_model_class(config).from_pretrained(tiny_model_dir, config=config, dtype=torch.float32)
    adapter_model = PeftModel.from_pretrained(base, out / "rm_lora_model").eval()
    merged = reward_model_class(config).from_pretrained(out / "rm_merged_model", dtype=torch.float32).eval()
    for model in (adapter_model, merged):
        with torch.no_grad():
            chosen, rejected = score_sequences(model, batch["input_ids"], batch["attention_mask"]).chunk(2)
        assert abs(chosen.mean().item() - results["eval_chosen_score"]) <= 1e-4
        assert abs(rejected.mean().item() - results["eval_rejected_score"]) <= 1e-4
        assert (chosen > rejected).float().mean().item() == pytest.approx(results["eval_accuracy"])
    # transformers' own class loads the merged model too, and agrees on an unpadded sequence.
    plain = AutoModelForSequenceClassification.from_pretrained(out / "rm_merged_model", dtype=torch.float32).eval()
    row = torch.tensor([pairs[0]["chosen_input_ids"]])
    with torch.no_grad():
        assert abs(plain(row).logits.item() - score_sequences(merged, row, torch.ones_like(row)).item()) <= 1e-5


def stage_reward_adapter(model_dir, adapter_dir):
    """A reward adapter (LoRA with non-zero updates + score head) and its tokenizer saved as run_reward.py saves
    them: the stage's chat template and pad token (not EOS, which ends every row). Returns the tokenizer."""
    from lorakit.models.arguments import ModelArguments
    from lorakit.models.loader import choose_pad_token, load_model
    from lorakit.records.chat_templates import parse_template_kwargs, use_template
    from lorakit.trainers.checkpoints import save_adapter

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    choose_pad_token(tokenizer, use_template("human_assistant", tokenizer, parse_template_kwargs(None, None)))
    model = load_model(ModelArguments(model_name_or_path=model_dir, torch_dtype="float32", lora_dropout=0.0), None,
                       tokenizer, task="reward")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    save_adapter(model, tokenizer, str(adapter_dir), True)
    return tokenizer


def test_merged_reward_model_scores_as_base_plus_adapter_and_a_failed_merge_publishes_nothing(
        tiny_model_dir, tmp_path):
    """--merge_on_save's merge (the streaming LoRA merge in a child process) scores padded rows as peft's base +
    adapter does, loaded by transformers' own classifier and by PPO's reward loader; config.json is a one-label
    sequence classifier with the stage's pad token in the base's dtype, the tokenizer and chat template beside
    it. A merge that fails (a damaged adapter) stops with the merge's own message and leaves no rm_merged_model:
    neither a partial one nor the earlier run's, merged from another adapter."""
    from peft import PeftModel

    from lorakit.commands.reward import save_merged
    from lorakit.core.cli import ReportedError
    from lorakit.models.arguments import ModelArguments
    from lorakit.models.heads import score_sequences
    from lorakit.models.loader import load_model
    from lorakit.rl.model_checks import check_reward_source

    out = tmp_path / "out"
    tokenizer = stage_reward_adapter(tiny_model_dir, out / "rm_lora_model")
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    stage_args = SimpleNamespace(output_dir=str(out))
    save_merged(ModelArguments(model_name_or_path=tiny_model_dir), stage_args)
    merged_dir = out / "rm_merged_model"

    config = json.loads((merged_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    assert config["pad_token_id"] == tokenizer.pad_token_id
    with open(os.path.join(tiny_model_dir, "config.json"), encoding="utf-8") as handle:
        assert config["dtype"] == json.load(handle)["dtype"] == "float32"
    merged_tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    assert merged_tokenizer.chat_template == tokenizer.chat_template and "Assistant:" in tokenizer.chat_template
    assert merged_tokenizer.pad_token_id == tokenizer.pad_token_id

    rows = [tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
            for text in ("我们 今天 学习 the quick fox", "北京 天气 很好", "人民 日报 经济 发展 科学 技术 jumps over")]
    width = max(len(row) for row in rows)
    input_ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32,
                                                              pad_token_id=tokenizer.pad_token_id)
    reference = PeftModel.from_pretrained(base, out / "rm_lora_model").eval()
    plain = AutoModelForSequenceClassification.from_pretrained(merged_dir, dtype=torch.float32).eval()
    check_reward_source(str(merged_dir), None, "--reward_model_name_or_path")
    ppo_reward = load_model(ModelArguments(model_name_or_path=str(merged_dir), torch_dtype="float32"), None,
                            tokenizer, task="reward", trainable=False)
    with torch.no_grad():
        expected = reference(input_ids=input_ids, attention_mask=mask).logits.squeeze(-1)
        scores = [plain(input_ids=input_ids, attention_mask=mask).logits.squeeze(-1),
                  score_sequences(ppo_reward, input_ids, mask)]
    assert expected.std() > 1e-3  # the rows score differently
    for score in scores:
        assert (score - expected).abs().max().item() <= 1e-4, (score, expected)

    weights = out / "rm_lora_model" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ReportedError) as failure:
        save_merged(ModelArguments(model_name_or_path=tiny_model_dir), stage_args)
    message = str(failure.value)  # the merge's own reason (its one line on stderr) and how to redo it
    assert re.search(rf"rm_merged_model: merging .* failed \(exit status 2: {re.escape(str(weights))}: ", message)
    assert failure.value.exit_status == 1 and "-m lorakit merge --base_model" in message
    assert sorted(os.listdir(out)) == ["rm_lora_model"]


@pytest.mark.parametrize("config", ["ds_zero2_no_offload", "ds_zero3_no_offload"])
@pytest.mark.slow
def test_reward_deepspeed_two_processes(config, tiny_model_dir, marker_files, tmp_path):
    """Two ranks train and save; --merge_on_save merges only once every rank has finished and the process group
    is destroyed, in a separate process (no rank waits at a barrier bounded by --ddp_timeout meanwhile)."""
    train, valid = marker_files
    out = tmp_path / "out"
    args = tiny_rm_args(tiny_model_dir, out, tmp_path / "cache", data_path=train, validation_file=valid,
                        max_steps=4, save_steps=4, max_eval_samples=16, merge_on_save=True,
                        deepspeed=os.path.join(REPO, "ds_configs", f"{config}.json"))
    result = run_script(args, nproc=2, script=RM_SCRIPT)
    assert_ok(result)
    losses = [e["loss"] for e in log_history(out) if "loss" in e]
    assert len(losses) == 4 and all(0 < loss < 5 for loss in losses)
    weights = adapter_weights(out / "rm_lora_model")
    score = next(v for k, v in weights.items() if "score" in k)
    assert score.shape == (1, 64)
    assert "eval_accuracy" in json.loads((out / "eval_results.json").read_text())
    output = result.stdout
    destroyed = output.index("every rank has finished: process group destroyed")
    assert destroyed < output.index("merging in a separate process") < output.index("merged 1 adapter(s) into")
    assert output.count("merged 1 adapter(s) into") == 1
    merged = AutoModelForSequenceClassification.from_pretrained(out / "rm_merged_model")
    assert merged.config.pad_token_id == AutoTokenizer.from_pretrained(out / "rm_lora_model").pad_token_id
    assert merged.score.weight.shape == (1, 64)


@pytest.fixture(scope="module", params=[1, 2], ids=["one_process", "zero2_two_processes"])
def reward_resume(request, tiny_model_dir, marker_files, tmp_path_factory):
    """An uninterrupted run and the same run killed at seeded random steps, rerun after each kill until it
    finished; forked (one process), also killed while writing a checkpoint and as it ends; or under torchrun with
    ZeRO-2 (helpers/kill_points.py)."""
    train, _ = marker_files
    root = tmp_path_factory.mktemp(f"rm_resume{request.param}")
    extra = {"deepspeed": os.path.join(REPO, "ds_configs", "ds_zero2_no_offload.json")} if request.param == 2 else {}

    def args_for(output_dir):
        return tiny_rm_args(tiny_model_dir, output_dir, root / "cache", data_path=train, save_steps=2, **extra)

    return resume_proof(request.param, RM_SCRIPT, args_for, root, seed=f"reward-{request.param}", total=10,
                        save_steps=2, mid_save=False)


@pytest.mark.slow
def test_reward_resume_after_kills_at_random_steps_runs_only_the_remaining_steps_and_equals_uninterrupted(
        reward_resume):
    reward_resume.check_processes_after_random_kills()
    assert "resuming from" in reward_resume.resumed_output()
    reward_resume.check_bit_identical("rm_lora_model")


@pytest.mark.parametrize("reward_resume", [1], indirect=True, ids=["one_process"])
@pytest.mark.slow
def test_reward_resume_after_a_kill_while_writing_a_checkpoint_starts_from_the_last_complete_one(reward_resume):
    reward_resume.check_process_after_mid_save_kill()


@pytest.mark.parametrize("reward_resume", [1], indirect=True, ids=["one_process"])
@pytest.mark.slow
def test_reward_rerun_of_a_run_killed_after_its_last_step_trains_no_step_and_equals_uninterrupted(reward_resume):
    reward_resume.check_process_after_end_kill()
    reward_resume.check_bit_identical("rm_lora_model", run_name="ended")


@pytest.mark.parametrize("case,bad,expected", [
    ("missing_chosen", {"prompt": "p", "rejected": "r"}, "d.jsonl:2: field 'chosen' is missing"),
    ("missing_rejected", {"prompt": "p", "chosen": "c"}, "d.jsonl:2: field 'rejected' is missing"),
    ("long_prompt", {"prompt": "我们 " * 300, "chosen": "c", "rejected": "r"},
     "d.jsonl:2: the prompt alone fills --max_seq_length 256"),
])
def test_reward_bad_input_is_refused_cleanly(case, bad, expected, tiny_model_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(GOOD_PAIR, ensure_ascii=False) + "\n" + json.dumps(bad, ensure_ascii=False) + "\n")
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = tiny_rm_args(tiny_model_dir, out, cache, data_path=data)
    check_refused(refuse(RM_SCRIPT, args, in_process=case != "missing_chosen"), expected)
    assert not out.exists()


def test_merge_on_save_into_a_base_without_safetensors_is_refused_before_training(tiny_model_dir, tmp_path):
    """The merge reads safetensors: a .bin-only base is refused before anything is trained or written."""
    from safetensors.torch import load_file

    base = tmp_path / "bin_base"  # the tiny model with its weights as an older checkpoint's pytorch_model.bin
    shutil.copytree(tiny_model_dir, base, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(os.path.join(tiny_model_dir, "model.safetensors")), base / "pytorch_model.bin")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(GOOD_PAIR, ensure_ascii=False) + "\n")
    out = tmp_path / "out"
    args = tiny_rm_args(str(base), out, tmp_path / "cache", data_path=data, merge_on_save=True)
    check_refused(refuse(RM_SCRIPT, args, in_process=True),
                  f"{base}: --merge_on_save merges into safetensors weights and this --model_name_or_path has none")
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_identical_pairs_are_dropped_and_counted(tiny_tokenizer_dir, tmp_path, caplog):
    from lorakit.data.build_dataset import build_preference_dataset
    from lorakit.records.chat_templates import named_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    data = tmp_path / "d.jsonl"
    same = {"prompt": "p", "chosen": "一样", "rejected": "一样 "}
    data.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in [GOOD_PAIR, same, same, GOOD_PAIR]))
    with caplog.at_level("WARNING", logger="lorakit.data.build_dataset"):
        pairs = build_preference_dataset([str(data)], tokenizer, named_template("chatml", tokenizer), 256,
                                         str(tmp_path / "cache"))
    assert len(pairs) == 2
    assert "dropped 2 pairs whose chosen and rejected answers are identical" in caplog.text


def test_pairs_identical_once_cut_to_max_seq_length_are_dropped_and_counted(tiny_tokenizer_dir, tmp_path, caplog):
    """Answers that differ only past --max_seq_length become the same token ids: nothing to score them on, so the
    pair is dropped and counted, not trained on as if the chosen answer had lost."""
    from lorakit.data.build_dataset import build_preference_dataset, pair_side
    from lorakit.data.conversation_tokenizer import ConversationTokenizer
    from lorakit.records.chat_templates import named_template
    from lorakit.records.readers import preference_of

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    template = named_template("chatml", tokenizer)
    whole = ConversationTokenizer(tokenizer, template, 1 << 30, keep_after_turn_end=True)
    good = preference_of("p", GOOD_PAIR)
    max_length = max(len(pair_side(whole, "p", good.context, answer).input_ids) for answer in good[1:3])
    shared = "一样 的 开头 " * 40
    far_apart = {"prompt": GOOD_PAIR["prompt"], "chosen": shared + "很好", "rejected": shared + "不好"}
    sides = [pair_side(whole, "p", good.context, far_apart[name]).input_ids for name in ("chosen", "rejected")]
    assert sides[0] != sides[1] and sides[0][:max_length] == sides[1][:max_length]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in [GOOD_PAIR, far_apart, GOOD_PAIR]))
    with caplog.at_level("WARNING", logger="lorakit.data.build_dataset"):
        pairs = build_preference_dataset([str(data)], tokenizer, template, max_length, str(tmp_path / "cache"))
    assert len(pairs) == 2
    assert all(chosen != rejected for chosen, rejected in zip(pairs["chosen_input_ids"], pairs["rejected_input_ids"],
                                                               strict=True))
    assert (f"dropped 1 of 3 pairs whose chosen and rejected token ids are identical once cut to --max_seq_length "
            f"{max_length}" in caplog.text)


def test_parallel_pair_tokenization_matches_one_process_and_reports_errors(tiny_tokenizer_dir, tmp_path):
    """Pairs are read and tokenized in two forked processes (shards of 256): the same rows in the
    same order; a bad record in the second process's shard is refused as from one process."""
    from lorakit.core.cli import InputError
    from lorakit.data.build_dataset import build_preference_dataset
    from lorakit.records.chat_templates import named_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    template = named_template("chatml", tokenizer)
    rng = random.Random(3)
    pairs = [{"prompt": f"问题 {i}", "chosen": " ".join(rng.sample(CHINESE, 3)),
              "rejected": " ".join(rng.sample(ENGLISH, 3)), "margin": i % 3} for i in range(600)]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(p, ensure_ascii=False) for p in pairs), encoding="utf-8")
    built = [build_preference_dataset([str(data)], tokenizer, template, 256, str(tmp_path / f"c{n}"), num_proc=n)
             for n in (1, 2)]
    assert len(built[0]) == 600 and built[0].to_dict() == built[1].to_dict()
    pairs[500] = {"prompt": "p", "rejected": "r"}
    data.write_text("\n".join(json.dumps(p, ensure_ascii=False) for p in pairs), encoding="utf-8")
    for num_proc in (1, 2):
        with pytest.raises(InputError, match=f"^{data}:501: field 'chosen' is missing$"):
            build_preference_dataset([str(data)], tokenizer, template, 256, str(tmp_path / "c"), num_proc=num_proc)
