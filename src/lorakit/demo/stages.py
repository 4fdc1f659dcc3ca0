"""The demo's stages, in the order STAGES runs them: each a function that takes the shared Demo state
(lorakit.demo.plan) and returns a dict of figures; demo.report renders the report from those dicts. prepare
writes the model, the corpus and every later stage's data; pipeline runs configs/pipeline/demo.yaml through the
pipeline command, as a user would; the stages after it read what each pipeline stage left, and the held-out
ones (lorakit.demo.stage_evaluation) score its models. PPO and DPO, each also with a second seed, and GRPO run beside
the chain, into directories of their own. A rerun skips the pipeline stages that completed with the same config (their
figures are measured again)."""

from __future__ import annotations

import json
import logging
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from lorakit.commands import command_line
from lorakit.demo.plan import (
    DEMO_CONFIG,
    DPO_RECIPE,
    DPO_SECOND_SEED,
    GRPO_TRAIN_SEED,
    HELDOUT_FRACTION,
    OTHER_TASK_EVERY,
    OTHER_TASK_SEED,
    PPO_SECOND_SEED,
    REWARD_SEED,
    SFT_HELDOUT_SEED,
    SFT_MAX_NEW_TOKENS,
    SFT_MAX_OPERAND,
    SFT_REVIEW_SHARE,
    SFT_TRAIN_SEED,
    SFT_VALIDATION_SEED,
    SPLIT_SEED,
    Demo,
    StageError,
    grpo_recipe,
)
from lorakit.demo.prepare_default import CORPUS_FILE, prepare_model, sentiment_reviews, write_pretraining_corpus
from lorakit.demo.report import Figures
from lorakit.demo.review_tasks import (
    CLEAR_SENTIMENT,
    PreferenceSplit,
    demonstrations,
    preference_pairs,
    prompt_split,
    review_pools,
    with_other_task_rejections,
)
from lorakit.demo.sft_tasks import arithmetic_records, question_key
from lorakit.demo.stage_evaluation import (
    exact_match_after,
    exact_match_after_grpo,
    exact_match_before,
    heldout_after,
    heldout_before,
    heldout_reward,
    reward_after_dpo,
    reward_after_ppo,
    reward_before_ppo,
)
from lorakit.pipeline.config import StageConfig, load_config
from lorakit.pipeline.stages import PlannedStage, plan_stages

logger = logging.getLogger("demo")


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


def continued_pretraining(demo: Demo) -> Figures:
    """LoRA + the new embedding rows on the Chinese text, then merged into the base (pt_merged):
    the model every later stage starts from."""
    flags, out = demo.flags["pretraining"], demo.path("pretraining")
    return {"steps": flags["max_steps"], "batch_size": flags["per_device_train_batch_size"],
            "block_size": flags["block_size"], "learning_rate": flags["learning_rate"],
            "logging_steps": flags["logging_steps"], **loss_summary(out),
            **read_stage_result(out / "eval_results.json")}


def sft_data(demo: Demo) -> Figures:
    return demo.sft_data_figures


def write_sft_data(demo: Demo) -> Figures:
    """Train (.jsonl in a directory, as --dataset_dir wants), validation and held-out sets."""
    plan, data_dir = demo.plan, demo.path("sft_data")
    shutil.rmtree(data_dir, ignore_errors=True)
    train = arithmetic_records(plan.sft_train_records, SFT_TRAIN_SEED, SFT_MAX_OPERAND)
    seen = {question_key(record["instruction"]) for record in train}
    # Review writing too, so the SFT model can answer the prompts PPO will ask; few, so that the
    # arithmetic (the measured task) keeps most of the steps: with one in three, exact match fell
    # from about 20 to 14 / 50 while the answers to review prompts stayed broken Chinese.
    reviews = demonstrations(*review_pools(*sentiment_reviews())["sft"], plan.sft_train_records // SFT_REVIEW_SHARE,
                             SFT_TRAIN_SEED)
    validation, skipped_validation = unseen_records(plan.sft_validation_records, SFT_VALIDATION_SEED, seen)
    seen |= {question_key(record["instruction"]) for record in validation}
    heldout, skipped_heldout = unseen_records(plan.sft_heldout_records, SFT_HELDOUT_SEED, seen)
    overlap = len(seen & {question_key(record["instruction"]) for record in heldout})
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
    records, _ = unseen_records(count, GRPO_TRAIN_SEED,
                                {question_key(record["instruction"]) for record in demo.sft_heldout})
    shutil.rmtree(demo.path("grpo_data"), ignore_errors=True)
    write_jsonl(demo.path("grpo_data", "train", "arithmetic.jsonl"), records)


def supervised_fine_tuning(demo: Demo) -> Figures:
    flags, out = demo.flags["sft"], demo.path("sft")
    train = read_stage_result(out / "train_results.json")
    return {"steps": flags["max_steps"], "batch_size": flags["per_device_train_batch_size"],
            "max_seq_length": flags["max_seq_length"], "learning_rate": flags["learning_rate"],
            "logging_steps": flags["logging_steps"], "max_new_tokens": SFT_MAX_NEW_TOKENS,
            "packed_rows": train.get("train_samples"), "train_runtime": train.get("train_runtime"),
            **loss_summary(out), **read_stage_result(out / "eval_results.json")}


def reward_model(demo: Demo) -> Figures:
    """Pairwise reward model (LoRA + score head) on pt_merged, the SFT adapter's base: asked for a
    review, a positive one is preferred. Held-out accuracy on pairs whose reviews were never trained on."""
    flags, out = demo.flags["reward"], demo.path("reward")
    report = out / "rm_report.json"
    return {"steps": flags["max_steps"], "batch_size": flags["per_device_train_batch_size"],
            "learning_rate": flags["learning_rate"], "logging_steps": flags["logging_steps"],
            "report": json.loads(report.read_text(encoding="utf-8"))["sets"]["held_out"] if report.is_file() else None,
            **demo.reward_data, **loss_summary(out), **read_stage_result(out / "eval_results.json")}


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


def dpo_second_seed(demo: Demo) -> Figures:
    """The DPO stage's own command again with another seed, into dpo_seed<N>/, and its held-out answers scored as the
    first seed's: how far the two seeds' held-out rewards lie apart is the yardstick DPO's gain has to beat."""
    planned = dpo_stage(demo)
    out = demo.path(f"dpo_seed{DPO_SECOND_SEED}")
    run_beside_the_chain(with_flag(planned.command, "output_dir", str(out)) + ["--seed", str(DPO_SECOND_SEED)], out,
                         f"DPO with --seed {DPO_SECOND_SEED}")
    return {"seed": DPO_SECOND_SEED,
            **heldout_reward(demo, demo.path("sft", "sft_lora_model"), out / "dpo_lora_model")}


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
    ("DPO, second seed", dpo_second_seed),
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


class UnseenRecords(NamedTuple):
    """Arithmetic records none of whose questions was seen before, and how many drawn ones were skipped as seen."""

    records: list[dict[str, str]]
    skipped: int


def unseen_records(count: int, seed: int, seen: set[str]) -> UnseenRecords:
    """The first count records of seed whose question (its question_key: a commuted addition is the same
    question) is not in seen nor repeated, and the number skipped. arithmetic_records(n, seed) is a prefix of
    arithmetic_records(2 * n, seed), so drawing more only extends the same sequence."""
    if count <= 0:
        return UnseenRecords([], 0)
    drawn = count
    while True:
        drawn *= 2
        records, skipped, questions = [], 0, set(seen)
        for record in arithmetic_records(drawn, seed, SFT_MAX_OPERAND):
            key = question_key(record["instruction"])
            if key in questions:
                skipped += 1
                continue
            records.append(record)
            questions.add(key)
            if len(records) == count:
                return UnseenRecords(records, skipped)


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


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
    first: dict[str, dict[str, Any]] = {}
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


# ----------------------------------------------------------------------------- run


class StageResults(NamedTuple):
    """What the demo's run of STAGES gave."""

    results: list[dict[str, Any]]  # {"stage", "seconds", "figures"} of each stage that completed, in order
    failed: str | None  # the stage that failed (the run stops there), or None


def run_stages(demo: Demo) -> StageResults:
    """Run STAGES in order; stop at the first that fails and return its name."""
    results: list[dict[str, Any]] = []
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
