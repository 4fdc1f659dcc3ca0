"""Supervised fine-tuning: masking per format and template, packing without cross-talk, the
DeepSpeed-Chat data split, the saved chat template, and the script run as users run it."""

import json
import os
import subprocess
import sys
from itertools import pairwise

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.trainer_pt_utils import LengthGroupedSampler

from helpers.commands import REPO, SFT_SCRIPT, assert_ok, check_refused, refuse, run_script
from helpers.kill_points import resume_proof
from helpers.run_outputs import adapter_weights, log_history, losses_of
from helpers.tiny_runs import small_chunks_wrapper, tiny_sft_args
from lorakit.data.build_dataset import DataCollatorForSupervisedDataset, build_sft_dataset, pack_samples
from lorakit.data.conversation_tokenizer import ConversationTokenizer
from lorakit.data.splits import phase_indices
from lorakit.demo.sft_tasks import arithmetic_records
from lorakit.records.chat_templates import TEMPLATES, named_template
from lorakit.records.readers import conversation_of

# SmolLM2's own template (chatml with a default system prompt): a tokenizer's own chat_template.
OWN_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# What each template puts between an answer and EOS (the tiny tokenizer's EOS is </s>).
TERMINATORS = {"llama2": "", "alpaca": "", "human_assistant": "", "chatml": "<|im_end|>", "own": "<|im_end|>"}

RECORDS = {
    "alpaca": {"instruction": "翻译：今天天气很好", "input": "请用英文", "output": "The weather is nice today.",
               "system": "你是翻译。", "history": [["第一个问题", "first answer"]]},
    "sharegpt": {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "hello there"},
                                   {"from": "gpt", "value": "hi"}, {"from": "human", "value": "二加三等于几"},
                                   {"from": "gpt", "value": "等于五"}]},
    "messages": {"messages": [{"role": "user", "content": "capital of France"},
                              {"role": "assistant", "content": "Paris 巴黎"}]},
}


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def template_for(name, tokenizer):
    return OWN_TEMPLATE if name == "own" else named_template(name, tokenizer)


def label_runs(labels):
    """Contiguous runs of trained positions."""
    runs, current = [], []
    for label in labels:
        if label == -100:
            if current:
                runs.append(current)
            current = []
        else:
            current.append(label)
    return runs + ([current] if current else [])


def squash(text):
    return "".join(text.split())


@pytest.mark.parametrize("template_name", sorted(TEMPLATES) + ["own"])
@pytest.mark.parametrize("record_format", sorted(RECORDS))
def test_labels_are_exactly_the_answers_plus_eos(record_format, template_name, tokenizer):
    messages = conversation_of("test:1", RECORDS[record_format])
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    prompts = [m["content"] for m in messages if m["role"] != "assistant"]
    sample = ConversationTokenizer(tokenizer, template_for(template_name, tokenizer), 1024)("test:1", messages)
    runs = label_runs(sample["labels"])
    assert len(runs) == len(answers)
    for run, answer in zip(runs, answers, strict=True):
        expected = answer + TERMINATORS[template_name] + tokenizer.eos_token
        assert squash(tokenizer.decode(run)) == squash(expected)
        assert run[-1] == tokenizer.eos_token_id
    trained_text = squash(tokenizer.decode([t for run in runs for t in run]))
    assert not any(squash(prompt) in trained_text for prompt in prompts)
    # Only the last answer with --train_on_last_turn_only.
    last_only = ConversationTokenizer(tokenizer, template_for(template_name, tokenizer), 1024, True)("t", messages)
    assert label_runs(last_only["labels"]) == runs[-1:]
    assert last_only["input_ids"] == sample["input_ids"]


# What each template renders after the last answer's EOS to close its turn. "own" never renders
# the tiny tokenizer's EOS </s>: it is added after the turn's "<|im_end|>\n", so nothing follows it.
TURN_ENDS = {"llama2": "", "alpaca": "\n\n", "human_assistant": "", "chatml": "\n", "own": ""}


@pytest.mark.parametrize("template_name", sorted(TEMPLATES) + ["own"])
def test_reward_rows_end_with_the_template_turn_end(template_name, tokenizer):
    """keep_after_turn_end (the reward stage's rows) adds exactly after_turn_end_ids() (what PPO appends to a
    generated answer) to the row that ends at the answer's EOS, and those ids are the text the
    template renders after it."""
    messages = conversation_of("test:1", RECORDS["sharegpt"])
    template = template_for(template_name, tokenizer)
    at_eos = ConversationTokenizer(tokenizer, template, 1024)("t", messages)["input_ids"]
    whole = ConversationTokenizer(tokenizer, template, 1024, keep_after_turn_end=True)("t", messages)
    turn_end = ConversationTokenizer(tokenizer, template, 1024).after_turn_end_ids()
    assert whole["input_ids"] == at_eos + turn_end
    assert at_eos[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(turn_end, clean_up_tokenization_spaces=False).lstrip(" ") == TURN_ENDS[template_name]


def test_truncation_cuts_the_answer_and_drops_prompt_only_samples(tokenizer):
    messages = conversation_of("t", {"instruction": "short question", "output": "一个很长的回答 " * 30})
    conversation_tokenizer = ConversationTokenizer(tokenizer, named_template("alpaca", tokenizer), 1024)
    full = conversation_tokenizer("t", messages)
    prompt_length = full["labels"].index(next(label for label in full["labels"] if label != -100))
    cut = ConversationTokenizer(tokenizer, named_template("alpaca", tokenizer), prompt_length + 3)("t", messages)
    assert cut["input_ids"] == full["input_ids"][: prompt_length + 3]
    assert sum(label != -100 for label in cut["labels"]) == 3
    assert ConversationTokenizer(tokenizer, named_template("alpaca", tokenizer), prompt_length)("t", messages) is None


def test_answers_cut_by_max_seq_length_are_counted(tokenizer, tmp_path, caplog):
    """A sample whose last trained answer max_length cuts loses its turn end (EOS): the model is not taught to stop
    there. Such samples are counted in a warning; a sample cut before its last answer, whose trained answers are
    whole, is not."""
    template = named_template("alpaca", tokenizer)
    long_answer = conversation_of("t", {"instruction": "q", "output": "一个很长的回答 " * 30})
    full = ConversationTokenizer(tokenizer, template, 4096)("t", long_answer)
    assert not full["cut_answer"]
    length = len(full["input_ids"])
    assert not ConversationTokenizer(tokenizer, template, length)("t", long_answer)["cut_answer"]
    assert ConversationTokenizer(tokenizer, template, length - 1)("t", long_answer)["cut_answer"]  # EOS cut off
    # Two turns: the cut in the second prompt leaves the first answer whole.
    two_turns = conversation_of("t", {"instruction": "很长的问题 " * 30, "output": "好",
                                      "history": [["问", "第一个回答"]]})
    labels = ConversationTokenizer(tokenizer, template, 4096)("t", two_turns)["labels"]
    first_answer_end = next(i for i in range(len(labels) - 1) if labels[i] != -100 and labels[i + 1] == -100) + 1
    cut_in_prompt = ConversationTokenizer(tokenizer, template, first_answer_end + 5)("t", two_turns)
    assert not cut_in_prompt["cut_answer"] and cut_in_prompt["labels"][first_answer_end - 1] != -100

    data = tmp_path / "d.jsonl"
    short = {"instruction": "q", "output": "好"}
    fits = len(ConversationTokenizer(tokenizer, template, 4096)("t", conversation_of("t", short))["input_ids"])
    records = [{"instruction": "q", "output": "一个很长的回答 " * 30}] * 2 + [short] * 3
    data.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records), encoding="utf-8")
    with caplog.at_level("WARNING", logger="lorakit.data.build_dataset"):
        built = build_sft_dataset([str(data)], tokenizer, template, fits, str(tmp_path / "cache"))
    assert len(built) == 5
    assert f"2 of 5 answers cut by --max_seq_length {fits}; they lose their turn end" in caplog.text


def test_saved_template_renders_the_training_prompt(tokenizer, tmp_path):
    messages = conversation_of("t", RECORDS["sharegpt"])
    for name in sorted(TEMPLATES):
        template = named_template(name, tokenizer)
        conversation_tokenizer = ConversationTokenizer(tokenizer, template, 1024)
        segments = conversation_tokenizer.segments("t", messages)
        training_prompt = "".join(text for text, _, _ in segments[:-1])  # everything before the last answer
        tokenizer.chat_template = template
        tokenizer.save_pretrained(tmp_path / name)
        reloaded = AutoTokenizer.from_pretrained(tmp_path / name)
        rendered = reloaded.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        assert rendered == training_prompt, name
        prompt_ids = reloaded.apply_chat_template(messages[:-1], tokenize=True, add_generation_prompt=True)["input_ids"]
        sample = conversation_tokenizer("t", messages)
        assert sample["input_ids"][: len(prompt_ids)] == prompt_ids, name
    tokenizer.chat_template = None


def tokenized_arithmetic(tokenizer, count, seed=0):
    conversation_tokenizer = ConversationTokenizer(tokenizer, named_template("human_assistant", tokenizer), 256)
    return [conversation_tokenizer("t", conversation_of("t", r)) for r in arithmetic_records(count, seed)]


def per_token_losses(model, batch):
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], ignore_index=-100, reduction="none"
    )
    return losses, batch["labels"][:, 1:] != -100


def test_packed_loss_equals_unpacked(tokenizer, tiny_model_dir):
    from datasets import Dataset

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    samples = tokenized_arithmetic(tokenizer, 6)
    dataset = Dataset.from_dict({"input_ids": [s["input_ids"] for s in samples],
                                 "labels": [s["labels"] for s in samples],
                                 "length": [len(s["input_ids"]) for s in samples]})
    packed = pack_samples(dataset, 256)
    assert len(packed) < len(samples)  # several samples share a row
    collator = DataCollatorForSupervisedDataset(tokenizer.eos_token_id)
    losses, mask = per_token_losses(model, collator([packed[i] for i in range(len(packed))]))
    packed_loss = {}
    for row in range(len(packed)):
        starts = [i for i, p in enumerate(packed[row]["position_ids"]) if p == 0] + [packed[row]["length"]]
        for start, end in pairwise(starts):
            ids = tuple(packed[row]["input_ids"][start:end])
            span = slice(start, end - 1)
            packed_loss[ids] = (losses[row, span][mask[row, span]].sum() / mask[row, span].sum()).item()
    for sample in samples:
        alone = collator([sample])
        alone_losses, alone_mask = per_token_losses(model, alone)
        expected = (alone_losses[alone_mask].sum() / alone_mask.sum()).item()
        assert abs(packed_loss[tuple(sample["input_ids"])] - expected) <= 1e-5


def test_packed_epoch_padding_below_two_percent(tokenizer):
    from datasets import Dataset

    samples = tokenized_arithmetic(tokenizer, 2000, seed=1)
    dataset = Dataset.from_dict({"input_ids": [s["input_ids"] for s in samples],
                                 "labels": [s["labels"] for s in samples],
                                 "length": [len(s["input_ids"]) for s in samples]})
    packed = pack_samples(dataset, 256)
    collator = DataCollatorForSupervisedDataset(tokenizer.eos_token_id)
    # The order run_sft_with_peft.py's Trainer draws packed rows in (group_by_length).
    order = list(LengthGroupedSampler(8, lengths=packed["length"], generator=torch.Generator().manual_seed(0)))
    real = padded = 0
    for start in range(0, len(order), 8):
        rows = [packed[int(i)] for i in order[start : start + 8]]
        batch = collator(rows)
        real += sum(row["length"] for row in rows)
        padded += batch["input_ids"].numel()
    assert real == sum(dataset["length"])
    assert 1 - real / padded < 0.02, 1 - real / padded


def test_data_split_is_disjoint_complete_and_stable():
    parts = [phase_indices(1000, "6,2,2", phase, seed=7) for phase in (1, 2, 3)]
    assert [len(p) for p in parts] == [600, 200, 200]
    assert sorted(np.concatenate(parts).tolist()) == list(range(1000))
    assert not phase_indices(1000, "6,2,2", 1, seed=8).tolist() == parts[0].tolist()  # the seed matters
    code = ("from lorakit.data.splits import phase_indices; "
            "print(phase_indices(1000, '6,2,2', 2, seed=7).tolist())")
    other_process = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(other_process.stdout.strip().splitlines()[-1]) == parts[1].tolist()


def test_data_split_applies_per_dataset_and_spares_sft_only(tokenizer, tmp_path):
    files = []
    for name, seed in (("a", 0), ("b", 1), ("only", 2)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in arithmetic_records(50, seed)), encoding="utf-8")
        files.append(str(path))
    template = named_template("alpaca", tokenizer)
    dataset = build_sft_dataset(files, tokenizer, template, 256, str(tmp_path / "cache"),
                                data_split="6,2,2", data_phase=1, seed=3, unsplit_files=(files[2],))
    assert len(dataset) == 30 + 30 + 50
    reward_part = build_sft_dataset(files[:2], tokenizer, template, 256, str(tmp_path / "cache"),
                                    data_split="6,2,2", data_phase=2, seed=3)
    assert len(reward_part) == 10 + 10
    sft_rows = {tuple(ids) for ids in dataset["input_ids"]}
    assert not any(tuple(ids) in sft_rows for ids in reward_part["input_ids"])


def test_parallel_tokenization_gives_the_same_samples(tokenizer, tmp_path):
    """--preprocessing_num_workers 2 forks two tokenizing processes over shards of 256
    conversations; the samples, their order and the drop count are those of one process."""
    path = tmp_path / "a.jsonl"
    records = arithmetic_records(700, 5)
    records[650]["instruction"] = "很长的问题 " * 200  # dropped: no answer token fits after this prompt
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in records), encoding="utf-8")
    template = named_template("alpaca", tokenizer)
    built = {num_proc: build_sft_dataset([str(path)], tokenizer, template, 256, str(tmp_path / f"cache{num_proc}"),
                                         num_proc=num_proc)
             for num_proc in (1, 2)}
    assert len(built[1]) == 700 - 1 and built[1].to_dict() == built[2].to_dict()


@pytest.fixture(scope="module")
def arithmetic_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_data")
    (root / "train").mkdir()
    (root / "train" / "arith.jsonl").write_text("\n".join(json.dumps(r) for r in arithmetic_records(400, 0)) + "\n")
    (root / "valid.json").write_text(json.dumps(arithmetic_records(40, 99)))
    return str(root / "train"), str(root / "valid.json")


def test_sft_lowers_eval_loss_and_saves_template(tiny_model_dir, arithmetic_files, tmp_path):
    train_dir, valid = arithmetic_files
    out = tmp_path / "out"
    args = tiny_sft_args(tiny_model_dir, out, tmp_path / "cache", dataset_dir=train_dir, validation_file=valid,
                         template="human_assistant", packing=True, max_steps=30, learning_rate=1e-2, save_steps=30,
                         eval_strategy="steps", eval_steps=30, eval_on_start=True, neftune_noise_alpha=5)
    assert_ok(run_script(args, script=SFT_SCRIPT))
    evals = [e for e in log_history(out) if "eval_loss" in e]
    assert evals[-1]["eval_loss"] < 0.7 * evals[0]["eval_loss"], evals
    assert evals[-1]["eval_accuracy"] > evals[0]["eval_accuracy"]
    saved = AutoTokenizer.from_pretrained(out / "sft_lora_model")
    assert saved.chat_template == named_template("human_assistant", saved)
    assert (out / "sft_lora_model" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_sft_deepspeed_zero2_and_zero3_two_processes_train_alike(tiny_model_dir, arithmetic_files, tmp_path):
    """Partitioning is an implementation detail: on the same data and seed, ZeRO-2 and ZeRO-3 log the same
    losses, the loss falls, and each saves a full-shape adapter with the same weights. The chunked loss runs
    8 positions a chunk, so that a batch takes many chunks (under ZeRO-3 each rank calls the head as often as
    the rank with the most, chunked_loss.token_logprobs)."""
    train_dir, _ = arithmetic_files
    runs = {}
    for config in ("ds_zero2_no_offload", "ds_zero3_no_offload"):
        out = tmp_path / config
        args = tiny_sft_args(tiny_model_dir, out, tmp_path / "cache", dataset_dir=train_dir, template="chatml",
                             packing=True, max_steps=4, save_steps=4, lora_dropout=0.0,
                             deepspeed=os.path.join(REPO, "ds_configs", f"{config}.json"))
        assert_ok(run_script(args, nproc=2, script=SFT_SCRIPT, timeout=300,
                             wrapper=small_chunks_wrapper(tiny_model_dir, 8)))
        weights = adapter_weights(out / "sft_lora_model")
        assert weights["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (8, 64)
        runs[config] = (losses_of(out), weights)
    (zero2_losses, zero2_weights), (zero3_losses, zero3_weights) = runs.values()
    assert len(zero2_losses) == len(zero3_losses) == 4
    assert zero2_losses == pytest.approx(zero3_losses, rel=1e-4)
    assert zero2_losses[-1] < zero2_losses[0]
    assert zero2_weights.keys() == zero3_weights.keys()
    assert max((zero2_weights[k] - zero3_weights[k]).abs().max().item() for k in zero2_weights) <= 1e-4


# (processes, token budget): --max_tokens_per_batch's batches (trainers.token_batches) resume under ZeRO-2 too.
SFT_RESUME_CASES = {"one_process": (1, None), "zero2_two_processes": (2, None),
                    "zero2_two_processes_token_budget": (2, 640)}


@pytest.fixture(scope="module", params=list(SFT_RESUME_CASES))
def sft_resume(request, tiny_model_dir, arithmetic_files, tmp_path_factory):
    """An uninterrupted packed run and the same run killed at seeded random steps and while writing a checkpoint,
    rerun after each kill until it finished (and, forked, one killed as it ends): each process forked (one
    process), or under torchrun with ZeRO-2 (helpers/kill_points.py); the last case's batches are token budgets of
    rows of up to 256 tokens, 640 a batch (2 to many rows)."""
    train_dir, _ = arithmetic_files
    nproc, budget = SFT_RESUME_CASES[request.param]
    root = tmp_path_factory.mktemp(f"sft_resume_{request.param}")
    extra = {"deepspeed": os.path.join(REPO, "ds_configs", "ds_zero2_no_offload.json")} if nproc == 2 else {}
    if budget:
        extra["max_tokens_per_batch"] = budget

    def args_for(output_dir):
        return tiny_sft_args(tiny_model_dir, output_dir, root / "cache", dataset_dir=train_dir, template="llama2",
                             packing=True, save_steps=2, **extra)

    seed = f"sft-{request.param}" if budget else f"sft-{nproc}"  # the cases before token budgets keep their kills
    return resume_proof(nproc, SFT_SCRIPT, args_for, root, seed=seed, total=10, save_steps=2)


@pytest.mark.slow
def test_sft_resume_after_kills_at_random_steps_runs_only_the_remaining_steps_and_equals_uninterrupted(sft_resume):
    sft_resume.check_processes_after_random_kills()
    assert "resuming from" in sft_resume.resumed_output()
    sft_resume.check_bit_identical("sft_lora_model")


@pytest.mark.slow
def test_sft_resume_after_a_kill_while_writing_a_checkpoint_starts_from_the_last_complete_one(sft_resume):
    sft_resume.check_process_after_mid_save_kill()


@pytest.mark.parametrize("sft_resume", ["one_process"], indirect=True)
@pytest.mark.slow
def test_sft_rerun_of_a_run_killed_after_its_last_step_trains_no_step_and_equals_uninterrupted(sft_resume):
    sft_resume.check_process_after_end_kill()
    sft_resume.check_bit_identical("sft_lora_model", run_name="ended")


GOOD = {"instruction": "q", "output": "a"}
BAD_SFT_CASES = {
    "broken_json": (b'{"instruction": "q", "output": "a"}\n{"instruction": \n', "d.jsonl:2: not valid JSON"),
    "missing_output": ({"instruction": "q"}, "d.jsonl:2: field 'output' is missing"),
    "missing_conversations": ({"conversation": []},
                              "d.jsonl:2: no 'instruction'/'output', 'conversations' or 'messages'"),
    "unknown_role": ({"conversations": [{"from": "human", "value": "q"}, {"from": "bot", "value": "a"}]},
                     "d.jsonl:2: field 'conversations[1].from' has unknown role 'bot'"),
    "two_user_turns": ({"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q2"},
                                     {"role": "assistant", "content": "a"}]},
                       "d.jsonl:2: field 'messages[1]': two consecutive user turns"),
    "empty_answer": ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": " "}]},
                     "d.jsonl:2: field 'conversations[1]': empty answer"),
    "ends_on_user": ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                   {"role": "user", "content": "q2"}]},
                     "d.jsonl:2: field 'messages[2]': the conversation ends on a user turn"),
}


@pytest.mark.parametrize("case", sorted(BAD_SFT_CASES) + ["unknown_template"])
def test_sft_bad_input_is_refused_cleanly(case, tiny_model_dir, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    options = {"template": "alpaca"}
    if case == "unknown_template":
        content, expected = (json.dumps(GOOD) + "\n").encode(), "--template vicuna is unknown"
        options["template"] = "vicuna"
    else:
        bad, expected = BAD_SFT_CASES[case]
        content = bad if isinstance(bad, bytes) else (json.dumps(GOOD) + "\n" + json.dumps(bad) + "\n").encode()
    (data / "d.jsonl").write_bytes(content)
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = tiny_sft_args(tiny_model_dir, out, cache, dataset_dir=data, **options)
    check_refused(refuse(SFT_SCRIPT, args, in_process=case != "broken_json"), expected)
    assert not out.exists()
    assert not cache.exists() or not list(cache.iterdir())


def test_sft_cache_key_covers_template_and_length(tokenizer, tmp_path, caplog):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in arithmetic_records(20, 0)), encoding="utf-8")
    cache = str(tmp_path / "cache")

    def build(template_name, max_length):
        caplog.clear()
        with caplog.at_level("INFO", logger="lorakit.data.build_dataset"):
            built = build_sft_dataset([str(data)], tokenizer, named_template(template_name, tokenizer), max_length,
                                      cache)
        return built, "cache hit" in caplog.text

    first, hit = build("chatml", 256)
    assert not hit
    again, hit = build("chatml", 256)
    assert hit and again["input_ids"] == first["input_ids"]
    assert not build("alpaca", 256)[1]
    assert not build("chatml", 64)[1]
    assert len([name for name in os.listdir(cache) if name.startswith("sft-")]) == 3
