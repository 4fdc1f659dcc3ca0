#!/usr/bin/env python
"""Run the demo end to end on CPU: prepare the embedded default (SmolLM2-135M-Instruct and
People's Daily text), measure held-out perplexity, continue pretraining with LoRA through the
toolkit's own script, measure again; then fine-tune the base model on generated arithmetic
questions (supervised, LoRA, packed), measure exact-match accuracy before and after, and report.

    make demo            # about 12 minutes on 2 idle CPU cores, 7-8 of them training
    make demo QUICK=1    # about 2 minutes of training (4 in all): a smoke run

Each stage is a function that takes the shared Demo state and returns a dict of figures; the
report is built from those dicts, so adding a stage (SFT, reward, PPO, merge) means writing one
function and adding it to STAGES.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from exact_match import exact_match, render_prompts  # noqa: E402
from heldout_eval import heldout_nll  # noqa: E402
from prepare_default import CORPUS_FILE, prepare_model, write_pretraining_corpus  # noqa: E402
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


@dataclass(frozen=True)
class Plan:
    """How much work the stages do. Sized from ~6 s per LoRA step (batch 4 x 256 tokens,
    SmolLM2-135M, float32) and ~0.5 s per scored 256-token block, measured on 2 CPU cores; an
    SFT step (8 packed rows x 256 tokens) costs about twice a pretraining step, ~12 s (20 s of
    CPU time on one thread, scaled by the 1.65x that the second core gives a pretraining step)."""

    heldout_chars: int  # held-out documents are taken in order until they reach this many characters
    pt_steps: int
    pt_logging_steps: int  # losses are averaged over this many steps: single batches are noisy
    pt_eval_blocks: int  # the training script's own validation at the end
    pt_learning_rate: float = 1e-3  # high for LoRA, because the demo only trains for a few steps
    # SFT: steps of SFT_BATCH_SIZE packed rows of SFT_MAX_SEQ_LENGTH tokens (~38 samples a step).
    sft_steps: int = 18  # ~3.5 minutes
    sft_logging_steps: int = 3
    sft_heldout_records: int = 50  # exact-match prompts, scored before and after
    sft_validation_records: int = 64  # the training script's own eval loss at the end
    sft_train_records: int = 4_000  # more than the steps consume: each sample is seen at most once
    sft_learning_rate: float = 2e-3


FULL = Plan(heldout_chars=16_000, pt_steps=40, pt_logging_steps=5, pt_eval_blocks=16)
QUICK = Plan(heldout_chars=4_000, pt_steps=8, pt_logging_steps=2, pt_eval_blocks=8,
             sft_steps=5, sft_logging_steps=1, sft_heldout_records=20, sft_validation_records=32)


@dataclass
class Demo:
    """What the stages hand on to later stages."""

    plan: Plan
    cache_dir: Path
    output_dir: Path
    model_dir: str = ""
    train_dir: str = ""
    heldout_texts: list[str] = field(default_factory=list)
    adapters: dict[str, Path] = field(default_factory=dict)
    sft_train_dir: Path | None = None
    sft_validation_file: Path | None = None
    sft_heldout: list[dict] = field(default_factory=list)


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


def heldout_before(demo: Demo) -> dict:
    return heldout_perplexity(demo, adapter=None)


def continued_pretraining(demo: Demo) -> dict:
    plan, out = demo.plan, demo.output_dir / "pt"
    # --overwrite_output_dir keeps old checkpoints: a --quick run's checkpoint-8 would sit next
    # to a full run's checkpoint-40, and a later resume could pick the wrong one.
    shutil.rmtree(out, ignore_errors=True)
    run_training_script("run_clm_pt_with_peft.py", {
        "model_name_or_path": demo.model_dir,
        "dataset_dir": demo.train_dir,
        "data_cache_dir": demo.cache_dir / "data",
        "output_dir": out,
        "overwrite_output_dir": None,
        "do_train": None,
        "use_cpu": None,
        "torch_dtype": "float32",
        "block_size": BLOCK_SIZE,
        "per_device_train_batch_size": 4,
        "lora_rank": 16,
        "lora_alpha": 32,
        "trainable": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "learning_rate": plan.pt_learning_rate,
        "max_steps": plan.pt_steps,
        "logging_steps": plan.pt_logging_steps,
        "save_steps": plan.pt_steps,  # one checkpoint, at the end: shows the resumable layout
        "report_to": "none",
        "validation_split_percentage": 1,
        "max_eval_samples": plan.pt_eval_blocks,
    })
    demo.adapters["pt"] = out / "pt_lora_model"
    return {"steps": plan.pt_steps, "learning_rate": plan.pt_learning_rate,
            "logging_steps": plan.pt_logging_steps, **loss_summary(out),
            **read_json(out / "eval_results.json")}


def heldout_after(demo: Demo) -> dict:
    return heldout_perplexity(demo, adapter=demo.adapters["pt"])


def sft_data(demo: Demo) -> dict:
    """Train (.jsonl in a directory, as --dataset_dir wants), validation and held-out sets."""
    plan, data_dir = demo.plan, demo.output_dir / "sft_data"
    shutil.rmtree(data_dir, ignore_errors=True)
    train = arithmetic_records(plan.sft_train_records, SFT_TRAIN_SEED)
    seen = {record["instruction"] for record in train}
    validation, skipped_validation = unseen_records(plan.sft_validation_records, SFT_VALIDATION_SEED, seen)
    seen |= {record["instruction"] for record in validation}
    heldout, skipped_heldout = unseen_records(plan.sft_heldout_records, SFT_HELDOUT_SEED, seen)
    overlap = len(seen & {record["instruction"] for record in heldout})
    if overlap:
        raise StageError(f"{overlap} held-out questions are also in the train or validation set")
    demo.sft_train_dir = data_dir / "train"
    demo.sft_validation_file = data_dir / "validation.jsonl"
    write_jsonl(demo.sft_train_dir / "arithmetic.jsonl", train)
    write_jsonl(demo.sft_validation_file, validation)
    write_jsonl(data_dir / "heldout.jsonl", heldout)
    demo.sft_heldout = heldout
    logger.info("SFT data in %s: %d train, %d validation, %d held-out records (%d + %d drawn questions "
                "skipped: already in an earlier set)", data_dir, len(train), len(validation), len(heldout),
                skipped_validation, skipped_heldout)
    return {"data_dir": data_dir, "train_records": len(train), "validation_records": len(validation),
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
        "trainable": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "learning_rate": plan.sft_learning_rate,
        "max_steps": plan.sft_steps,
        "logging_steps": plan.sft_logging_steps,
        "save_steps": plan.sft_steps,  # one checkpoint, at the end
        "report_to": "none",
    })
    demo.adapters["sft"] = out / "sft_lora_model"
    train = read_json(out / "train_results.json")
    return {"steps": plan.sft_steps, "batch_size": SFT_BATCH_SIZE, "max_seq_length": SFT_MAX_SEQ_LENGTH,
            "learning_rate": plan.sft_learning_rate, "logging_steps": plan.sft_logging_steps,
            "packed_rows": train.get("train_samples"), "train_runtime": train.get("train_runtime"),
            **loss_summary(out), **read_json(out / "eval_results.json")}


def exact_match_after(demo: Demo) -> dict:
    return heldout_exact_match(demo, adapter=demo.adapters["sft"])


STAGES: list[tuple[str, Callable[[Demo], dict]]] = [
    ("prepare", prepare),
    ("held-out before", heldout_before),
    ("continued pretraining", continued_pretraining),
    ("held-out after", heldout_after),
    ("SFT data", sft_data),
    ("exact match before", exact_match_before),
    ("supervised fine-tuning", supervised_fine_tuning),
    ("exact match after", exact_match_after),
]


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


def heldout_perplexity(demo: Demo, adapter: Path | None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(adapter or demo.model_dir)
    model = AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    figures = heldout_nll(model, tokenizer, demo.heldout_texts, BLOCK_SIZE,
                          desc=f"Held-out NLL ({'with ' + adapter.name if adapter else 'base model'})")
    del model
    gc.collect()  # the next stage may load a model of the same size
    logger.info("held-out: %d tokens, %d chars: perplexity %.3f per token, %.3f per char",
                figures["tokens"], figures["chars"], figures["ppl_token"], figures["ppl_char"])
    return figures


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
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(adapter or demo.model_dir)
    if not tokenizer.chat_template:
        raise StageError(f"{adapter or demo.model_dir}: the tokenizer has no chat_template")
    model = AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
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


def run_training_script(script: str, options: dict) -> None:
    """Run a training script as a user would, its output (progress bar included) streamed."""
    command = [sys.executable, str(TRAINING_DIR / script)]
    for name, value in options.items():
        command.append(f"--{name}")
        if value is not None:  # None marks a flag that takes no value
            command.append(str(value))
    logger.info("running: %s", shlex.join(command))
    returncode = subprocess.run(command, cwd=REPO).returncode
    if returncode != 0:
        raise StageError(f"{script} exited with status {returncode}")


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise StageError(f"{path} is missing: the training script did not finish its run")
    return json.loads(path.read_text(encoding="utf-8"))


def loss_summary(output_dir: Path) -> dict:
    """First and last logged training loss, each a mean over logging_steps steps."""
    logged = [entry for entry in read_json(output_dir / "trainer_state.json")["log_history"]
              if "loss" in entry]
    if not logged:
        raise StageError(f"{output_dir}/trainer_state.json logs no training loss")
    return {"loss_first": logged[0]["loss"], "loss_first_step": logged[0]["step"],
            "loss_last": logged[-1]["loss"], "loss_last_step": logged[-1]["step"]}


# ----------------------------------------------------------------------------- report


def render_report(results: list[dict], quick: bool, failed: str | None) -> str:
    by_stage = {result["stage"]: result["figures"] for result in results}
    lines = [f"# Demo report{' (--quick)' if quick else ''}", ""]
    if failed:
        lines += [f"**FAILED at stage '{failed}'**: the figures below stop there.", ""]

    lines += ["| stage | time |", "|---|---:|"]
    lines += [f"| {result['stage']} | {result['seconds']:.1f} s |" for result in results]
    lines += [f"| total | {sum(result['seconds'] for result in results):.1f} s |", ""]

    before, after = by_stage.get("held-out before"), by_stage.get("held-out after")
    if before:
        lines += ["## Continued pretraining", ""]
        lines += [f"Held-out perplexity on {before['texts']} People's Daily documents "
                  f"({before['chars']:,} characters, {before['tokens']:,} tokens), "
                  f"scored in windows of {BLOCK_SIZE} tokens:", "",
                  "| perplexity | before | after | change |", "|---|---:|---:|---:|"]
        for key, label in (("ppl_token", "per token"), ("ppl_char", "per character")):
            if after:
                change = f"{100 * (after[key] / before[key] - 1):+.1f}%"
                lines.append(f"| {label} | {before[key]:.3f} | {after[key]:.3f} | {change} |")
            else:
                lines.append(f"| {label} | {before[key]:.3f} | - | - |")
        lines.append("")

    pt = by_stage.get("continued pretraining")
    if pt:
        lines += [f"Continued pretraining: {pt['steps']} LoRA steps of 4 x {BLOCK_SIZE} tokens at learning "
                  f"rate {pt['learning_rate']:g}; training loss {pt['loss_first']:.3f} "
                  f"({step_range(pt['loss_first_step'], pt['logging_steps'])}) -> {pt['loss_last']:.3f} "
                  f"({step_range(pt['loss_last_step'], pt['logging_steps'])}); the script's own validation "
                  f"({pt['eval_samples']} blocks split off the training text): loss {pt['eval_loss']:.3f}, "
                  f"perplexity {pt['eval_perplexity']:.3f}.", ""]

    if before and after:
        lines += [verdict(before, after), ""]
    lines += render_sft(by_stage)
    return "\n".join(lines)


SAMPLE_ANSWERS = 5


def render_sft(by_stage: dict) -> list[str]:
    data, sft = by_stage.get("SFT data"), by_stage.get("supervised fine-tuning")
    before, after = by_stage.get("exact match before"), by_stage.get("exact match after")
    lines = []
    if data:
        lines += ["## Supervised fine-tuning", "",
                  f"Generated arithmetic questions (\"What is 347 + 589?\" -> \"The answer is 936.\"): "
                  f"{data['train_records']:,} train, {data['validation_records']} validation and "
                  f"{data['heldout_records']} held-out records, held-out questions checked absent from the "
                  f"train and validation sets. The SFT stage starts from the base model, not from the "
                  f"continued-pretraining adapter, so the two stages are measured independently.", ""]
    if sft:
        lines += [f"SFT: {sft['steps']} LoRA steps of {sft['batch_size']} packed rows of at most "
                  f"{sft['max_seq_length']} tokens (the train records packed into {sft['packed_rows']} rows; "
                  f"loss on the answers only) at learning rate {sft['learning_rate']:g}, in "
                  f"{sft['train_runtime']:.0f} s of training; training loss {sft['loss_first']:.3f} "
                  f"({step_range(sft['loss_first_step'], sft['logging_steps'])}) -> {sft['loss_last']:.3f} "
                  f"({step_range(sft['loss_last_step'], sft['logging_steps'])}); on the {sft['eval_samples']} "
                  f"validation records: eval loss {sft['eval_loss']:.3f}, next-token accuracy on the answers "
                  f"{sft['eval_accuracy']:.3f}.", ""]
    if before:
        lines += [f"Exact match on {before['total']} held-out questions: greedy answers (at most "
                  f"{SFT_MAX_NEW_TOKENS} new tokens) to prompts rendered with the chat template; after SFT "
                  f"the template comes from the tokenizer saved with the adapter. The first prompt, as "
                  f"rendered{' after SFT' if after else ''}:", "",
                  "```", (after or before)["prompt_example"].rstrip("\n"), "```", "",
                  "| exact match | before | after |", "|---|---:|---:|",
                  f"| correct | {fraction(before)} | {fraction(after) if after else '-'} |", ""]
        lines += ["| question | expected | before | after |", "|---|---|---|---|"]
        for index in sample_indices(before, after):
            answer, later = before["answers"][index], after["answers"][index] if after else None
            lines.append(f"| {answer['instruction']} | {answer['expected']} | {cell(answer)} | "
                         f"{cell(later) if later else '-'} |")
        lines.append("")
    if before and after:
        lines += [sft_verdict(before, after), ""]
    return lines


def sample_indices(before: dict, after: dict | None) -> list[int]:
    """The first SAMPLE_ANSWERS questions, but with up to two answers that are right after (or,
    failing that, before) in place of the last ones, so the sample shows both kinds when both occur."""
    total = len(before["answers"])
    chosen = list(range(min(SAMPLE_ANSWERS, total)))
    for figures in (after, before):
        if figures is None:
            continue
        right = [i for i, answer in enumerate(figures["answers"]) if answer["correct"]]
        if right and not any(i in right for i in chosen):
            extra = right[:2]
            chosen = chosen[:len(chosen) - len(extra)] + extra
            break
    return sorted(set(chosen))


def fraction(figures: dict) -> str:
    return f"{figures['correct']} / {figures['total']} ({100 * figures['accuracy']:.0f}%)"


def cell(answer: dict) -> str:
    """A generated answer as one table cell, marked right or wrong."""
    text = answer["generated"].strip().replace("|", "\\|").replace("\n", " ⏎ ")
    return f"{'✓' if answer['correct'] else '✗'} {text}"


def sft_verdict(before: dict, after: dict) -> str:
    if after["correct"] > before["correct"]:
        return (f"Result: supervised fine-tuning raised exact-match accuracy on the held-out questions from "
                f"{fraction(before)} to {fraction(after)}.")
    return (f"Result: supervised fine-tuning did NOT improve exact-match accuracy on the held-out questions: "
            f"{fraction(before)} before, {fraction(after)} after.")


def step_range(last_step: int, logging_steps: int) -> str:
    first_step = max(1, last_step - logging_steps + 1)
    return f"step {last_step}" if first_step == last_step else f"mean of steps {first_step}-{last_step}"


def verdict(before: dict, after: dict) -> str:
    # Same tokenizer and text, so per token and per character always move in the same direction.
    if after["nll_per_token"] < before["nll_per_token"]:
        return (f"Result: continued pretraining lowered held-out perplexity per token from "
                f"{before['ppl_token']:.3f} to {after['ppl_token']:.3f}.")
    return (f"Result: continued pretraining did NOT improve held-out perplexity: per token it went from "
            f"{before['ppl_token']:.3f} to {after['ppl_token']:.3f}.")


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", type=Path, default=REPO / ".cache" / "demo",
                        help="model, corpus and tokenized blocks, reused between runs")
    parser.add_argument("--output_dir", type=Path, default=REPO / "outputs" / "demo",
                        help="adapters, checkpoints and report.md")
    parser.add_argument("--quick", action="store_true", help="fewer steps and a smaller held-out slice")
    return parser.parse_args(argv)


def run_stages(demo: Demo) -> tuple[list[dict], str | None]:
    """Run STAGES in order; stop at the first that fails and return its name."""
    results = []
    for name, stage in STAGES:
        logger.info("=== %s", name)
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

    results, failed = run_stages(demo)

    report = render_report(results, args.quick, failed)
    (demo.output_dir / "report.md").write_text(report + "\n", encoding="utf-8")
    # The same figures, for scripts and tests to read.
    (demo.output_dir / "report.json").write_text(json.dumps(
        {"quick": args.quick, "failed": failed, "stages": results},
        indent=2, default=str, ensure_ascii=False), encoding="utf-8")
    print("\n" + report)
    logger.info("report written to %s", demo.output_dir / "report.md")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
