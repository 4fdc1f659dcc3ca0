"""Benchmark: the toolkit on a GPU (`make gpu-check`): LoRA SFT tokens/s and model FLOPs utilisation against TRL's
SFTTrainer (with and without Liger's kernels) in the same run, our SFT's speed variants, QLoRA, peak memory with and
without the chunked loss, PPO's iteration split and the rollout engines, on 1B- and 7B-shaped Llama and Qwen models
built from their configs (random seeded weights, nothing downloaded), in priority order within a time budget.

Models (the shapes of the published configs, each written once as safetensors under the work directory just before
its first run; set TMPDIR to a disk with ~20 GB free per 7B shape):
  llama-1b  Llama-3.2-1B's shape     (hidden 2048, 16 layers, GQA 32/8 heads, vocab 128,256, tied head)
  llama-7b  Llama-2-7B's shape       (hidden 4096, 32 layers, 32 heads, vocab 32,000)
  qwen-1b   Qwen2.5-1.5B's shape     (hidden 1536, 28 layers, GQA 12/2 heads, vocab 151,936, tied head)
  qwen-7b   Qwen2.5-7B's shape       (hidden 3584, 28 layers, GQA 28/4 heads, vocab 152,064)
--models picks them (default llama-7b llama-1b: the pair the baseline table and the variant plan compare). The 7B
shapes chosen are the headline models (the baseline, TRL, QLoRA); the 1B shapes chosen are where our variants are
explored, and each 1B shape's best is re-run at the 7B shape of its family (a choice of 1B shapes only makes them the
headline models too).
Tokenizer: a byte-level BPE of ~1k tokens trained on seeded pseudo-words (one word is about one token);
the model's embeddings keep their full vocabulary, so the LM head costs what it costs the real model.
Data: seeded single-turn chats ("messages" records, one jsonl that both sides read) of uniformly spread lengths up
to --seq_len, rendered with lorakit's "human_assistant" template.

Every figure of ours comes from the toolkit's own code: scripts/training/run_sft_with_peft.py and run_ppo.py run
unmodified as __main__ (runpy) in a child process, so model loading is lorakit.models.loader's load_model, packing is
build_dataset's pack_samples and collator, the loss is CausalLMTrainer's (chunked_loss.py with --chunked_loss true),
PPO is the PPO trainer. The child only adds a probe to every Trainer it builds (ours or TRL's): a step clock that
synchronises the GPU before reading the time, memory readings (the peak is reset once the Trainer is built, the
model loaded), and the collator wrapped to count tokens. All runs: bf16 weights and --bf16, LoRA r 8, alpha 32,
dropout 0.05 on all linear layers (the toolkit's defaults, given explicitly), AdamW lr 1e-4, seed 42, no activation
checkpointing in the throughput runs (both sides).

The plan, in this order (--measure picks the measurements; a run of ours whose flag our script does not have yet
is refused by it in one line, recorded "refused" with that line, and the plan goes on):
 1. sft       ours at each headline model, packed (--packing: padding-free rows of at most --seq_len), sdpa: the
              baseline figure.
 2. peers     TRL's SFTTrainer with use_liger_kernel (where liger_kernel imports), then without, at each headline
              model, on the same model directory, tokenizer, data, sequence length, batch, LoRA settings, learning
              rate, steps and bf16, in TRL's best configuration there: padding-free packing ("bfd") under
              flash_attention_2 where it imports, else unpacked under sdpa (trl_sft_runner.py). Where trl or
              liger_kernel is not installed the run is recorded "not available", nothing crashes.
 3. variants  at each 1B shape: the packed sdpa run, then one change each (each a flag of our SFT script):
              --use_liger_kernel (refused where liger_kernel does not import: "not available"), --lora_dropout 0
              (what the dropout costs), --torch_compile (the decoder layers compiled in place),
              --max_tokens_per_batch batch x seq_len (token-budget batches of packed rows), --attn_implementation
              torch_varlen (CUDA only: refused on a CPU, "not available") and flex_attention, flash_attention_2
              where it imports; last the unpacked sdpa run (rows padded to the batch's longest). Then the
              combination of the changes that beat the packed sdpa run, at the same shape.
 4. winners   each 1B shape's best run (tokens/s, among the packed runs whose packing check passes) re-run at
              its family's 7B shape, beside ours plain packed and TRL's best there.
 5. qlora     the packed sdpa run of each headline model with --load_in_kbits 4 (bitsandbytes NF4).
 6. memory    one row of 4096 and of 8192 tokens (batch 1, --activation_checkpointing as a long-sequence run
              is set up), --chunked_loss false (transformers' loss over the full logits) and true: peak GPU
              memory (torch.cuda.max_memory_allocated over training) and its growth over the loaded model.
 7. ppo       run_ppo.py --shared_base true, --ppo_prompts prompts x --ppo_answer_len new tokens per iteration,
              an untrained reward adapter (bench_ppo.write_reward_adapter): seconds per iteration split into
              generation, scoring and training (run_ppo's own timers, each made to synchronise the GPU before
              reading the clock), median over the iterations after the first; once as run_ppo.py's defaults
              decode (eager, the adapter unmerged) and once with --enable_hybrid_engine --rollout_engine compiled.
 8. rollout   the rollout engines (lorakit.rl.rollout) on one actor, built once in one process: the model with a
              LoRA adapter (r 8, all linear layers, B not zero) sampling --ppo_prompts prompts of --ppo_prompt_len
              tokens, up to --ppo_answer_len new ones: milliseconds per new token (median of 3 timed calls after
              one warm-up call) eager with the adapter unmerged (what PPO's actor paid), eager merged
              (--enable_hybrid_engine), and compiled merged (static KV cache, torch.compile with CUDA graphs; its
              warm-up call pays the compile, reported with the graphs it built).
Memory, PPO and rollout run at every model chosen, 7B first in the default order.

Throughput figures, over the steps after --warmup_steps: non-padding tokens/s (the measured steps' tokens over their
summed time) and at the median step (their mean tokens per step over the median step time: the steady state, which
a few slow steps of new shapes or recompiles do not move), padding, seconds per step, MFU, peak GPU memory. Ratios
ours/TRL (tokens/s, both ways, and peak memory) at each headline model: ours' best packed run (whose packed loss
equals the loss alone) against TRL, and against TRL with Liger.

Packing check, in each packed run of ours before training: the first two packed rows that hold two samples or more,
as one batch through the model (the run's collator: position_ids restarting per sample, and the samples' bounds under
a flash attention or torch_varlen), each sample's mean loss against the same sample run alone; max |diff| <=
tolerance (bf16: 2e-2; float32: 1e-4).
Its control must be able to fail: the same packed rows with their restarting position_ids kept (so RoPE is the same)
and a causal mask over each whole row passed as a 4D attention_mask (lorakit.data.build_dataset's
whole_row_causal_mask; transformers takes a 4D mask as it is), so only the attention differs: each sample attends to
the samples before it in its row. Run under the run's own attention where it takes a 4D mask, else (a flash
attention) under sdpa. The check passes when packed = alone and the control differs from alone by more than the
tolerance; a control within it is reported as "control could not fail" and the check fails.

Time budget (--time_budget_s, default 480: one call of at most 8 minutes): each run goes in a child process with a
time limit of its kind's maximum or what is left, whichever is less, so a slow or hung run loses only itself; a run
that would start with less than its kind's minimum left (TIME_LIMITS) is recorded "skipped: out of time". A child
that crashes loses the run it was in, and the runs after it go on in a new child. The JSON is rewritten after every
child, so a run stopped from outside keeps what finished. On a GPU every run has its own child (a clean device, and
no run's kernel patches leak into the next); the smoke run puts the runs of consecutive steps in one child.

MFU (model FLOPs utilisation) = model FLOPs of the measured steps / (their seconds x the GPU's peak dense
bf16 FLOP/s). Model FLOPs of one LoRA training pass over a sample of t tokens (training_flops):
    (4 N + 6 N_lora) t + 12 L d t^2
N: the weights every token multiplies (decoder linear layers and the LM head; not the input embedding, a
lookup): 2N forward and 2N for the gradients of the activations; the frozen weights get no weight
gradients, which full training's 6N (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, appendix B) adds.
N_lora: the trained LoRA weights, 6 per token as in full training. 12 L d t: PaLM's attention term per token
(d = heads x head dim, L layers, t the sample's length; full, not causally halved), times t tokens. Only
non-padding tokens count, packed samples by their own length. Peak bf16 dense FLOP/s by device name
(PEAK_BF16_TFLOPS; H100 SXM and H200: 989 TFLOP/s); for another GPU the MFU is not reported.

Targets (issues), each printed with its verdict: at the 7B shapes, seq 2048, on an H100 or H200: the best run of
ours at MFU >= 35% (on the way to 45%), its tokens/s >= 2x TRL + Liger's best and its peak memory <= TRL + Liger's;
QLoRA's step time <= 1.3x the bf16 packed run's; at 8k tokens the chunked loss's peak memory <= 0.5x and its growth
over the loaded model <= 0.3x transformers' own loss path (the dropout-free run beside it shows what LoRA's dropout
costs); at the Llama-7B shape, batch 8 x 256 new tokens: the compiled decode <= 12 ms per new token and a PPO
iteration with it <= 5 s.

Without a CUDA device the script says so in one line and exits 2. --cpu_smoke runs every step of the plan on tiny
shapes (2 layers, seq 64, 3 steps) on the CPU, to check the code paths: llama-tiny plays the 1B role and qwen-tiny
the 7B one; TRL runs there unpacked, Liger is recorded not available, and so is torch_varlen. Its figures mean nothing
(memory there is the child's peak RSS so far) and go to outputs/bench/gpu_cpu_smoke.json. Results: a table, and
outputs/bench/gpu.json (--output; the device, the versions, every run's status and the plan's winners in both).
benchmarks/README.md has the recipe for a GPU machine without network.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import os
import random
import runpy
import signal
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager, nullcontext, redirect_stderr
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

from measure import (
    REPO,
    ChildUsage,
    Ratios,
    TrainingClock,
    add_child_arguments,
    after_trainer_init,
    environment,
    log_tail,
    print_table,
    quiet_offline_env,
    read_results,
    run_child_until,
    scratch_dir,
    write_json,
    write_jsonl,
)

SFT_SCRIPT = REPO / "scripts" / "training" / "run_sft_with_peft.py"
PPO_SCRIPT = REPO / "scripts" / "training" / "run_ppo.py"
SEED = 42
LEARNING_RATE = 1e-4
LORA = {"r": 8, "alpha": 32, "dropout": 0.05, "targets": "all-linear"}  # the toolkit's defaults, on both sides
MEASUREMENTS = ("sft", "peers", "variants", "qlora", "memory", "ppo", "rollout")
# (family, config fields, rows per SFT batch at --seq_len): the published configs' shapes.
SHAPES = {
    "llama-1b": ("llama", {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                           "tie_word_embeddings": True, "rope_theta": 500000.0}, 4),
    "llama-7b": ("llama", {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                           "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
                           "tie_word_embeddings": False}, 2),
    "qwen-1b": ("qwen2", {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                          "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                          "tie_word_embeddings": True, "rope_theta": 1000000.0}, 4),
    "qwen-7b": ("qwen2", {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                          "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                          "tie_word_embeddings": False, "rope_theta": 1000000.0}, 2),
}
DEFAULT_MODELS = ("llama-7b", "llama-1b")
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 2048}
SMOKE_SHAPES = {"llama-tiny": ("llama", {**TINY, "tie_word_embeddings": False}, 4),
                "qwen-tiny": ("qwen2", {**TINY, "tie_word_embeddings": True}, 4)}
# Where each explored (1B) shape's best variant is re-run: its family's 7B shape. In the smoke run the tiny Llama
# plays the 1B role and the tiny Qwen the 7B one, so that every step of the plan runs there.
EXPLORED_FOR = {"llama-1b": "llama-7b", "qwen-1b": "qwen-7b"}
SMOKE_EXPLORED_FOR = {"llama-tiny": "qwen-tiny"}


class Option(NamedTuple):
    """A variant's change to our packed run: flags of our SFT script ("{tokens}": batch x seq_len), and what it
    needs beyond the script ("cuda", or a module that must import), so that its refusal reads "not available"."""

    flags: tuple
    needs: tuple


# Liger's kernels are triton's: they need liger_kernel to import and a CUDA GPU to run on.
LIGER_NEEDS = ("liger_kernel", "cuda")
# The changes explored at the 1B shapes, in the order they run (the likeliest gains first).
OPTIONS = {"liger": Option(("--use_liger_kernel",), LIGER_NEEDS),
           "dropout0": Option(("--lora_dropout", "0"), ()),
           "compile": Option(("--torch_compile",), ()),
           "tokenbudget": Option(("--max_tokens_per_batch", "{tokens}"), ())}
# The other attentions a packed run of ours is tried with, and their needs.
# flex_attention needs CUDA too: torch's CPU flex attention has no backward, and our script refuses it there.
VARIANT_ATTENTIONS = {"torch_varlen": ("cuda",), "flex_attention": ("cuda",),
                      "flash_attention_2": ("flash_attn", "cuda")}
# Attentions that take a 4D attention_mask as given, and the mask's form: sdpa (and torch_varlen, which runs sdpa
# on a batch without sample bounds) a bool mask, eager and flex_attention an additive one. A flash attention takes
# none: the packing check's control then runs under sdpa.
MASK_FORM = {"sdpa": "bool", "torch_varlen": "bool", "eager": "additive", "flex_attention": "additive"}
# (seconds a run needs left to start, seconds it may run at most) by kind, at a 7B shape on an H100 or H200 (at a
# smaller shape the minimum is halved): estimates from the runs so far, imports and model loading included.
TIME_LIMITS = {"prepare": (40, 240), "sft": (50, 240), "trl": (50, 240), "ppo": (60, 300), "rollout": (60, 300)}
SMOKE_TIME_LIMITS = (1, 300)
# Peak dense (not sparse) bf16 tensor FLOP/s, in TFLOP/s, from the vendor's data sheets; the first name
# contained in torch.cuda.get_device_name() wins, so the PCIe/NVL variants come before the SXM part.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
                    ("A100", 312.0), ("L40S", 362.0))
# Issue 33's targets at the 7B shapes, seq 2048, packed, on an H100 or H200: MFU >= 35% (on the way to 45%), tokens/s
# >= 2x TRL + Liger's best, peak memory <= its; QLoRA's step time within 1.3x of the bf16 run's; at 8k tokens the
# chunked loss's peak <= 0.5x transformers' loss path and its growth over the loaded model <= 0.3x.
MFU_TARGET, PEER_SPEED_TARGET, PEER_MEMORY_TARGET, QLORA_TIME_TARGET = 0.35, 2.0, 1.0, 1.3
MEMORY_TARGET, GROWTH_TARGET = 0.5, 0.3
DECODE_MS_TARGET, PPO_ITERATION_S_TARGET = 12.0, 5.0  # Llama-7B shape, 8 x 256, on an H100 or H200
# (label, --rollout_engine, --enable_hybrid_engine) of each engine the rollout measurement times, in this order.
ROLLOUT_ENGINES = (("eager, adapter unmerged", "eager", False), ("eager, adapter merged", "eager", True),
                   ("compiled, adapter merged", "compiled", True))
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
# How our script words a flag it does not have (lorakit.core.cli; argparse's own): such a run is "refused".
UNKNOWN_FLAG_SIGNS = ("is not an argument of", "unrecognized arguments")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu_smoke", action="store_true",
                        help="every measurement on tiny shapes on the CPU (checks the code paths; no real figures)")
    parser.add_argument("--models", nargs="+", default=None,
                        help=f"shapes to build and measure (default: {' '.join(DEFAULT_MODELS)}; any of "
                             f"{', '.join(SHAPES)})")
    parser.add_argument("--measure", nargs="+", default=list(MEASUREMENTS), choices=MEASUREMENTS)
    parser.add_argument("--time_budget_s", type=float, default=480.0,
                        help="seconds for the whole run: each run gets a time limit from what is left, and a run "
                             "that would start with less than its minimum left is skipped (default 480)")
    parser.add_argument("--seq_len", type=int, default=None, help="SFT sequence length (default 2048; smoke 64)")
    parser.add_argument("--steps", type=int, default=None, help="SFT optimizer steps per run (default 12; smoke 3)")
    parser.add_argument("--warmup_steps", type=int, default=None,
                        help="first steps left out of the figures (default 2; smoke 1)")
    parser.add_argument("--memory_lengths", type=int, nargs="+", default=None,
                        help="row lengths of the memory runs (default 4096 8192; smoke 64 128)")
    parser.add_argument("--ppo_prompts", type=int, default=None, help="prompts per PPO iteration (default 8)")
    parser.add_argument("--ppo_answer_len", type=int, default=None, help="new tokens per answer (default 256)")
    parser.add_argument("--ppo_iterations", type=int, default=None, help="PPO iterations (default 3; smoke 2)")
    parser.add_argument("--output", default=None,
                        help="JSON results (default outputs/bench/gpu.json; smoke outputs/bench/gpu_cpu_smoke.json)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (models, logs, outputs)")
    add_child_arguments(parser, ["run"])  # internal: measurements in this process
    parser.add_argument("--specs", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def bad_flag(message: str) -> None:
    """One line on stderr and exit status 2, as every script of the toolkit refuses bad input."""
    print(f"bench_gpu.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def model_roles(models: list, explored_for: dict) -> dict:
    """headline: the 7B shapes chosen (every shape chosen where none is); explored: {each 1B shape chosen: its
    family's 7B shape if chosen, else None}."""
    explored = {model: explored_for[model] if explored_for[model] in models else None
                for model in models if model in explored_for}
    return {"headline": [model for model in models if model not in explored] or list(models), "explored": explored}


def settings_of(args) -> dict:
    """The run's settings: the GPU defaults, or the smoke run's tiny ones, each overridden by its flag."""
    smoke = args.cpu_smoke
    shapes = SMOKE_SHAPES if smoke else SHAPES
    models = args.models or list(SMOKE_SHAPES if smoke else DEFAULT_MODELS)
    unknown = [name for name in models if name not in shapes]
    if unknown:
        bad_flag(f"--models: unknown shape(s) {', '.join(unknown)}; choose from {', '.join(shapes)}")
    defaults = {"seq_len": 64 if smoke else 2048, "steps": 3 if smoke else 12, "warmup_steps": 1 if smoke else 2,
                "memory_lengths": [64, 128] if smoke else [4096, 8192], "ppo_prompts": 2 if smoke else 8,
                "ppo_answer_len": 8 if smoke else 256, "ppo_iterations": 2 if smoke else 3}
    chosen = {name: getattr(args, name) if getattr(args, name) is not None else value
              for name, value in defaults.items()}
    if chosen["warmup_steps"] >= chosen["steps"]:
        bad_flag(f"--warmup_steps {chosen['warmup_steps']} leaves none of --steps {chosen['steps']} measured")
    if args.time_budget_s <= 0:
        bad_flag(f"--time_budget_s must be positive, got {args.time_budget_s:g}")
    precision = ["--torch_dtype", "float32", "--use_cpu"] if smoke else ["--torch_dtype", "bfloat16", "--bf16"]
    return {**chosen, "smoke": smoke, "models": {name: shapes[name] for name in models},
            **model_roles(models, SMOKE_EXPLORED_FOR if smoke else EXPLORED_FOR),
            "measure": list(args.measure), "precision": precision, "ppo_prompt_len": 32 if smoke else 64,
            "max_positions": 256 if smoke else 32768, "time_budget_s": args.time_budget_s}
# ----------------------------------------------------------------------------- FLOPs (pure)


def matmul_parameters(config: dict) -> int:
    """Weights every token multiplies: the decoder layers' q/k/v/o and gate/up/down projections and the LM
    head (tied or not, it is a matmul); not the input embedding (a lookup), norms or biases."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    mlp = 3 * hidden * config["intermediate_size"]
    return layers * (attention + mlp) + hidden * config["vocab_size"]


def attention_width(config: dict) -> int:
    """d of the attention term: query heads x head dim."""
    heads = config["num_attention_heads"]
    return heads * (config.get("head_dim") or config["hidden_size"] // heads)


def training_flops(lengths, matmul_params: int, lora_params: int, layers: int, width: int) -> float:
    """Model FLOPs of one LoRA training pass (forward + backward) over samples of these token lengths:
    (4 N + 6 N_lora) t + 12 L d t^2 per sample (the module docstring derives it)."""
    return float(sum((4 * matmul_params + 6 * lora_params) * t + 12 * layers * width * t * t for t in lengths))


def peak_bf16_flops(device_name: str):
    """Peak dense bf16 FLOP/s of the named GPU, or None for one not in PEAK_BF16_TFLOPS."""
    return next((tflops * 1e12 for name, tflops in PEAK_BF16_TFLOPS if name in device_name), None)


def sample_spans(position_ids) -> list:
    """(start, end) of each sample of a packed row: its positions restart at 0 where a sample starts."""
    starts = [index for index, position in enumerate(position_ids) if position == 0]
    return list(pairwise(starts + [len(position_ids)]))


# ----------------------------------------------------------------------------- inputs (parent)


def pseudo_words(count: int, rng: random.Random) -> list:
    words = set()
    while len(words) < count:
        words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))))
    return sorted(words)


def write_tokenizer(directory: Path, words: list) -> None:
    """A byte-level BPE trained on the words: with ~1k merges each word becomes about one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([" ".join(words[i:i + 20]) for i in range(0, len(words), 20)] * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.save_pretrained(str(directory))


def chat(words: list, rng: random.Random, answer_words: int) -> dict:
    prompt = " ".join(rng.choice(words) for _ in range(8))
    answer = " ".join(rng.choice(words) for _ in range(max(1, answer_words)))
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def write_data(work: Path, settings: dict) -> dict:
    """The tokenizer and the data files every measurement reads: {name: path}."""
    rng = random.Random(SEED)
    words = pseudo_words(400, rng)
    paths = {"tokenizer": work / "tokenizer", "sft": work / "sft.jsonl", "prompts": work / "prompts.jsonl"}
    write_tokenizer(paths["tokenizer"], words)
    seq_len, rows = settings["seq_len"], max(batch for _, _, batch in settings["models"].values())
    # Lengths spread from a sixteenth of seq_len to a little over it (the longest cut to seq_len).
    write_jsonl(paths["sft"], [chat(words, rng, rng.randint(seq_len // 16, seq_len + seq_len // 8))
                               for _ in range(settings["steps"] * rows * 2)])
    for length in settings["memory_lengths"]:
        paths[f"memory-{length}"] = work / f"memory-{length}.jsonl"
        write_jsonl(paths[f"memory-{length}"], [chat(words, rng, length + 64) for _ in range(4)])
    write_jsonl(paths["prompts"], [{"instruction": " ".join(rng.choice(words) for _ in range(12))}
                                   for _ in range(settings["ppo_prompts"] * settings["ppo_iterations"])])
    return {name: str(path) for name, path in paths.items()}


# ----------------------------------------------------------------------------- measurement plan (parent)


def time_limits(kind: str, model: str, settings: dict) -> dict:
    """The run's min_s (what it needs left to start) and max_s (its time limit, unless less is left)."""
    if settings["smoke"]:
        least, most = SMOKE_TIME_LIMITS
    else:
        least, most = TIME_LIMITS[kind]
        least = least if "7b" in model else least / 2
    return {"min_s": least, "max_s": most}


def run_name(model: str, side: str, attention: str, packed: bool, options: tuple = ()) -> str:
    """e.g. llama-7b/sft-sdpa-packed+liger+compile (ours), llama-7b/trl-sdpa-unpacked+liger (TRL's)."""
    return f"{model}/{side}-{attention}-{'packed' if packed else 'unpacked'}" + "".join(f"+{o}" for o in options)


def sft_flags(settings: dict, model: str, paths: dict, data: str, length: int, batch: int, steps: int) -> list:
    return ["--model_name_or_path", paths[f"model:{model}"], "--data_path", paths[data], "--template",
            "human_assistant", "--max_seq_length", str(length), "--per_device_train_batch_size", str(batch),
            "--max_steps", str(steps), "--learning_rate", str(LEARNING_RATE), "--seed", str(SEED),
            "--lora_rank", str(LORA["r"]), "--lora_alpha", str(LORA["alpha"]), "--lora_dropout", str(LORA["dropout"]),
            "--trainable", LORA["targets"], "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1",
            *settings["precision"]]


def ours_sft_spec(settings: dict, paths: dict, model: str, attention: str = "sdpa", packed: bool = True,
                  options: tuple = (), quantized: bool = False) -> dict:
    """A throughput run of our SFT script: packed or not, under an attention, with OPTIONS' changes (their flags
    come last, so --lora_dropout 0 overrides the default given before it), or QLoRA."""
    batch = settings["models"][model][2]
    flags = sft_flags(settings, model, paths, "sft", settings["seq_len"], batch, settings["steps"])
    flags += ["--attn_implementation", attention] + (["--packing"] if packed else [])
    flags += ["--load_in_kbits", "4"] if quantized else []
    for option in options:
        flags += [flag.format(tokens=batch * settings["seq_len"]) for flag in OPTIONS[option].flags]
    needs = [need for option in options for need in OPTIONS[option].needs] + list(VARIANT_ATTENTIONS.get(attention, ()))
    needs += ["bitsandbytes", "cuda"] if quantized else []
    return {"name": run_name(model, "qlora" if quantized else "sft", attention, packed, options), "kind": "sft",
            "group": "throughput", "side": "ours", "model": model, "attention": attention, "packed": packed,
            "options": list(options), "qlora": quantized, "batch": batch, "check_packing": packed and not quantized,
            "warmup_steps": settings["warmup_steps"], "requires": list(dict.fromkeys(needs)),
            "on_cpu": settings["smoke"], "flags": flags, **time_limits("sft", model, settings)}


def trl_spec(settings: dict, paths: dict, model: str, liger: bool, flash: bool) -> dict:
    """TRL's SFTTrainer in its best configuration here (trl_sft_runner.py), with Liger's kernels or without."""
    attention, packed = ("flash_attention_2", True) if flash else ("sdpa", False)
    batch = settings["models"][model][2]
    options = {"model_dir": paths[f"model:{model}"], "data_path": paths["sft"], "template": "human_assistant",
               "max_length": settings["seq_len"], "batch": batch, "steps": settings["steps"],
               "learning_rate": LEARNING_RATE, "seed": SEED, "lora": LORA, "bf16": not settings["smoke"],
               "use_cpu": settings["smoke"], "attention": attention, "packed": packed, "liger": liger}
    return {"name": run_name(model, "trl", attention, packed, ("liger",) if liger else ()), "kind": "trl",
            "group": "throughput", "side": "trl", "model": model, "attention": attention, "packed": packed,
            "options": ["liger"] if liger else [], "qlora": False, "batch": batch, "check_packing": False,
            "warmup_steps": settings["warmup_steps"], "requires": ["trl", *(LIGER_NEEDS if liger else ())],
            "on_cpu": settings["smoke"], "trl": options, **time_limits("trl", model, settings)}


def memory_specs(settings: dict, model: str, paths: dict) -> list:
    """Each length with transformers' loss and the chunked loss; at the longest, the chunked loss without LoRA's
    dropout too (what the dropout's copies of each adapted layer's input cost: estimate_memory's rule)."""
    specs = []
    longest = max(settings["memory_lengths"])
    for length in settings["memory_lengths"]:
        common = sft_flags(settings, model, paths, f"memory-{length}", length, 1, 2)
        cases = [("full", False, ()), ("chunked", True, ())]
        cases += [("chunked-dropout0", True, ("--lora_dropout", "0"))] if length == longest else []
        for label, chunked, extra in cases:
            specs.append({"name": f"{model}/memory-{length}-{label}", "kind": "sft",
                          "group": "memory", "side": "ours", "model": model, "length": length, "chunked": chunked,
                          "dropout": LORA["dropout"] if not extra else 0.0,
                          "warmup_steps": 0, "check_packing": False, "requires": [],
                          "flags": common + ["--attn_implementation", "sdpa", "--activation_checkpointing",
                                             "--chunked_loss", "true" if chunked else "false", *extra],
                          **time_limits("sft", model, settings)})
    return specs


def ppo_spec(settings: dict, model: str, paths: dict, compiled: bool = False) -> dict:
    """run_ppo.py's flags for one PPO run: its default eager decode, or (compiled) the merged adapter and the
    compiled decode."""
    model_dir = paths[f"model:{model}"]
    options = {"actor_model_name_or_path": model_dir, "reward_model_name_or_path": model_dir,
               "reward_lora_model": paths[f"reward:{model}"], "data_path": paths["prompts"],
               "template": "human_assistant", "shared_base": "true", "max_prompt_seq_len": settings["ppo_prompt_len"],
               "max_answer_seq_len": settings["ppo_answer_len"],
               "per_device_generation_batch_size": settings["ppo_prompts"],
               "per_device_training_batch_size": settings["ppo_prompts"], "max_steps": settings["ppo_iterations"],
               "temperature": 1.0, "top_k": 0, "top_p": 1.0, "attn_implementation": "sdpa", "report_to": "none",
               "save_strategy": "no", "logging_steps": 1, "seed": SEED}
    if compiled:
        options.update(enable_hybrid_engine="true", rollout_engine="compiled")
    flags = list(settings["precision"])
    for name, value in options.items():
        flags += [f"--{name}", str(value)]
    return {"name": f"{model}/ppo{'-compiled' if compiled else ''}", "kind": "ppo", "group": "ppo", "model": model,
            "requires": [], "flags": flags, **time_limits("ppo", model, settings)}


def rollout_spec(settings: dict, model: str, paths: dict) -> dict:
    return {"name": f"{model}/rollout", "kind": "rollout", "group": "rollout", "model": model, "requires": [],
            "model_dir": paths[f"model:{model}"], "smoke": settings["smoke"], "rows": settings["ppo_prompts"],
            "prompt_len": settings["ppo_prompt_len"], "answer_len": settings["ppo_answer_len"], "timed_calls": 3,
            **time_limits("rollout", model, settings)}


def prepare_spec(settings: dict, paths: dict, model: str) -> dict:
    """The model's directory (random seeded weights and the tokenizer) and, where PPO runs, its reward adapter."""
    family, shape, _ = settings["models"][model]
    return {"name": f"{model}/prepare", "kind": "prepare", "model": model, "smoke": settings["smoke"],
            "tokenizer": paths["tokenizer"], "config": model_config(family, shape, settings),
            "model_dir": paths[f"model:{model}"], "requires": [],
            "reward_dir": paths[f"reward:{model}"] if "ppo" in settings["measure"] else None,
            **time_limits("prepare", model, settings)}


def model_config(family: str, shape: dict, settings: dict) -> dict:
    return {"model_type": family, **shape, "max_position_embeddings": settings["max_positions"]}


# ----------------------------------------------------------------------------- the plan's steps (parent)


def passes(result: dict | None) -> bool:
    """A packed run of ours that finished and whose packing check passed (its control included)."""
    return bool(result and result["status"] == "done" and isinstance(result.get("packing_check"), dict)
                and result["packing_check"]["passes"])


def best_ours_packed(results: dict, model: str, keep: Callable[[dict], bool] = passes) -> dict | None:
    """The fastest packed (not QLoRA) run of ours at model that keep accepts, or None."""
    runs = [r for r in results.values() if r["group"] == "throughput" and r["side"] == "ours" and r["model"] == model
            and r["packed"] and not r["qlora"] and keep(r)]
    return max(runs, key=lambda r: r["tokens_per_s"], default=None)


def baseline_step(session: Session) -> list:
    return [ours_sft_spec(session.settings, session.paths, model) for model in session.settings["headline"]]


def peers_step(session: Session) -> list:
    return [trl_spec(session.settings, session.paths, model, liger, session.flash_attention)
            for model in session.settings["headline"] for liger in (True, False)]


def variants_step(session: Session) -> list:
    settings, paths = session.settings, session.paths
    attentions = [name for name in VARIANT_ATTENTIONS if name != "flash_attention_2" or session.flash_attention]
    specs = []
    for model in settings["explored"]:
        specs.append(ours_sft_spec(settings, paths, model))
        specs += [ours_sft_spec(settings, paths, model, options=(option,)) for option in OPTIONS]
        specs += [ours_sft_spec(settings, paths, model, attention=attention) for attention in attentions]
        specs.append(ours_sft_spec(settings, paths, model, packed=False))
    return specs


def combination_step(session: Session) -> list:
    """At each explored shape, every change that beat its plain packed run, together (the fastest such attention,
    each such option), where that makes two or more. In the smoke run, whose timings mean nothing, every change
    that ran counts, so that the combination runs there too."""
    specs = []
    for model in session.settings["explored"]:
        plain = session.results.get(run_name(model, "sft", "sdpa", True))
        if not passes(plain):
            continue
        better = [r for r in session.results.values() if r["group"] == "throughput" and r["side"] == "ours"
                  and r["model"] == model and passes(r) and r is not plain
                  and (r["tokens_per_s"] > plain["tokens_per_s"] or session.settings["smoke"])]
        options = tuple(option for option in OPTIONS if any(option in r["options"] for r in better))
        attentions = [r for r in better if r["attention"] != "sdpa"]
        attention = max(attentions, key=lambda r: r["tokens_per_s"])["attention"] if attentions else "sdpa"
        if len(options) + (attention != "sdpa") >= 2:
            specs.append(ours_sft_spec(session.settings, session.paths, model, attention, True, options))
    return specs


def winners_step(session: Session) -> list:
    """Each explored shape's best packed run (its check passed) re-run at its family's 7B shape, unless the best
    is the plain packed run, which ran there first."""
    specs = []
    for model, target in session.settings["explored"].items():
        best = best_ours_packed(session.results, model)
        if best is None:
            session.winners[model] = {"best": None, "re_run": None, "why": "no packed run passed its check"}
            continue
        plain = best["attention"] == "sdpa" and not best["options"]
        spec = ours_sft_spec(session.settings, session.paths, target, best["attention"], True,
                             tuple(best["options"])) if target and not plain else None
        session.winners[model] = {"best": best["name"], "tokens_per_s": best["tokens_per_s"],
                                  "re_run": spec["name"] if spec else None,
                                  "why": None if spec else ("the plain packed run is the best" if plain
                                                            else "its 7B shape is not among --models")}
        specs += [spec] if spec else []
    return specs


def qlora_step(session: Session) -> list:
    return [ours_sft_spec(session.settings, session.paths, model, quantized=True)
            for model in session.settings["headline"]]


def memory_step(session: Session) -> list:
    return [spec for model in session.settings["models"] for spec in memory_specs(session.settings, model,
                                                                                   session.paths)]


def ppo_step(session: Session) -> list:
    return [ppo_spec(session.settings, model, session.paths, compiled) for model in session.settings["models"]
            for compiled in (False, True)]


def rollout_step(session: Session) -> list:
    return [rollout_spec(session.settings, model, session.paths) for model in session.settings["models"]]


class Step(NamedTuple):
    measurement: str  # the --measure choice it belongs to
    reads_results: bool  # built from the figures of the runs before it: those finish first
    specs: Callable[[Session], list]


# The plan, in priority order: what matters most first, so a time budget cut loses the least.
PLAN = (Step("sft", False, baseline_step), Step("peers", False, peers_step), Step("variants", False, variants_step),
        Step("variants", True, combination_step), Step("variants", True, winners_step),
        Step("qlora", False, qlora_step), Step("memory", False, memory_step), Step("ppo", False, ppo_step),
        Step("rollout", False, rollout_step))

# ----------------------------------------------------------------------------- driver (parent)


def missing_need(need: str, on_cpu: bool) -> str | None:
    """Why a need ("cuda" or a module) is not met here, seen from the parent (nothing imported), or None."""
    if need == "cuda":
        return "needs a CUDA GPU" if on_cpu else None
    return None if importlib.util.find_spec(need) else f"{need} is not installed"


class Session:
    """One benchmark run: the PLAN's steps in order within the time budget, each run's result recorded, and the
    JSON rewritten, as it arrives."""

    def __init__(self, settings: dict, work: Path, paths: dict, output: str, deadline: float) -> None:
        self.settings, self.work, self.output, self.deadline = settings, work, output, deadline
        self.paths = {**paths, **{f"{kind}:{model}": str(work / "models" / f"{model}{suffix}")
                                  for model in settings["models"] for kind, suffix in (("model", ""),
                                                                                       ("reward", "-reward"))}}
        self.results, self.prepared, self.winners, self.children = {}, {}, {}, 0
        self.flash_attention = not settings["smoke"] and flash_attention_2_available()

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def device(self) -> str:
        return next((p["device"] for p in self.prepared.values() if p["status"] == "done"), "?")

    def run(self) -> None:
        """The steps' runs in order; a step built from results waits for every run before it."""
        pending = []
        for step in PLAN:
            if step.measurement not in self.settings["measure"]:
                continue
            if step.reads_results:
                self.run_specs(pending)
                pending = []
            planned = set(self.results) | {spec["name"] for spec in pending}
            pending += [spec for spec in step.specs(self) if spec["name"] not in planned]
        self.run_specs(pending)

    def run_specs(self, specs: list) -> None:
        """On a GPU each run in a child of its own, its model prepared first in one of its own; in the smoke run all
        in one child (an import of the stack costs more there than a tiny run)."""
        if self.settings["smoke"]:
            return self.run_in_children(self.prepare_specs(specs) + specs)
        for spec in specs:
            for prepare in self.prepare_specs([spec]):
                self.run_in_children([prepare])
            prepared = self.prepared[spec["model"]]
            if prepared["status"] != "done":
                self.record(spec, {"status": "skipped",
                                   "message": f"its model was not prepared ({prepared['status']})"})
            else:
                self.run_in_children([spec])

    def prepare_specs(self, specs: list) -> list:
        models = [model for model in dict.fromkeys(spec["model"] for spec in specs) if model not in self.prepared]
        self.prepared.update({model: {"status": "pending"} for model in models})
        return [prepare_spec(self.settings, self.paths, model) for model in models]

    def run_in_children(self, specs: list) -> None:
        """specs in one child within the budget; a child that crashes or reaches its time limit loses the run it
        was in, and the runs after it go on in a new child. TRL's runs start only where trl (and Liger) are
        installed: where not, they are recorded "not available" without a child."""
        specs = [spec for spec in specs if not self.lacks_start_need(spec)]
        while specs:
            if self.left_s() >= specs[0]["min_s"]:
                specs = self.run_in_child(specs)
                continue
            spec = specs.pop(0)
            self.record(spec, {"status": "skipped: out of time",
                               "message": f"{self.left_s():.0f} s left, it needs {spec['min_s']:.0f} s"})

    def lacks_start_need(self, spec: dict) -> bool:
        needs = spec["requires"] if spec["kind"] == "trl" else []
        absent = next(filter(None, (missing_need(need, spec["on_cpu"]) for need in needs)), None)
        if absent:
            self.record(spec, {"status": "not available", "message": absent})
        return absent is not None

    def run_in_child(self, specs: list) -> list:
        """specs in one child, limited to their kinds' maxima or what is left; the specs still to run after it."""
        limit_s = min(self.left_s(), sum(spec["max_s"] for spec in specs))
        results, usage, log_path = self.spawn(specs, limit_s)
        for spec in specs:
            if spec["name"] in results:
                self.record(spec, {**results[spec["name"]], "child_peak_rss_mb": usage.peak_rss_mb})
        rest = [spec for spec in specs if spec["name"] not in results]
        if rest:  # the child ended in the first of them
            self.record(rest.pop(0), ended_early(usage, limit_s, log_path))
        self.save(complete=False)
        return rest

    def spawn(self, specs: list, limit_s: float) -> tuple[dict, ChildUsage, Path]:
        """(the results the child wrote, however it ended; its usage; its log)."""
        self.children += 1
        run_dir = self.work / f"child{self.children}"
        run_dir.mkdir()
        metrics = run_dir / "metrics.json"
        command = [sys.executable, str(Path(__file__).resolve()), "--child", "run", "--workdir", run_dir,
                   "--metrics", metrics, "--specs", write_json(run_dir / "specs.json", specs)]
        usage = run_child_until(command, run_dir / "log.txt", limit_s)
        return read_results(metrics) if metrics.is_file() else {}, usage, run_dir / "log.txt"

    def record(self, spec: dict, result: dict) -> None:
        entry = {**spec, **result}
        if spec["kind"] == "prepare":
            self.prepared[spec["model"]] = entry
        else:
            if entry["status"] == "done" and entry["group"] == "throughput":
                summarise_sft(entry, self.settings["models"][entry["model"]][1], peak_bf16_flops(self.device))
            elif entry["status"] == "done" and entry["group"] == "ppo":
                summarise_ppo(entry)
            self.results[spec["name"]] = entry
        figure = f" {entry['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in entry else ""
        message = f": {entry['message'][:160]}" if entry.get("message") else ""
        print(f"  {spec['name']}: {entry['status']}{figure}{message} ({self.left_s():.0f} s left)", flush=True)

    def save(self, complete: bool) -> dict:
        report = build_report(self, complete)
        write_json(self.output, report)
        return report


def ended_early(usage: ChildUsage, limit_s: float, log_path: Path) -> dict:
    """The result of the run a child was in when it ended without its figures."""
    if usage.timed_out:
        return {"status": "timed out", "message": f"stopped at its time limit, {limit_s:.0f} s"}
    last = next((line.strip() for line in reversed(log_tail(log_path).splitlines()) if line.strip()), "")
    how = f"killed by {signal.Signals(-usage.exit_code).name}" if usage.exit_code < 0 else f"exit {usage.exit_code}"
    return {"status": "crashed", "message": f"its process ended ({how}); its log's last line: {last[:300]}"}


def installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def flash_attention_2_available() -> bool:
    from transformers.utils import is_flash_attn_2_available

    return is_flash_attn_2_available()

# ----------------------------------------------------------------------------- inside a child


def device_sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device_memory_mb() -> dict:
    """GPU memory now and at its peak since the last reset (torch's allocator); on the CPU, the process's
    resident set now and its peak so far (Linux /proc/self/status)."""
    import torch

    if torch.cuda.is_available():
        return {"now_mb": torch.cuda.memory_allocated() / 2**20, "peak_mb": torch.cuda.max_memory_allocated() / 2**20,
                "reserved_peak_mb": torch.cuda.max_memory_reserved() / 2**20}
    fields = {}
    with open("/proc/self/status", encoding="utf-8") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) / 1024
    return {"now_mb": fields["VmRSS"], "peak_mb": fields["VmHWM"], "reserved_peak_mb": None}


def reset_peak_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


# The Trainer settings recorded with every run, so the JSON shows both sides trained alike.
PARITY_ARGS = ("learning_rate", "lr_scheduler_type", "optim", "weight_decay", "warmup_steps",
               "per_device_train_batch_size", "max_steps", "seed", "bf16", "activation_checkpointing",
               "gradient_checkpointing", "torch_compile", "use_liger_kernel")


class RunProbe(TrainingClock):
    """One run's figures: a step clock that synchronises the GPU before reading the time, the memory
    when the Trainer was built (the model loaded; the peak is reset there) and at the end, the logs."""

    def __init__(self, spec: dict):
        super().__init__()
        self.spec, self.step_s, self.figures, self.done = spec, [], {}, False

    def trainer_built(self, trainer) -> None:
        from transformers import TrainerCallback

        class Synchronise(TrainerCallback):  # added before the clock's callback, so it runs first
            def on_train_begin(self, args, state, control, **kwargs):
                device_sync()

            def on_step_end(self, args, state, control, **kwargs):
                device_sync()

        trainer.add_callback(Synchronise())
        trainer.add_callback(self.callback)
        model = trainer.model
        self.figures["lora_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.figures["memory_at_trainer_mb"] = device_memory_mb()["now_mb"]
        reset_peak_memory()

    def step_done(self, wall_s: float, cpu_s: float) -> None:
        self.step_s.append(wall_s)

    def finish(self, args) -> None:
        memory = device_memory_mb()
        self.figures.update({"peak_memory_mb": memory["peak_mb"], "reserved_peak_mb": memory["reserved_peak_mb"],
                             "growth_mb": memory["peak_mb"] - self.figures["memory_at_trainer_mb"],
                             "step_s": self.step_s, "bf16": bool(args.bf16),
                             "trainer_args": {name: json_value(getattr(args, name, None)) for name in PARITY_ARGS}})
        self.done = True


def json_value(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


class SFTProbe(RunProbe):
    """Also counts each batch's non-padding tokens and its samples' lengths (the collator is wrapped;
    a FIFO, since the dataloader may collate a batch ahead), and checks packed = alone before training."""

    def __init__(self, spec: dict):
        super().__init__(spec)
        self.pending, self.batches = deque(), []

    def trainer_built(self, trainer: Any) -> None:
        collator = trainer.data_collator
        trainer.data_collator = self.counting(collator)
        super().trainer_built(trainer)
        if self.spec.get("check_packing"):
            self.figures["packing_check"] = packing_check(trainer, collator, check_rows(trainer.train_dataset))
            reset_peak_memory()

    def counting(self, collator: Callable) -> Callable:
        def collate(features):
            lengths = []
            for feature in features:
                if "position_ids" in feature:  # ours, packed
                    lengths += [end - start for start, end in sample_spans(feature["position_ids"])]
                elif "seq_lengths" in feature:  # TRL's packed rows
                    lengths += list(feature["seq_lengths"])
                else:
                    lengths.append(len(feature["input_ids"]))
            batch = collator(features)
            self.pending.append({"lengths": lengths, "fed": int(batch["input_ids"].numel())})
            return batch
        return collate

    def step_done(self, wall_s: float, cpu_s: float) -> None:
        super().step_done(wall_s, cpu_s)
        self.batches.append(self.pending.popleft())

    def finish(self, args) -> None:
        super().finish(args)
        self.figures["batches"] = self.batches
        self.figures["losses"] = [log["loss"] for log in self.logs if "loss" in log]


def check_rows(dataset: Any, count: int = 2) -> list:
    """The first count packed rows that hold two samples or more: in a row of one sample nothing can attend across
    samples, so the control could not differ there (the longest samples, one to a row, come first)."""
    shared = [index for index, positions in enumerate(dataset["position_ids"]) if list(positions).count(0) >= 2]
    return [dataset[index] for index in (shared or range(len(dataset)))[:count]]


def span_losses(logits, labels, spans) -> list:
    """Mean next-token cross-entropy (float32) of each sample span of one row whose span has labels."""
    import torch.nn.functional as F

    losses = []
    for start, end in spans:
        targets = labels[start + 1:end]
        keep = targets != -100
        if bool(keep.any()):
            losses.append(float(F.cross_entropy(logits[start:end - 1][keep].float(), targets[keep])))
    return losses


def logits_of(trainer: Any, batch: dict) -> Any:
    """The model's logits for a collated batch (labels left out), without gradients, in the run's precision."""
    import torch

    device = trainer.args.device
    inputs = {name: value.to(device) if hasattr(value, "to") else value  # max_length_q/k are ints
              for name, value in batch.items() if name != "labels"}
    with torch.no_grad(), trainer.accelerator.autocast():
        return trainer.model(**inputs).logits


def packed_row_losses(logits: Any, rows: list) -> list:
    """Each sample's loss in packed rows, from the rows' logits (a sample: where its positions restart at 0)."""
    import torch

    losses = []
    for index, row in enumerate(rows):
        labels = torch.tensor(row["labels"], device=logits.device)
        losses += span_losses(logits[index], labels, sample_spans(row["position_ids"]))
    return losses


def alone_losses(trainer: Any, collator: Callable, rows: list) -> list:
    """Each sample of the packed rows run alone, as an unpacked batch of one."""
    import torch

    losses = []
    for row in rows:
        for start, end in sample_spans(row["position_ids"]):
            sample = {"input_ids": row["input_ids"][start:end], "labels": row["labels"][start:end]}
            labels = torch.tensor(sample["labels"], device=trainer.args.device)
            losses += span_losses(logits_of(trainer, collator([sample]))[0], labels, [(0, end - start)])
    return losses


def control_losses(trainer: Any, packed_batch: dict, rows: list) -> tuple[list, str]:
    """(each sample's loss, the attention it ran under) with the packed rows' restarting position_ids kept (RoPE as
    packed) and a causal mask over each whole row as the 4D attention_mask, which transformers takes as it is: each
    sample attends to the samples before it, the one thing a broken separation would change. The samples' bounds
    are left out (they would separate the samples again); a flash attention takes no 4D mask: sdpa runs it."""
    import torch

    from lorakit.data.build_dataset import whole_row_causal_mask

    base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    attention = base.config._attn_implementation
    control_attention = attention if attention in MASK_FORM else "sdpa"
    batch = {name: packed_batch[name] for name in ("input_ids", "labels", "position_ids")}
    form = MASK_FORM[control_attention]
    dtype = torch.bool if form == "bool" else base.get_input_embeddings().weight.dtype
    batch["attention_mask"] = whole_row_causal_mask(*batch["input_ids"].shape, dtype)
    if control_attention != attention:
        base.set_attn_implementation(control_attention)
    try:
        return packed_row_losses(logits_of(trainer, batch), rows), control_attention
    finally:
        if control_attention != attention:
            base.set_attn_implementation(attention)


def packing_check(trainer: Any, collator: Callable, rows: list) -> dict:
    """Each sample's loss in the packed rows (one batch through the run's collator) against the sample run alone,
    and the control (control_losses), which must differ from alone by more than the tolerance for the check to
    pass: a control that cannot fail proves nothing."""
    trainer.model.eval()
    packed_batch = collator([{k: row[k] for k in ("input_ids", "labels", "position_ids")} for row in rows])
    packed = packed_row_losses(logits_of(trainer, packed_batch), rows)
    alone = alone_losses(trainer, collator, rows)
    try:
        control, control_attention = control_losses(trainer, packed_batch, rows)
        control_diff, control_error = max(abs(a - b) for a, b in zip(control, alone, strict=True)), None
    except Exception as err:  # noqa: BLE001 - a control that cannot run fails the check, not the run
        control_diff, control_attention, control_error = None, None, f"{type(err).__name__}: {err}"[:300]
    trainer.model.train()
    tolerance = 2e-2 if trainer.args.bf16 else 1e-4
    packed_diff = max(abs(a - b) for a, b in zip(packed, alone, strict=True))
    equal, control_differs = packed_diff <= tolerance, control_diff is not None and control_diff > tolerance
    verdict = ("passes" if equal and control_differs else "packed != alone" if not equal
               else f"control could not run: {control_error}" if control_error else "control could not fail")
    return {"samples": len(alone), "mean_loss": statistics.mean(alone), "packed_max_abs_diff": packed_diff,
            "control_max_abs_diff": control_diff, "control_attention": control_attention,
            "control_mask": "lorakit.data.build_dataset.whole_row_causal_mask", "tolerance": tolerance,
            "equal": equal, "control_differs": control_differs, "passes": equal and control_differs,
            "verdict": verdict}
class PPOProbe(RunProbe):
    def finish(self, args) -> None:
        super().finish(args)
        self.figures["logs"] = [log for log in self.logs if "time_generation" in log]


@contextmanager
def synchronised_ppo_timers():
    """run_ppo's phase timers (PhaseTimes, RLStepCallback) read the clock right after queued GPU work
    finishes; unsynchronised, a phase's kernels still running are billed to the next phase."""
    from lorakit.rl import experience as ppo_experience
    from lorakit.rl import rl_trainer

    saved_timing = ppo_experience.PhaseTimes.timing
    callback = rl_trainer.RLStepCallback
    saved_steps = callback.on_step_begin, callback.on_step_end

    @contextmanager
    def timing(self, name):
        device_sync()
        with saved_timing(self, name):
            yield
            device_sync()

    def synchronised(method):
        def call(self, *args, **kwargs):
            device_sync()
            return method(self, *args, **kwargs)
        return call

    ppo_experience.PhaseTimes.timing = timing
    callback.on_step_begin, callback.on_step_end = (synchronised(step) for step in saved_steps)
    try:
        yield
    finally:
        ppo_experience.PhaseTimes.timing = saved_timing
        callback.on_step_begin, callback.on_step_end = saved_steps


# The probe of the run in progress: Trainer.__init__ is wrapped once per process (after_trainer_init).
ACTIVE_PROBE = []


def attach_probe(probe: RunProbe) -> RunProbe:
    """probe gets every Trainer built from now on (ours or TRL's) until the next one is attached."""
    if not ACTIVE_PROBE:
        after_trainer_init(lambda trainer: ACTIVE_PROBE[-1].trainer_built(trainer))
    ACTIVE_PROBE[:] = [probe]
    return probe


def probe_figures(probe: RunProbe) -> dict:
    if not probe.done:
        raise RuntimeError("training did not run to its end")
    return probe.figures


def run_script(spec: dict, run_dir: Path) -> dict:
    """spec's stage script, unmodified, as its own __main__ would run it; the probe's figures."""
    probe = attach_probe((SFTProbe if spec["kind"] == "sft" else PPOProbe)(spec))
    script = SFT_SCRIPT if spec["kind"] == "sft" else PPO_SCRIPT
    sys.argv = [str(script), *spec["flags"], "--data_cache_dir", str(run_dir / "data_cache"),
                "--output_dir", str(run_dir / "out")]
    timers = synchronised_ppo_timers() if spec["kind"] == "ppo" else nullcontext()
    with timers:
        runpy.run_path(str(script), run_name="__main__")
    return probe_figures(probe)


class NotAvailable(Exception):
    """What a run needs is not here (a module that does not import, a CUDA GPU)."""


def unmet_need(spec: dict) -> str | None:
    """The first of the run's needs not met here, in words, or None."""
    import torch

    for need in spec.get("requires", []):
        if need == "cuda":
            if spec["on_cpu"] or not torch.cuda.is_available():
                return "needs a CUDA GPU"
            continue
        try:
            importlib.import_module(need)
        except ModuleNotFoundError as err:
            if err.name == need:
                return f"{need} is not installed"
            return f"{need} does not import: {err}"
        except Exception as err:  # noqa: BLE001 - a module that fails to import is not available, whatever the error
            return f"{need} does not import: {type(err).__name__}: {err}"[:300]
    return None


def run_trl(spec: dict, run_dir: Path) -> dict:
    """TRL's SFTTrainer (trl_sft_runner.py) under the same probe as ours; "not available" without trl or Liger."""
    unmet = unmet_need(spec)
    if unmet:
        raise NotAvailable(unmet)
    from trl_sft_runner import train_with_trl

    probe = attach_probe(SFTProbe(spec))
    train_with_trl(spec["trl"], str(run_dir / "out"))
    return probe_figures(probe)


class StderrTail:
    """sys.stderr that also keeps what was written to it last: our script's refusal is one line there."""

    def __init__(self, stream: Any, keep: int = 8000) -> None:
        self.stream, self.keep, self.text = stream, keep, ""

    def write(self, text: str) -> int:
        self.text = (self.text + text)[-self.keep:]
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    def error_line(self) -> str | None:
        """The last line that says "error:" (lorakit.core.cli's and argparse's refusals), or None."""
        return next((line.strip() for line in reversed(self.text.splitlines()) if "error:" in line), None)


def failure(spec: dict, err: BaseException, stderr: StderrTail) -> dict:
    """A run that ended without its figures: refused (our script's exit 2; a flag it does not have yet), not
    available (what it needs is not here), or failed, with the one line that says why."""
    code = err.code if isinstance(err, SystemExit) else None
    said = stderr.error_line() if code is not None else None
    message = said or " ".join(f"{type(err).__name__}: {err}".split())[:500]
    if isinstance(err, NotAvailable):
        return {"status": "not available", "message": str(err)}
    if code == 2 and any(sign in message for sign in UNKNOWN_FLAG_SIGNS):
        return {"status": "refused", "message": f"flag not in this version of our script: {message}"}
    unmet = unmet_need(spec)
    if unmet:
        return {"status": "not available", "message": f"{unmet}; {message}"}
    return {"status": "refused" if code == 2 else "failed", "message": message}


def run_one(spec: dict, run_dir: Path) -> dict:
    """One run's result: its figures with status "done", or why it has none."""
    measure = {"prepare": prepare_model, "rollout": measure_rollout, "trl": run_trl}.get(spec["kind"], run_script)
    stderr = StderrTail(sys.stderr)
    with redirect_stderr(stderr):
        try:
            return {"status": "done", **measure(spec, run_dir)}
        except (Exception, SystemExit) as err:  # noqa: BLE001 - every failure is reported with the run
            return failure(spec, err, stderr)


def run_specs(specs: list, workdir: Path, metrics: Path) -> None:
    """Each spec in turn in this process, the results written after each: a process stopped or crashed later
    keeps what finished."""
    import torch

    results = {}
    for number, spec in enumerate(specs):
        run_dir = workdir / f"run{number}"
        run_dir.mkdir(parents=True)
        results[spec["name"]] = run_one(spec, run_dir)
        write_json(metrics, results)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        result = results[spec["name"]]
        print(f"  {spec['name']}: {result['status']} {result.get('message', '')}", flush=True)


def run_child(args: argparse.Namespace) -> None:
    run_specs(json.loads(Path(args.specs).read_text(encoding="utf-8")), Path(args.workdir), Path(args.metrics))


def prepare_model(spec: dict, run_dir: Path) -> dict:
    """The model (random seeded weights, bf16 on a GPU) and, for PPO, its reward adapter."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    on_gpu = torch.cuda.is_available() and not spec["smoke"]
    fields = dict(spec["config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(SEED)
    with torch.device("cuda" if on_gpu else "cpu"):
        network = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if on_gpu else torch.float32)
    network.save_pretrained(spec["model_dir"])
    tokenizer.save_pretrained(spec["model_dir"])
    del network
    if spec["reward_dir"]:
        from bench_ppo import write_reward_adapter

        write_reward_adapter(spec["model_dir"], Path(spec["reward_dir"]))
    return {"device": torch.cuda.get_device_name() if on_gpu else f"CPU ({os.cpu_count()} cores)"}


def rollout_actor(spec: dict):
    """(the actor as the rollout engines take it, its device): the spec's model, bf16 on a GPU, with a seeded
    LoRA adapter on every linear layer whose B is not zero (so a merge changes the weights)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    on_gpu = torch.cuda.is_available() and not spec["smoke"]
    device = torch.device("cuda" if on_gpu else "cpu")
    network = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.bfloat16 if on_gpu else torch.float32,
                                                   attn_implementation="sdpa").to(device)
    torch.manual_seed(SEED)
    lora = LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    actor = get_peft_model(network, lora).eval().get_base_model()  # LoRA layers in the model, as PPO's actor
    return SimpleNamespace(generator=lambda: actor), device


def time_engine(engine, prompt_ids, prompt_mask, calls: int) -> dict:
    """One warm-up call (timed: the compiled engine compiles there), then calls timed ones from the same seed:
    milliseconds per new token (the batch's answer width), their median."""
    import time

    import torch

    def one_call() -> tuple:
        torch.manual_seed(SEED)
        device_sync()
        started = time.perf_counter()
        with torch.no_grad():
            sampled = engine.sample(prompt_ids, prompt_mask)
        device_sync()
        return time.perf_counter() - started, sampled.tokens.shape[1]

    first_s, _ = one_call()
    timed = [one_call() for _ in range(calls)]
    return {"first_call_s": first_s, "answer_len": timed[-1][1],
            "ms_per_token": statistics.median(1000 * seconds / width for seconds, width in timed)}


def measure_rollout(spec: dict, run_dir: Path) -> dict:
    """Each of ROLLOUT_ENGINES on one actor built once (rollout_actor), PPO's sampling settings, prompts of random
    ids: time_engine's figures, and the graphs the compiled engine built."""
    import torch

    from lorakit.rl.rollout import compiled_graphs, rollout_engine

    policy, device = rollout_actor(spec)
    config = policy.generator().config
    generator = torch.Generator().manual_seed(SEED)
    prompt_ids = torch.randint(3, config.vocab_size, (spec["rows"], spec["prompt_len"]), generator=generator)
    prompt_ids, prompt_mask = prompt_ids.to(device), torch.ones_like(prompt_ids).to(device)
    figures = {"engines": {}, "device_memory_mb": None}
    for label, name, merge in ROLLOUT_ENGINES:
        args = SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0, world_size=1, chunked_loss=True, device=device,
                               generation_gather="auto", enable_hybrid_engine=merge, rollout_engine=name)
        engine = rollout_engine(policy, args, 0, config.eos_token_id, spec["answer_len"], lambda: None)
        graphs = compiled_graphs()
        figures["engines"][label] = {**time_engine(engine, prompt_ids, prompt_mask, spec["timed_calls"]),
                                     "graphs": compiled_graphs() - graphs}
    figures["device_memory_mb"] = device_memory_mb()
    return figures


# ----------------------------------------------------------------------------- figures and report (parent)


def summarise_sft(result: dict, config: dict, peak_flops) -> None:
    """Tokens/s, padding, step time, model FLOP/s and MFU over the steps after the warm-up ones."""
    warm = result["warmup_steps"]
    batches, step_s = result["batches"][warm:], result["step_s"][warm:]
    lengths = [length for batch in batches for length in batch["lengths"]]
    seconds, fed = sum(step_s), sum(batch["fed"] for batch in batches)
    flops = training_flops(lengths, matmul_parameters(config), result["lora_parameters"],
                           config["num_hidden_layers"], attention_width(config))
    result.update({"measured_steps": len(step_s), "non_padding_tokens": sum(lengths),
                   "tokens_per_s": sum(lengths) / seconds, "padding_pct": 100.0 * (1 - sum(lengths) / fed),
                   "median_step_s": statistics.median(step_s), "model_flops": flops,
                   # The steady state a long run approaches: a few slow steps (a new shape's first kernels, a
                   # recompile) weigh in full in tokens_per_s over 10 steps, not here.
                   "median_tokens_per_s": sum(lengths) / len(step_s) / statistics.median(step_s),
                   "model_tflops_per_s": flops / seconds / 1e12,
                   "mfu": flops / seconds / peak_flops if peak_flops else None})


def summarise_ppo(result: dict) -> None:
    """Medians over the iterations after the first (all of them when there is one)."""
    logs, step_s = result["logs"][1:] or result["logs"], result["step_s"][1:] or result["step_s"]
    result.update({"iteration_s": statistics.median(step_s),
                   **{f"{phase}_s": statistics.median(log[f"time_{phase}"] for log in logs)
                      for phase in ("generation", "scoring", "training")},
                   "response_length": statistics.median(log.get("response_length", 0.0) for log in logs)})


def gb(value) -> str:
    return f"{value / 1024:.2f}" if value is not None else "-"


def not_done_line(name: str, r: dict, name_width: int) -> str:
    return f"{name:<{name_width}} {r['status']}" + (f": {r['message'][:110]}" if r.get("message") else "")


def group_lines(results: dict, group: str, name_width: int, row: Callable) -> list:
    """One table line per run of the group: row(its name padded to name_width, result), or why it has no figures."""
    return [row(f"{name:<{name_width}}", r) if r["status"] == "done" else not_done_line(name, r, name_width)
            for name, r in results.items() if r["group"] == group]


def name_width(results: dict, group: str, least: int) -> int:
    return max([least] + [len(name) for name, r in results.items() if r["group"] == group])


def check_text(check: dict | None) -> str:
    if not isinstance(check, dict):
        return "-"
    control = "-" if check["control_max_abs_diff"] is None else f"{check['control_max_abs_diff']:.1e}"
    text = f"{'yes' if check['passes'] else 'NO'} ({check['packed_max_abs_diff']:.1e}; control {control})"
    return text if check["passes"] else f"{text}: {check['verdict']}"


def sft_row(name: str, r: dict) -> str:
    mfu = f"{100 * r['mfu']:.1f}" if r["mfu"] is not None else "-"
    return (f"{name} {r['batch']:>5} {r['tokens_per_s']:>10.0f} {r['median_tokens_per_s']:>10.0f} "
            f"{r['padding_pct']:>8.1f} "
            f"{r['median_step_s']:>7.3f} {r['model_tflops_per_s']:>8.1f} {mfu:>6} "
            f"{gb(r['peak_memory_mb']):>8}  {check_text(r.get('packing_check'))}")


def memory_row(name: str, r: dict) -> str:
    return (f"{name} {r['length']:>7} {'chunked' if r['chunked'] else 'full':>9} {r['dropout']:>7g} "
            f"{gb(r['peak_memory_mb']):>8} {gb(r['memory_at_trainer_mb']):>10} {gb(r['growth_mb']):>9}")


def ppo_row(name: str, r: dict) -> str:
    return (f"{name} {r['iteration_s']:>11.2f} {r['generation_s']:>12.2f} {r['scoring_s']:>9.2f} "
            f"{r['training_s']:>10.2f} {r['response_length']:>10.1f} {gb(r['peak_memory_mb']):>8}")


def rollout_lines(results: dict) -> list:
    """One table line per engine of each rollout measurement (or why it has none)."""
    lines = []
    for name, r in results.items():
        if r["group"] != "rollout":
            continue
        if r["status"] != "done":
            lines.append(not_done_line(name, r, 20))
            continue
        for label, e in r["engines"].items():
            lines.append(f"{name:<20} {label:<26} {e['ms_per_token']:>10.2f} {e['answer_len']:>10} "
                         f"{e['first_call_s']:>12.1f} {e['graphs']:>7}")
    return lines


def rollout_verdicts(finished: dict, device: str) -> list:
    """The decode and PPO-iteration targets, judged at the Llama-7B shape on an H100 or H200 only."""
    if not any(gpu in device for gpu in ("H100", "H200")):
        return []
    verdicts = []
    rollout = finished.get("llama-7b/rollout")
    if rollout:
        value = rollout["engines"][ROLLOUT_ENGINES[-1][0]]["ms_per_token"]
        verdicts.append({"target": f"llama-7b: compiled decode <= {DECODE_MS_TARGET} ms per new token (batch 8)",
                         "value": value, "meets": value <= DECODE_MS_TARGET})
    ppo = finished.get("llama-7b/ppo-compiled")
    if ppo:
        value = ppo["iteration_s"]
        verdicts.append({"target": f"llama-7b: PPO iteration (8 x 256, compiled decode) <= {PPO_ITERATION_S_TARGET} s",
                         "value": value, "meets": value <= PPO_ITERATION_S_TARGET})
    return verdicts


def packed_equal(result: dict) -> bool:
    """Packed loss = loss alone (the control aside): what the ours/TRL ratios take as ours' packed run."""
    return isinstance(result.get("packing_check"), dict) and result["packing_check"]["equal"]


def peer_ratios(ratios: Ratios, finished: dict, models: list) -> list:
    """ours' best packed run against TRL and TRL+Liger at each headline model (tokens/s, peak memory); notes
    where the two sides did not train the same number of LoRA weights."""
    notes = []
    for model in models:
        ours = best_ours_packed(finished, model, packed_equal)
        for label, liger in (("TRL", False), ("TRL+Liger", True)):
            peer = next((r for r in finished.values() if r["group"] == "throughput" and r["side"] == "trl"
                         and r["model"] == model and ("liger" in r["options"]) == liger), None)
            if not ours or not peer:
                continue
            liger_targets = liger and model.endswith("-7b")  # issue 33's targets: against TRL + Liger, at 7B
            ratios.add(f"{model}: ours packed best/{label} tokens/s", ours["name"], peer["name"], "tokens_per_s",
                       target=PEER_SPEED_TARGET if liger_targets else None, at_most=False)
            ratios.add(f"{model}: ours packed best/{label} tokens/s at the median step", ours["name"], peer["name"],
                       "median_tokens_per_s")
            ratios.add(f"{model}: ours packed best/{label} peak memory", ours["name"], peer["name"], "peak_memory_mb",
                       target=PEER_MEMORY_TARGET if liger_targets else None)
            if ours["lora_parameters"] != peer["lora_parameters"]:
                notes.append(f"{model}: {ours['name']} trains {ours['lora_parameters']:,} LoRA weights, "
                             f"{peer['name']} {peer['lora_parameters']:,}")
    return notes


def judge(session: Session) -> tuple:
    """(the ratios, the verdicts, notes) over the runs that finished."""
    settings, device = session.settings, session.device
    finished = {name: r for name, r in session.results.items() if r["status"] == "done"}
    ratios = Ratios(finished)
    notes = peer_ratios(ratios, finished, settings["headline"])
    longest = max(settings["memory_lengths"])
    for model in settings["models"]:
        for length in settings["memory_lengths"]:
            ratios.add(f"{model} {length} tokens: chunked/full peak memory", f"{model}/memory-{length}-chunked",
                       f"{model}/memory-{length}-full", "peak_memory_mb",
                       target=MEMORY_TARGET if length == longest else None)
            ratios.add(f"{model} {length} tokens: chunked/full growth", f"{model}/memory-{length}-chunked",
                       f"{model}/memory-{length}-full", "growth_mb",
                       target=GROWTH_TARGET if length == longest else None)
        ratios.add(f"{model} {longest} tokens: chunked, dropout 0/full growth",
                   f"{model}/memory-{longest}-chunked-dropout0", f"{model}/memory-{longest}-full", "growth_mb")
        ratios.add(f"{model}: QLoRA/bf16 step time", run_name(model, "qlora", "sdpa", True),
                   run_name(model, "sft", "sdpa", True), "median_step_s", target=QLORA_TIME_TARGET)
    # The ratios' verdicts (Ratios.print shows them) beside the others, which print_report shows.
    verdicts = [{"target": f"{name} {'<=' if at_most else '>='} {target}", "value": value, "meets": ok, "ratio": True}
                for name, value, target, ok, at_most in ratios.verdicts]
    for model in settings["models"]:
        mfus = [r["mfu"] for r in finished.values() if r["model"] == model and r["group"] == "throughput"
                and r["side"] == "ours" and not r["qlora"] and r["mfu"] is not None]
        if model.endswith("-7b") and mfus and ("H100" in device or "H200" in device) and settings["seq_len"] == 2048:
            verdicts.append({"target": f"{model}: best LoRA SFT MFU >= {MFU_TARGET:.0%} (H100/H200, seq 2048)",
                             "value": max(mfus), "meets": max(mfus) >= MFU_TARGET})
    return ratios, verdicts + rollout_verdicts(finished, device), notes


def build_report(session: Session, complete: bool) -> dict:
    settings = session.settings
    ratios, verdicts, notes = judge(session)
    failing = {name: r["packing_check"]["verdict"] for name, r in session.results.items()
               if isinstance(r.get("packing_check"), dict) and not passes(r)}
    return {"benchmark": "gpu", "complete": complete, "device": session.device,
            "peak_bf16_flops": peak_bf16_flops(session.device),
            "mfu_formula": "(4 N + 6 N_lora) t + 12 L d t^2 model FLOPs per sample of t tokens",
            "time_budget_s": settings["time_budget_s"], "elapsed_s": settings["time_budget_s"] - session.left_s(),
            "settings": {**settings, "models": {name: {"family": family, "config": shape, "batch": batch}
                                                for name, (family, shape, batch) in settings["models"].items()}},
            "environment": {**environment("torch", "transformers", "peft"),
                            **{name: installed_version(name) for name in ("trl", "liger_kernel", "flash_attn")}},
            "flash_attention_2": session.flash_attention, "plan": [step.specs.__name__ for step in PLAN],
            "prepared": session.prepared, "results": session.results, "winners": session.winners,
            "packing_checks_failing": failing,
            "without_figures": {name: f"{r['status']}: {r.get('message', '')}" for name, r in session.results.items()
                                if r["status"] != "done"},
            "ratios": ratios.values, "verdicts": verdicts, "notes": notes}


def print_tables(session: Session) -> None:
    results, settings = session.results, session.settings
    width = name_width(results, "throughput", 34)
    print(f"\nLoRA SFT, seq {settings['seq_len']}, {settings['steps'] - settings['warmup_steps']} measured steps "
          f"(after {settings['warmup_steps']} warm-up)")
    print_table(f"{'run':<{width}} {'batch':>5} {'tokens/s':>10} {'at median':>10} {'padding%':>8} {'step s':>7} "
                f"{'TFLOP/s':>8} {'MFU%':>6} {'peak GB':>8}  packing check: packed = alone (max |diff|; whole-row "
                "control)",
                group_lines(results, "throughput", width, sft_row))
    print("\nPeak memory, one row, batch 1, activation checkpointing (loaded: the model as loaded; growth: the "
          "peak over it)")
    print_table(f"{'run':<34} {'tokens':>7} {'loss':>9} {'dropout':>7} {'peak GB':>8} {'loaded GB':>10} "
                f"{'growth GB':>9}",
                group_lines(results, "memory", 34, memory_row))
    print(f"\nPPO, {settings['ppo_prompts']} prompts x {settings['ppo_answer_len']} new tokens, shared base "
          "(seconds, median over the iterations after the first)")
    print_table(f"{'run':<24} {'iteration s':>11} {'generation s':>12} {'scoring s':>9} {'training s':>10} "
                f"{'answer len':>10} {'peak GB':>8}", group_lines(results, "ppo", 24, ppo_row))
    print(f"\nRollout engines, {settings['ppo_prompts']} prompts of {settings['ppo_prompt_len']} tokens, up to "
          f"{settings['ppo_answer_len']} new tokens, the actor built once (ms per new token: median of 3 calls "
          "after a warm-up call, which pays any compile)")
    print_table(f"{'run':<20} {'engine':<26} {'ms/token':>10} {'answer len':>10} {'warm-up s':>12} {'graphs':>7}",
                rollout_lines(results))


def print_report(session: Session, report: dict) -> None:
    peak_flops = report["peak_bf16_flops"]
    print(f"\nDevice: {report['device']}; peak bf16 dense: "
          f"{f'{peak_flops / 1e12:.0f} TFLOP/s' if peak_flops else 'unknown (MFU not reported)'}; "
          f"trl {report['environment']['trl']}, liger_kernel {report['environment']['liger_kernel']}; "
          f"{report['elapsed_s']:.0f} s of a {report['time_budget_s']:.0f} s budget")
    print_tables(session)
    ratios, verdicts, notes = judge(session)
    ratios.print(56)
    for verdict in verdicts:
        if "MFU" in verdict["target"]:
            print(f"{verdict['target']}: {100 * verdict['value']:.1f}% ({'meets' if verdict['meets'] else 'MISSES'})")
        elif not verdict.get("ratio"):
            print(f"{verdict['target']}: {verdict['value']:.2f} ({'meets' if verdict['meets'] else 'MISSES'})")
    for model, winner in report["winners"].items():
        print(f"{model}: best packed run {winner['best'] or '-'}; re-run: {winner['re_run'] or winner['why']}")
    for name, verdict in report["packing_checks_failing"].items():
        print(f"{name}: packing check FAILS ({verdict})")
    for line in notes:
        print(f"note: {line}")
    if session.settings["smoke"]:
        print("\n(--cpu_smoke: tiny shapes on the CPU, the runs of consecutive steps in one process: the figures only "
              "show that each code path runs; memory is the process's peak RSS so far)")


def main(argv: list | None = None) -> dict:
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    deadline = time.monotonic() + args.time_budget_s
    settings = settings_of(args)
    import torch

    if not settings["smoke"] and not torch.cuda.is_available():
        bad_flag("no CUDA device here; run it on a GPU machine (make gpu-check), or add --cpu_smoke to check its "
                 "code paths on tiny shapes on the CPU")
    os.chdir(REPO)
    quiet_offline_env()
    output = args.output or ("outputs/bench/gpu_cpu_smoke.json" if settings["smoke"] else "outputs/bench/gpu.json")
    print(f"GPU benchmark{' (CPU smoke run)' if settings['smoke'] else ''}: {', '.join(settings['models'])}; "
          f"measuring {', '.join(settings['measure'])}; {args.time_budget_s:.0f} s budget", flush=True)
    with scratch_dir("bench_gpu-", keep=args.keep) as work:
        os.environ["HF_DATASETS_CACHE"] = str(work / "hf_datasets")
        session = Session(settings, work, write_data(work, settings), output, deadline)
        session.run()
    report = session.save(complete=True)
    print_report(session, report)
    print(f"\nwrote {output}")
    return report


if __name__ == "__main__":
    main()
