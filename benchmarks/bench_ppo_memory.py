"""Benchmark: the memory of one PPO iteration at a large vocabulary, with and without full-vocabulary
float32 logits (issue 15, item 3).

* before - run_ppo.py --chunked_loss false: generate(output_logits=True) keeps every step's logits and
           stacks them ([B, A, V] float32, twice while stacking) for the sampled tokens' log-probs and
           entropy; the reference's and the actor's log-probs come from [B, A, V] logits.
* after  - run_ppo.py --chunked_loss true (the default): each sampled token's log-prob and
           entropy are recorded as it is sampled (one step's [B, V] at a time); log-probs come from
           the hidden states over chunks of positions (lorakit.models.chunked_loss), the
           actor's head checkpointed chunk by chunk for the backward pass.

Model: a tiny Llama built from a config, random seeded weights (nothing downloaded): hidden 64, 2
layers, Qwen2's vocabulary size of 151,936, so that the logits dominate: one [B, A, V] float32 tensor
is B x A x 151,936 x 4 bytes (8 x 256: 1.2 GB) while the weights are 80 MB. Tokenizer: a byte-level
BPE of a few hundred tokens trained on the prompts in the work directory (the model samples from its
whole vocabulary, so answers run to --answer_len). Reward model: an untrained reward adapter in
run_reward.py's layout (bench_ppo.write_reward_adapter). Prompts: --batch_size short instructions.

Each run is run_ppo.py unmodified, as its own __main__, in a child process (this file with --child):
shared base (one frozen base under the four roles), LoRA r8 on q/k/v/o, one iteration = one optimizer
step (--batch_size prompts, answers of at most --answer_len tokens, one PPO epoch in one micro-batch),
float32 on the CPU, sampling at temperature 1 without top-k/top-p. Figures: the child's peak RSS
(os.wait4's ru_maxrss: its whole life, model loading included), its RSS when the Trainer was built (the
models loaded; read from /proc/self/status), the iteration's growth over it, and run_ppo.py's own
time_generation / time_scoring / time_training. Printed as a table; written to outputs/bench/ppo_memory.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from measure import (
    REPO,
    Ratios,
    TrainingClock,
    add_child_arguments,
    after_trainer_init,
    environment,
    loadavg,
    print_table,
    quiet_offline_env,
    run_child_benchmark,
    scratch_dir,
    set_torch_threads,
    write_json,
    write_jsonl,
)

PPO_SCRIPT = REPO / "scripts" / "training" / "run_ppo.py"
RUNS = {"before": ["--chunked_loss", "false"], "after": ["--chunked_loss", "true"]}
SEED = 42
VOCAB_SIZE = 151_936
MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 512}
SUBJECTS = ("a phone", "a kettle", "a bicycle", "a pair of shoes", "a desk lamp", "a backpack", "a book", "a tent")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch_size", type=int, default=8, help="prompts in the iteration")
    parser.add_argument("--answer_len", type=int, default=256, help="most tokens generated per answer")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in every child (default: torch's)")
    parser.add_argument("--output", default="outputs/bench/ppo_memory.json",
                        help="JSON results (relative to the repo root)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, outputs)")
    add_child_arguments(parser, list(RUNS))
    parser.add_argument("--reward_adapter", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- inputs (parent)


def write_model(model_dir: Path, prompts: list) -> None:
    """The tiny large-vocabulary Llama and a byte-level BPE tokenizer trained on the prompts."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(prompts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(str(model_dir))
    config = LlamaConfig(vocab_size=VOCAB_SIZE, tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **MODEL)
    torch.manual_seed(SEED)
    LlamaForCausalLM(config).save_pretrained(str(model_dir))


def write_inputs(work: Path, args) -> tuple:
    """(model directory, prompts jsonl, reward adapter) in work."""
    from bench_ppo import write_reward_adapter

    prompts = [f"Describe {SUBJECTS[number % len(SUBJECTS)]} in one sentence (prompt {number})."
               for number in range(args.batch_size)]
    model_dir, data_path, reward_adapter = work / "model", work / "prompts.jsonl", work / "rm_lora_model"
    write_model(model_dir, prompts)
    write_jsonl(data_path, [{"instruction": prompt} for prompt in prompts])
    write_reward_adapter(str(model_dir), reward_adapter)
    return model_dir, data_path, reward_adapter


# ----------------------------------------------------------------------------- one run (child)


def process_memory_mb() -> dict:
    """This process's resident set now and at its peak so far (Linux /proc/self/status), in MB."""
    fields = {}
    with open("/proc/self/status", encoding="utf-8") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) / 1024
    return {"rss_mb": fields["VmRSS"], "peak_so_far_mb": fields["VmHWM"]}


class IterationRecorder(TrainingClock):
    """The memory when the Trainer was built (the models loaded), the iteration's wall seconds and the
    trainer's logs, written as JSON when training ends."""

    def __init__(self, metrics_path: str):
        super().__init__()
        self.metrics_path, self.at_trainer, self.iterations = metrics_path, None, []

    def trainer_built(self, trainer) -> None:
        self.at_trainer = process_memory_mb()
        trainer.add_callback(self.callback)

    def step_done(self, wall_s: float, cpu_s: float) -> None:
        self.iterations.append({"wall_s": wall_s, "cpu_s": cpu_s})

    def finish(self, args) -> None:
        write_json(self.metrics_path, {"at_trainer": self.at_trainer, "iterations": self.iterations,
                                       "logs": self.logs})


def run_child(args) -> None:
    """run_ppo.py, unmodified, as its own __main__ would run, for one iteration."""
    import runpy

    set_torch_threads(args.threads)
    recorder = IterationRecorder(args.metrics)
    after_trainer_init(recorder.trainer_built)
    work = Path(args.workdir)
    options = {"actor_model_name_or_path": args.model, "reward_model_name_or_path": args.model,
               "reward_lora_model": args.reward_adapter, "data_path": args.data, "template": "human_assistant",
               "data_cache_dir": work / "data_cache", "output_dir": work / "out", "max_prompt_seq_len": 32,
               "max_answer_seq_len": args.answer_len, "per_device_generation_batch_size": args.batch_size,
               "per_device_training_batch_size": args.batch_size, "max_steps": 1, "temperature": 1.0, "top_k": 0,
               "top_p": 1.0, "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0,
               "trainable": "q_proj,k_proj,v_proj,o_proj", "torch_dtype": "float32", "report_to": "none",
               "save_strategy": "no", "logging_steps": 1, "seed": SEED}
    sys.argv = [str(PPO_SCRIPT), "--use_cpu", *RUNS[args.child]]
    for name, value in options.items():
        sys.argv += [f"--{name}", str(value)]
    runpy.run_path(str(PPO_SCRIPT), run_name="__main__")


# ----------------------------------------------------------------------------- driver


def measure_run(run: str, args, inputs: tuple, work: Path) -> dict:
    model_dir, data_path, reward_adapter = inputs
    flags = ["--model", model_dir, "--data", data_path, "--reward_adapter", reward_adapter,
             "--batch_size", args.batch_size, "--answer_len", args.answer_len]
    if args.threads:
        flags += ["--threads", args.threads]
    metrics, usage, load_before, load_after = run_child_benchmark(
        sys.executable, str(Path(__file__).resolve()), run, work / run, flags)
    log = next(entry for entry in metrics["logs"] if "time_generation" in entry)
    loaded = metrics["at_trainer"]["rss_mb"]
    result = {"run": run, "peak_rss_mb": usage.peak_rss_mb, "rss_models_loaded_mb": loaded,
              "iteration_growth_mb": usage.peak_rss_mb - loaded, "iteration_s": metrics["iterations"][0]["wall_s"],
              "generation_s": log["time_generation"], "scoring_s": log["time_scoring"],
              "training_s": log["time_training"], "response_length": log["response_length"],
              "loss": log["loss"], "wall_s": usage.wall_s, "load_before": load_before, "load_after": load_after}
    print(f"  {run:<7} peak RSS {result['peak_rss_mb']:6.0f} MB ({result['iteration_growth_mb']:5.0f} MB over the "
          f"loaded models), iteration {result['iteration_s']:5.1f} s, load {load_before} -> {load_after}", flush=True)
    return result


def print_results(results: dict, ratios: Ratios, logits_mb: float) -> None:
    print()
    header = (f"{'run':<7} {'peak RSS MB':>11} {'loaded MB':>9} {'growth MB':>9} {'iteration s':>11} "
              f"{'generation s':>12} {'scoring s':>9} {'training s':>10} {'answer len':>10}")
    print_table(header, (
        f"{run:<7} {r['peak_rss_mb']:>11.0f} {r['rss_models_loaded_mb']:>9.0f} {r['iteration_growth_mb']:>9.0f} "
        f"{r['iteration_s']:>11.1f} {r['generation_s']:>12.1f} {r['scoring_s']:>9.1f} {r['training_s']:>10.1f} "
        f"{r['response_length']:>10.1f}" for run, r in results.items()))
    print(f"(growth = peak RSS - RSS once the models were loaded; one [B, A, V] float32 logits tensor: "
          f"{logits_mb:.0f} MB)")
    ratios.print(32)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    os.chdir(REPO)
    quiet_offline_env()
    logits_mb = args.batch_size * args.answer_len * VOCAB_SIZE * 4 / 2**20
    print(f"PPO iteration memory: {args.batch_size} prompts x {args.answer_len} answer tokens x {VOCAB_SIZE} "
          f"vocabulary; {os.cpu_count()} CPUs, load {loadavg()}", flush=True)
    with scratch_dir("bench_ppo_memory-", keep=args.keep) as work:
        os.environ["HF_DATASETS_CACHE"] = str(work / "hf_datasets")
        inputs = write_inputs(work, args)
        results = {run: measure_run(run, args, inputs, work) for run in RUNS}
    ratios = Ratios(results)
    ratios.add("after/before peak RSS", "after", "before", "peak_rss_mb")
    ratios.add("after/before iteration growth", "after", "before", "iteration_growth_mb")
    ratios.add("after/before iteration s", "after", "before", "iteration_s")
    print_results(results, ratios, logits_mb)
    report = {"benchmark": "ppo_memory",
              "settings": {"batch_size": args.batch_size, "answer_len": args.answer_len, "vocab_size": VOCAB_SIZE,
                           "model": MODEL, "dtype": "float32", "seed": SEED, "threads": args.threads,
                           "runs": {run: ["run_ppo.py", *flags] for run, flags in RUNS.items()}},
              "logits_tensor_mb": logits_mb, "environment": environment("torch", "transformers", "peft"),
              "results": results, "ratios": ratios.values}
    write_json(args.output, report)
    print(f"\nwrote {args.output}")
    return report


if __name__ == "__main__":
    main()
