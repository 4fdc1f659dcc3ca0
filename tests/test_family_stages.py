"""Every stage on each model family (helpers/families.py: real tokenizers and chat templates, tiny models),
cheaply:

- SFT with the tokenizer's own template on Qwen3, Mistral-Nemo and Phi-3.5, run as users run it (one process
  each): the loss falls, and the adapter's tokenizer carries the family's template byte for byte;
- continued pretraining and SFT on the other families (GPT-2, which has no template, with --template chatml);
- a reward model and PPO on Qwen2.5 and Llama-3 (whose tokenizer has no pad token), and the reward score read
  at the end of the rendered turn, for the reward stage's rows and for PPO's generated answers alike;
- chat.py's batch mode and the server on the SFT adapters: replies stop at the template's turn end (Phi-3.5's
  <|end|> is not its EOS).

Apart from the SFT runs above, the scripts run in this process through run_cli, as their command line runs
them: a process start with transformers, peft and DeepSpeed imported costs ~11 s, and this file must stay
within a few minutes on 2 cores; test_sft.py, test_reward.py, test_ppo.py and test_inference.py run the same
scripts as processes.
"""

import contextlib
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers.commands import (
    PT_SCRIPT,
    REPO,
    SFT_SCRIPT,
    TRAINING,
    assert_ok,
    free_port,
    options_to_argv,
    run_in_process,
    script_env,
)
from helpers.families import FAMILIES, VENDORED
from helpers.run_outputs import adapter_weights, log_history, losses_of

RM_SCRIPT = os.path.join(TRAINING, "run_reward.py")
PPO_SCRIPT = os.path.join(TRAINING, "run_ppo.py")
CHAT_SCRIPT = os.path.join(REPO, "scripts", "inference", "chat.py")

OWN_TEMPLATE = ("qwen3", "mistral", "phi3.5")
OTHERS = ("llama3", "qwen2.5", "gemma2", "gpt2", "deepseek-r1-qwen")
RLHF = ("qwen2.5", "llama3")
# The token with which each template closes an assistant turn.
TURN_END = {"llama3": "<|eot_id|>", "qwen2.5": "<|im_end|>", "qwen3": "<|im_end|>", "mistral": "</s>",
            "phi3.5": "<|end|>"}
# The last token of a rendered turn, where the reward model reads its score, and what PPO appends to a
# generated answer that ended with the turn-end token: ChatML's "\n" after <|im_end|>; nothing after Llama-3's.
TURN_LAST = {"qwen2.5": "\n", "llama3": "<|eot_id|>"}
TURN_TAIL = {"qwen2.5": "\n", "llama3": ""}
# A tiny random model's head cannot single out one of 32k-151k tokens: its logits span about +-0.6, so LoRA
# alone lowers the loss by well under a nat (measured on Qwen3: 11.98 -> 11.55 in 10 steps). Scaling the
# final norm gives the logits the range of a trained model's; LoRA can then steer them onto the answers.
NORM_SCALE = 32

SYSTEM_CONVERSATION = [{"role": "system", "content": "You are terse."},
                       {"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}]
CONVERSATIONS = [
    [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Green."}],
    [{"role": "user", "content": "你好吗？"}, {"role": "assistant", "content": "我很好。"}],
]
TRAINING_OPTIONS = {"per_device_train_batch_size": 4, "learning_rate": 1e-2, "warmup_steps": 0,
                    "lr_scheduler_type": "constant", "logging_steps": 1, "save_strategy": "no", "seed": 42,
                    "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0, "torch_dtype": "float32",
                    "report_to": "none", "dataloader_num_workers": 0}
# Enough steps for every prompt's answer to end its turn (5 of 5 on Qwen3 and Phi-3.5 at 24 steps; at 12, one or
# none of Qwen3's, as float32 rounding fell): the turn-end test below then does not hang on rounding luck.
SFT_STEPS = 24
PPO_STEP_KEYS = ("reward_mean", "score_mean", "kl", "policy_loss", "value_loss", "loss")


# ----------------------------------------------------------------------------- running the scripts


def assert_ran(result) -> str:
    """The output (stdout, then stderr) of a run_in_process result that exited 0."""
    assert_ok(result)
    return result.stdout + result.stderr


def run_processes(jobs: dict, workers: int = 2) -> dict:
    """name -> CompletedProcess of each (script, args), `workers` processes at a time on one torch thread
    each: two processes with torch's default threads on 2 cores spin-wait on each other."""
    env = {**script_env(), "OMP_NUM_THREADS": "1"}

    def run(job):
        script, args = job
        return subprocess.run([sys.executable, script] + [str(a) for a in args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(workers) as pool:
        futures = {name: pool.submit(run, job) for name, job in jobs.items()}
    return {name: future.result() for name, future in futures.items()}


def training_args(model_dir, output_dir, cache_dir, **overrides) -> list:
    options = {"model_name_or_path": model_dir, "output_dir": output_dir, "data_cache_dir": cache_dir,
               **TRAINING_OPTIONS, **overrides}
    return ["--do_train", "--use_cpu"] + options_to_argv(options)


def assert_trained_adapter(adapter_dir) -> None:
    weights = adapter_weights(adapter_dir)
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert any(k.endswith("lora_B.weight") and w.abs().max() > 0 for k, w in weights.items()), adapter_dir


def vendored_template(name: str) -> bytes:
    with open(os.path.join(VENDORED, "templates", FAMILIES[name].template), "rb") as handle:
        return handle.read()


# ----------------------------------------------------------------------------- data and models


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def data_files(tmp_path_factory):
    """SFT data (the same few conversations 16 times: learnable in a dozen steps), with and without the
    system prompt Gemma-2's template refuses, and chat prompts."""
    root = tmp_path_factory.mktemp("family_data")
    with_system = [SYSTEM_CONVERSATION] + CONVERSATIONS
    return {
        "sft": write_jsonl(root / "sft.jsonl", [{"messages": c} for c in with_system * 16]),
        "sft_no_system": write_jsonl(root / "sft_no_system.jsonl", [{"messages": c} for c in CONVERSATIONS * 16]),
        "prompts": write_jsonl(root / "prompts.jsonl", [{"messages": c[:-1]} for c in with_system]
                               + [{"prompt": "Name a color."}, {"prompt": "Say something else."}]),
    }


def learnable_copy(source: str, out: str) -> str:
    """The family's tiny model with its final norm scaled by NORM_SCALE (see there), tokenizer included."""
    shutil.copytree(source, out)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        model.get_decoder().norm.weight.mul_(NORM_SCALE)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def own_template_sft(family_model_dir, data_files, tmp_path_factory):
    """name -> (base model dir, output dir) of an SFT run with the tokenizer's own template, run as a process,
    two at a time."""
    root = tmp_path_factory.mktemp("own_template_sft")
    bases = {name: learnable_copy(family_model_dir(name), str(root / f"{name}_base")) for name in OWN_TEMPLATE}
    jobs = {name: (SFT_SCRIPT, training_args(bases[name], root / name, root / "cache", data_path=data_files["sft"],
                                             max_seq_length=128, max_steps=SFT_STEPS))
            for name in OWN_TEMPLATE}
    for result in run_processes(jobs).values():
        assert_ok(result)
    return {name: (bases[name], root / name) for name in OWN_TEMPLATE}


@pytest.fixture(scope="module")
def other_family_runs(family_model_dir, data_files, pretrain_dir, tmp_path_factory):
    """name -> {"pt": output dir, "sft": output dir}: a few steps of each stage, on the family's random model."""
    root = tmp_path_factory.mktemp("other_families")
    runs = {}
    for name in OTHERS:
        model_dir, out = family_model_dir(name), root / name
        assert_ran(run_in_process(PT_SCRIPT, training_args(
            model_dir, out / "pt", root / "cache", dataset_dir=pretrain_dir, block_size=64, max_steps=3,
            per_device_train_batch_size=2)))
        data = data_files["sft_no_system" if name == "gemma2" else "sft"]
        template = {"template": "chatml"} if FAMILIES[name].template is None else {}
        assert_ran(run_in_process(SFT_SCRIPT, training_args(
            model_dir, out / "sft", root / "cache", data_path=data, max_seq_length=128, max_steps=4,
            per_device_train_batch_size=2, **template)))
        runs[name] = {"pt": out / "pt", "sft": out / "sft"}
    return runs


@pytest.fixture(scope="module")
def reward_runs(family_model_dir, tmp_path_factory):
    """name -> output dir of a reward run on the repository's sample pairs."""
    root = tmp_path_factory.mktemp("family_reward")
    pairs = os.path.join(REPO, "data", "rm_sample", "pairs.jsonl")
    for name in RLHF:
        assert_ran(run_in_process(RM_SCRIPT, training_args(
            family_model_dir(name), root / name, root / "cache", data_path=pairs, max_seq_length=256, max_steps=2,
            per_device_train_batch_size=2)))
    return {name: root / name for name in RLHF}


@pytest.fixture(scope="module")
def ppo_runs(family_model_dir, other_family_runs, reward_runs, tmp_path_factory):
    """(name, placement) -> (output dir, log) of two PPO iterations from the SFT adapter against the reward
    adapter: each family on a shared base, and Qwen2.5 with separate models too."""
    root = tmp_path_factory.mktemp("family_ppo")
    runs = {}
    for name, placement in (("qwen2.5", "shared"), ("llama3", "shared"), ("qwen2.5", "separate")):
        model_dir, out = family_model_dir(name), root / f"{name}-{placement}"
        options = {"actor_model_name_or_path": model_dir, "reward_model_name_or_path": model_dir,
                   "actor_lora_model": other_family_runs[name]["sft"] / "sft_lora_model",
                   "reward_lora_model": reward_runs[name] / "rm_lora_model",
                   "data_path": os.path.join(REPO, "data", "ppo_sample", "prompts.jsonl"),
                   "shared_base": str(placement == "shared").lower(), "max_prompt_seq_len": 96,
                   "max_answer_seq_len": 12, "per_device_generation_batch_size": 4,
                   "per_device_training_batch_size": 4, "max_steps": 2, "lora_dropout": 0.0, "torch_dtype": "float32",
                   "report_to": "none", "save_strategy": "no", "logging_steps": 1, "seed": 1, "output_dir": out}
        runs[name, placement] = (out, assert_ran(run_in_process(PPO_SCRIPT, ["--use_cpu"] + options_to_argv(options))))
    return runs


# ----------------------------------------------------------------------------- training stages


@pytest.mark.parametrize("name", OWN_TEMPLATE)
def test_sft_with_the_family_template_learns_and_saves_it(name, own_template_sft):
    """Masked with the family's own template (Mistral-Nemo's moves the system prompt, Qwen3's opens a think
    block), the answers are learnt; the adapter's tokenizer keeps that template."""
    _, out = own_template_sft[name]
    losses = losses_of(out)
    # Measured: 15.3-19.8 -> 1.6-2.7 in 12 steps (the scaled head starts above log(vocabulary)).
    assert len(losses) == SFT_STEPS and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < 0.4 * losses[0], losses
    adapter = out / "sft_lora_model"
    assert_trained_adapter(adapter)
    # transformers 5 saves the template beside tokenizer_config.json: byte for byte the family's own.
    assert (adapter / "chat_template.jinja").read_bytes() == vendored_template(name)
    assert AutoTokenizer.from_pretrained(adapter).chat_template.encode("utf-8") == vendored_template(name)


@pytest.mark.parametrize("name", OTHERS)
def test_pretraining_and_sft_train_and_save(name, other_family_runs):
    """Each stage trains (finite losses, LoRA B moved) and saves its adapter, the SFT one with the template it
    trained with: the family's own, or chatml for GPT-2."""
    from lorakit.records.chat_templates import named_template

    runs = other_family_runs[name]
    for stage, adapter, steps in (("pt", "pt_lora_model", 3), ("sft", "sft_lora_model", 4)):
        losses = losses_of(runs[stage])
        assert len(losses) == steps and all(0 < loss < 30 for loss in losses), (stage, losses)
        assert_trained_adapter(runs[stage] / adapter)
    tokenizer = AutoTokenizer.from_pretrained(runs["sft"] / "sft_lora_model")
    if FAMILIES[name].template is None:
        assert tokenizer.chat_template == named_template("chatml", tokenizer)
    else:
        assert tokenizer.chat_template.encode("utf-8") == vendored_template(name)


@pytest.mark.parametrize("name", RLHF)
def test_reward_model_trains_and_saves(name, reward_runs):
    """With the family's template and pad token (Llama-3 has none), the reward stage trains and saves LoRA and
    the score head."""
    out = reward_runs[name]
    losses = losses_of(out)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses), losses
    assert_trained_adapter(out / "rm_lora_model")
    assert any("score" in key for key in adapter_weights(out / "rm_lora_model"))


@pytest.mark.parametrize("name", RLHF)
def test_saved_pad_token_lets_transformers_read_the_score_where_we_do(name, reward_runs):
    """transformers' sequence classifiers score the last id that is not the pad id: the pad token saved
    with the reward model must not be the token its rows end with (Llama-3 has no pad, and its rows end
    with EOS <|eot_id|>; padding with EOS would make a merged model read one token early elsewhere)."""
    from transformers import AutoTokenizer

    from lorakit.data.conversation_tokenizer import ConversationTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reward_runs[name] / "rm_lora_model")
    conversation = [{"role": "user", "content": "Rate this."}, {"role": "assistant", "content": "Fine."}]
    row = ConversationTokenizer(tokenizer, tokenizer.chat_template, 512, keep_after_turn_end=True)("t", conversation)
    ids = torch.tensor(row["input_ids"] + [tokenizer.pad_token_id] * 3)
    last_not_pad = int((torch.arange(len(ids)) * (ids != tokenizer.pad_token_id)).argmax())
    assert last_not_pad == len(row["input_ids"]) - 1
    assert tokenizer.pad_token in tokenizer.all_special_tokens


@pytest.mark.parametrize("name, placement", [("qwen2.5", "shared"), ("llama3", "shared"), ("qwen2.5", "separate")])
@pytest.mark.slow
def test_ppo_iterations_log_finite_reward_and_kl(name, placement, ppo_runs):
    """PPO from the SFT adapter against the reward adapter runs its iterations and saves actor and critic."""
    out, log = ppo_runs[name, placement]
    assert f"placement: {'shared base' if placement == 'shared' else 'separate models'}" in log
    # Answers end where the template ends a turn, and are scored where the reward model read its scores.
    assert (f"answers end with {TURN_END[name]!r} and are scored after the template's turn end "
            f"{TURN_TAIL[name]!r}") in log
    steps = [entry for entry in log_history(out) if "loss" in entry]
    assert len(steps) == 2, steps
    for entry in steps:
        assert all(math.isfinite(entry[key]) for key in PPO_STEP_KEYS), entry
    for adapter in ("ppo_lora_model", "critic"):
        assert_trained_adapter(out / adapter)


@pytest.mark.slow
def test_ppo_placements_give_the_same_iterations(ppo_runs):
    """One base with an adapter per role, or a model per role: the same PPO iterations on Qwen2.5."""
    shared, separate = ([entry for entry in log_history(ppo_runs["qwen2.5", placement][0]) if "loss" in entry]
                        for placement in ("shared", "separate"))
    assert len(shared) == len(separate) == 2
    for first, second in zip(shared, separate, strict=True):
        for key in PPO_STEP_KEYS:
            assert abs(first[key] - second[key]) <= 1e-4 * max(1.0, abs(first[key])), (key, first, second)


# ----------------------------------------------------------------------------- where scores are read

PAIR_CONTEXT = [{"role": "user", "content": "Review the kettle, please."}]
PAIR_ANSWERS = ("Boils fast and quiet. 很好。", "It leaked.")


def pair_tokenizer(family_dir: str, variant: str):
    tokenizer = AutoTokenizer.from_pretrained(family_dir)
    if variant == "base":  # as Qwen2.5 base models have it: EOS is <|endoftext|>, which is the pad token too
        tokenizer.eos_token = "<|endoftext|>"
        assert tokenizer.pad_token_id == tokenizer.eos_token_id
    return tokenizer


def random_reward_model(family_dir: str):
    """The family's model with a random score head, pooled as the reward stage pools."""
    from transformers import AutoConfig

    from lorakit.models.heads import reward_model_class

    config = AutoConfig.from_pretrained(family_dir, num_labels=1)
    torch.manual_seed(0)
    return reward_model_class(config).from_pretrained(family_dir, config=config, dtype=torch.float32).eval()


def assert_pooled_at_row_ends(batch: dict, rows: list, share_prefix: bool) -> None:
    """The position each layout pools is the last token of each row: chosen rows then rejected ones."""
    from lorakit.core.pair_segments import PAIR_CHOSEN, PAIR_REJECTED
    from lorakit.models.positions import last_position

    if share_prefix:
        segments = batch["pair_segments"]
        for row, segment in zip(rows, (PAIR_CHOSEN, PAIR_REJECTED), strict=True):
            at = last_position(segments == segment)[0]
            assert batch["input_ids"][0, at] == row[-1] and batch["position_ids"][0, at] == len(row) - 1
    else:
        assert last_position(batch["attention_mask"]).tolist() == [len(row) - 1 for row in rows]


def closed_rollout(tokenizer, template: str, rows: list) -> tuple:
    """(ids, mask) of the pair's answers as PPO holds them: a left-padded prompt, each answer up to its
    turn-end token, generate's padding after it, then closed by append_turn_end."""
    from lorakit.data.conversation_tokenizer import ConversationTokenizer
    from lorakit.data.prompts import tokenize_prompts
    from lorakit.rl.experience import answer_mask, append_turn_end, left_pad

    answers_tokenizer = ConversationTokenizer(tokenizer, template, 512)
    end_id, tail = answers_tokenizer.answer_end_id(), answers_tokenizer.after_turn_end_ids()
    prompt = tokenize_prompts([("t", PAIR_CONTEXT)], tokenizer, template, 512, "prompts")[0]
    answers = []
    for row in rows:
        assert row[: len(prompt)] == prompt
        answers.append(row[len(prompt) : len(row) - len(tail)])
        assert answers[-1][-1] == end_id  # the answer the model writes ends with the turn-end token
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id  # PPO's pad
    prompt_ids, prompt_mask = left_pad([prompt] * len(rows), len(prompt) + 2, pad)
    width = max(map(len, answers)) + 3
    answer_ids = torch.tensor([a + [pad] * (width - len(a)) for a in answers])
    mask, has_end = answer_mask(answer_ids, end_id)
    assert has_end.all()
    ids, mask = append_turn_end(torch.cat([prompt_ids, answer_ids], 1), torch.cat([prompt_mask, mask], 1), end_id, tail)
    return ids, mask, end_id, tail


@pytest.mark.parametrize("name, variant", [("qwen2.5", "instruct"), ("qwen2.5", "base"), ("llama3", "no pad")])
def test_scores_are_read_at_the_end_of_the_rendered_turn(name, variant, family_model_dir):
    """The reward stage's rows are the rendered conversations, and both of its layouts pool each at its last
    token (ChatML's "\n" after <|im_end|>, Llama-3's <|eot_id|>); PPO's answers, which end with the turn-end
    token, closed by append_turn_end, are exactly those rows and score the same, whatever the pad token."""
    from lorakit.data.build_dataset import DataCollatorForPreferencePairs
    from lorakit.data.conversation_tokenizer import ConversationTokenizer
    from lorakit.models.heads import score_pairs, score_sequences

    tokenizer = pair_tokenizer(family_model_dir(name), variant)
    assert (tokenizer.pad_token is None) == (name == "llama3")
    template = tokenizer.chat_template
    rows = []
    for answer in PAIR_ANSWERS:
        conversation = PAIR_CONTEXT + [{"role": "assistant", "content": answer}]
        row = ConversationTokenizer(tokenizer, template, 512, keep_after_turn_end=True)("t", conversation)
        rows.append(row["input_ids"])
        rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
        assert rows[-1] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(rows[-1][-1:]) == TURN_LAST[name]
    model = random_reward_model(family_model_dir(name))
    with torch.no_grad():
        alone = torch.cat([score_sequences(model, torch.tensor([row]), torch.ones(1, len(row), dtype=torch.long))
                           for row in rows])
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        for share_prefix in (False, True):
            batch = DataCollatorForPreferencePairs(pad, 8, share_prefix)(
                [{"chosen_input_ids": rows[0], "rejected_input_ids": rows[1]}])
            assert_pooled_at_row_ends(batch, rows, share_prefix)
            torch.testing.assert_close(torch.cat(score_pairs(model, batch)), alone, atol=1e-5, rtol=1e-5)
        ids, mask, end_id, tail = closed_rollout(tokenizer, template, rows)
        assert tokenizer.decode([end_id]) == TURN_END[name] and tokenizer.decode(tail) == TURN_TAIL[name]
        for row, row_ids, row_mask in zip(rows, ids, mask, strict=True):
            assert row_ids[row_mask.bool()].tolist() == row
        torch.testing.assert_close(score_sequences(model, ids, mask), alone, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- chat and server

CHAT_FAMILIES = ("phi3.5", "qwen3")
MAX_NEW_TOKENS = 12


def prompt_messages(record: dict) -> list:
    return record["messages"] if "messages" in record else [{"role": "user", "content": record["prompt"]}]


@pytest.fixture(scope="module")
def chat_predictions(own_template_sft, data_files, tmp_path_factory):
    """name -> chat.py's batch predictions (greedy) with the family's SFT adapter."""
    root = tmp_path_factory.mktemp("family_chat")
    predictions = {}
    for name in CHAT_FAMILIES:
        base, out = own_template_sft[name]
        path = root / f"{name}.jsonl"
        assert_ran(run_in_process(CHAT_SCRIPT, [
            "--base_model", base, "--lora_model", out / "sft_lora_model", "--data_file", data_files["prompts"],
            "--predictions_file", path, "--batch_size", "4", "--max_new_tokens", MAX_NEW_TOKENS,
            "--temperature", "0", "--repetition_penalty", "1.0"]))
        predictions[name] = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return predictions


def greedy_until_eos(base: str, adapter: str, messages_list: list) -> tuple:
    """(tokenizer, generated ids of each conversation): plain greedy generate that stops at EOS only."""
    from peft import PeftModel

    tokenizer = AutoTokenizer.from_pretrained(adapter)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter).eval()
    outputs = []
    for messages in messages_list:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            output = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=MAX_NEW_TOKENS, eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.eos_token_id)
        outputs.append(output[0, ids.shape[1]:].tolist())
    return tokenizer, outputs


@pytest.mark.parametrize("name", CHAT_FAMILIES)
def test_batch_chat_replies_stop_at_the_turn_end(name, own_template_sft, data_files, chat_predictions):
    """chat.py answers every prompt with greedy generation's text up to the template's turn-end token,
    not past it: Phi-3.5's <|end|> is not its EOS, and plain generation goes on after it."""
    base, out = own_template_sft[name]
    with open(data_files["prompts"], encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle]
    lines = chat_predictions[name]
    assert len(lines) == len(records)
    tokenizer, outputs = greedy_until_eos(base, str(out / "sft_lora_model"), [prompt_messages(r) for r in records])
    end_id = tokenizer.convert_tokens_to_ids(TURN_END[name])
    stopped = went_on = 0
    for record, line, generated in zip(records, lines, outputs, strict=True):
        assert line.get("prompt", line.get("messages")) == record.get("prompt", record.get("messages"))
        assert TURN_END[name] not in line["response"]
        if end_id in generated:
            at = generated.index(end_id)
            assert line["response"] == tokenizer.decode(generated[:at], skip_special_tokens=True), generated
            assert line["finish_reason"] == "stop"
            stopped, went_on = stopped + 1, went_on + (at < len(generated) - 1)
        else:
            assert line["finish_reason"] == "length"
    assert stopped >= 1, (lines, outputs)  # the trained adapter does end its turns
    if name == "phi3.5":
        assert went_on >= 1, outputs  # stopping at EOS alone would have shown what follows <|end|>


@contextlib.contextmanager
def serving(args: list):
    """openai_api_server.main() with args, serving from a thread of this process until the block ends;
    uvicorn.Server.run records the server, for the block to stop it. Yields the base URL."""
    import uvicorn

    from lorakit.commands import serve as openai_api_server

    servers, port, real_run = [], free_port(), uvicorn.Server.run

    def run(server, sockets=None):
        servers.append(server)
        real_run(server, sockets)

    root = logging.getLogger()
    saved = sys.argv, root.handlers[:], root.level, uvicorn.Server.run
    sys.argv, uvicorn.Server.run = ["openai_api_server.py"] + [str(a) for a in args] + ["--port", str(port)], run
    thread = threading.Thread(target=openai_api_server.main, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 120
        while not (servers and servers[0].started):
            assert thread.is_alive() and time.time() < deadline, "the server did not start"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        if servers:
            servers[0].should_exit = True
        thread.join(30)
        sys.argv, root.handlers[:], uvicorn.Server.run = saved[0], saved[1], saved[3]
        root.setLevel(saved[2])


def test_server_replies_stop_at_the_turn_end(own_template_sft, chat_predictions):
    """The server on Phi-3.5's SFT adapter answers as chat.py does: up to <|end|>, with finish_reason stop."""
    base, out = own_template_sft["phi3.5"]
    expected = next(line for line in chat_predictions["phi3.5"] if line.get("prompt") == "Name a color.")
    body = {"model": "phi", "messages": [{"role": "user", "content": "Name a color."}], "temperature": 0,
            "max_tokens": MAX_NEW_TOKENS}
    with serving(["--base_model", base, "--lora_model", out / "sft_lora_model", "--model_name", "phi"]) as url:
        request = urllib.request.Request(url + "/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            choice = json.loads(response.read())["choices"][0]
    assert choice["message"]["content"] == expected["response"]
    assert choice["finish_reason"] == expected["finish_reason"] == "stop"
    assert "<|end|>" not in choice["message"]["content"]
