"""What the demo runs with: its pipeline config (configs/pipeline/demo.yaml), the seeds and sizes of the data it
writes, the recipes of the stages it runs beside the chain (DPO_RECIPE, GRPO_RECIPE), its two plans (FULL for
`make demo`, QUICK for `make demo QUICK=1`), and the Demo state its stages (lorakit.demo.stages) hand on,
the reward scorer of the held-out evaluation included."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from lorakit.demo.prepare_default import CORPUS_FILE
from lorakit.demo.report import Figures

if TYPE_CHECKING:  # the models load lazily, inside the stages that score them (lorakit.demo.stage_evaluation)
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# The demo runs in the repository's root (`make demo`): its config and the paths the config names (.cache/demo,
# outputs/demo) are relative to it.
DEMO_CONFIG = Path("configs") / "pipeline" / "demo.yaml"

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
# DPO runs again with the same second seed: its verdict needs the spread between two seeds too (docs/demo.md,
# "Verdict rules"); about 2 minutes of the full demo (its 20 steps, eval and held-out answers).
DPO_SECOND_SEED = PPO_SECOND_SEED
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
    demo's own runs of stages beside the chain in ppo_seed<N>/, dpo/ and dpo_seed<N>/."""

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


def grpo_recipe(demo: Demo) -> dict[str, Any]:
    return {**GRPO_RECIPE, **demo.plan.grpo_overrides, "dataset_dir": str(demo.path("grpo_data", "train"))}
