"""Benchmark: the toolkit on a GPU (`make gpu-check`): LoRA SFT tokens/s and model FLOPs utilisation,
QLoRA, peak memory with and without the chunked loss, and PPO's iteration split, on 1B- and 7B-shaped
Llama and Qwen models built from their configs (random seeded weights, nothing downloaded).

Models (the shapes of the published configs, written once as safetensors under the work directory;
set TMPDIR to a disk with ~40 GB free for the 7B shapes):
  llama-1b  Llama-3.2-1B's shape     (hidden 2048, 16 layers, GQA 32/8 heads, vocab 128,256, tied head)
  llama-7b  Llama-2-7B's shape       (hidden 4096, 32 layers, 32 heads, vocab 32,000)
  qwen-1b   Qwen2.5-1.5B's shape     (hidden 1536, 28 layers, GQA 12/2 heads, vocab 151,936, tied head)
  qwen-7b   Qwen2.5-7B's shape       (hidden 3584, 28 layers, GQA 28/4 heads, vocab 152,064)
Tokenizer: a byte-level BPE of ~1k tokens trained on seeded pseudo-words (one word is about one token);
the model's embeddings keep their full vocabulary, so the LM head costs what it costs the real model.
Data: seeded single-turn chats ("human_assistant" template) of uniformly spread lengths up to --seq_len.

Every figure comes from the toolkit's own code: scripts/training/run_sft_with_peft.py and run_ppo.py run
unmodified as __main__ (runpy) in a child process per measurement, so model loading is lorakit.models.loader's
load_model, packing is build_dataset's pack_samples and collator (with the flash-attention varlen bounds
under flash_attention_2), the loss is CausalLMTrainer's (chunked_loss.py with --chunked_loss true), PPO is
the PPO trainer. The child only adds a callback (CUDA-synchronised step clock, memory readings) and wraps
the collator to count tokens. All runs: bf16 weights and --bf16, LoRA with the toolkit's defaults (r 8,
alpha 32, dropout 0.05, all linear layers), AdamW lr 1e-4, seed 42.

Measurements (each model; --measure picks):
* sft     LoRA SFT at --seq_len (2048), per attention (sdpa, and flash_attention_2 when it imports),
          unpacked (rows padded to the batch's longest) and packed (--packing: padding-free rows of at
          most --seq_len). Figures over the steps after --warmup_steps: non-padding tokens/s, padding,
          seconds per step, MFU, peak GPU memory. In each packed run, before training: the first batch's
          packed rows through the model, each sample's mean loss against the same sample run alone, and,
          as a control that the check can fail, the same rows run as one causal sequence (the samples
          attending to each other).
* qlora   the packed sdpa run with --load_in_kbits 4 (bitsandbytes NF4).
* memory  one row of 4096 and of 8192 tokens (batch 1, --activation_checkpointing as a long-sequence run
          is set up), --chunked_loss false (transformers' loss over the full logits) and true: peak GPU
          memory (torch.cuda.max_memory_allocated over training) and its growth over the loaded model.
* ppo     run_ppo.py --shared_base true, --ppo_prompts prompts x --ppo_answer_len new tokens per iteration,
          an untrained reward adapter (bench_ppo.write_reward_adapter): seconds per iteration split into
          generation, scoring and training (run_ppo's own timers, each made to synchronise the GPU before
          reading the clock), median over the iterations after the first; once as run_ppo.py's defaults
          decode (eager, the adapter unmerged) and once with --enable_hybrid_engine --rollout_engine compiled.
* rollout the rollout engines (lorakit.rl.rollout) on one actor, built once in one process: the model with a
          LoRA adapter (r 8, all linear layers, B not zero) sampling --ppo_prompts prompts of --ppo_prompt_len
          tokens, up to --ppo_answer_len new ones: milliseconds per new token (median of 3 timed calls after
          one warm-up call) eager with the adapter unmerged (what PPO's actor paid), eager merged
          (--enable_hybrid_engine), and compiled merged (static KV cache, torch.compile with CUDA graphs; its
          warm-up call pays the compile, reported with the graphs it built).

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

Targets (issues): LoRA SFT MFU >= 45% on an H100 at 7B shapes, seq 2048 (the best run of each 7B model);
peak memory at 8k tokens with the chunked loss <= 0.5 x transformers' own loss path; on an H100 or H200 at
the Llama-7B shape, batch 8 x 256 new tokens: the compiled decode <= 12 ms per new token and a PPO
iteration with it <= 5 s.

Without a CUDA device the script says so in one line and exits 2. --cpu_smoke runs every measurement on
tiny shapes (2 layers, seq 64) on the CPU in one child, to check the code paths: its figures mean nothing
(memory there is the child's peak RSS so far) and go to outputs/bench/gpu_cpu_smoke.json. Results:
a table, and outputs/bench/gpu.json (the device named in both).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import runpy
import statistics
import sys
from collections import deque
from contextlib import contextmanager, nullcontext
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace

from measure import (
    REPO,
    Ratios,
    TrainingClock,
    add_child_arguments,
    after_trainer_init,
    environment,
    print_table,
    quiet_offline_env,
    run_child_benchmark,
    scratch_dir,
    write_json,
    write_jsonl,
)

SFT_SCRIPT = REPO / "scripts" / "training" / "run_sft_with_peft.py"
PPO_SCRIPT = REPO / "scripts" / "training" / "run_ppo.py"
SEED = 42
MEASUREMENTS = ("sft", "qlora", "memory", "ppo", "rollout")
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
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 2048}
SMOKE_SHAPES = {"llama-tiny": ("llama", {**TINY, "tie_word_embeddings": False}, 4),
                "qwen-tiny": ("qwen2", {**TINY, "tie_word_embeddings": True}, 4)}
# Peak dense (not sparse) bf16 tensor FLOP/s, in TFLOP/s, from the vendor's data sheets; the first name
# contained in torch.cuda.get_device_name() wins, so the PCIe/NVL variants come before the SXM part.
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0),
                    ("A100", 312.0), ("L40S", 362.0))
MFU_TARGET, MEMORY_TARGET = 0.45, 0.5
DECODE_MS_TARGET, PPO_ITERATION_S_TARGET = 12.0, 5.0  # Llama-7B shape, 8 x 256, on an H100 or H200
# (label, --rollout_engine, --enable_hybrid_engine) of each engine the rollout measurement times, in this order.
ROLLOUT_ENGINES = (("eager, adapter unmerged", "eager", False), ("eager, adapter merged", "eager", True),
                   ("compiled, adapter merged", "compiled", True))
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu_smoke", action="store_true",
                        help="every measurement on tiny shapes on the CPU (checks the code paths; no real figures)")
    parser.add_argument("--models", nargs="+", default=None,
                        help=f"shapes to build and measure (default: all of {', '.join(SHAPES)})")
    parser.add_argument("--measure", nargs="+", default=list(MEASUREMENTS), choices=MEASUREMENTS)
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


def settings_of(args) -> dict:
    """The run's settings: the GPU defaults, or the smoke run's tiny ones, each overridden by its flag."""
    smoke = args.cpu_smoke
    shapes = SMOKE_SHAPES if smoke else SHAPES
    models = args.models or list(shapes)
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
    precision = ["--torch_dtype", "float32", "--use_cpu"] if smoke else ["--torch_dtype", "bfloat16", "--bf16"]
    return {**chosen, "smoke": smoke, "models": {name: shapes[name] for name in models},
            "measure": list(args.measure), "precision": precision, "ppo_prompt_len": 32 if smoke else 64,
            "max_positions": 256 if smoke else 32768}


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


def sft_flags(settings: dict, model: str, paths: dict, data: str, length: int, batch: int, steps: int) -> list:
    return ["--model_name_or_path", paths[f"model:{model}"], "--data_path", paths[data], "--template",
            "human_assistant", "--max_seq_length", str(length), "--per_device_train_batch_size", str(batch),
            "--max_steps", str(steps), "--learning_rate", "1e-4", "--seed", str(SEED), "--report_to", "none",
            "--save_strategy", "no", "--logging_steps", "1", *settings["precision"]]


def sft_specs(settings: dict, model: str, batch: int, paths: dict, attentions: list) -> list:
    """The throughput runs of one model: each attention unpacked and packed, then QLoRA (packed, sdpa)."""
    specs = []
    common = sft_flags(settings, model, paths, "sft", settings["seq_len"], batch, settings["steps"])
    variants = [(attn, packed, False) for attn in attentions for packed in (False, True)
                if "sft" in settings["measure"]]
    if "qlora" in settings["measure"]:
        variants.append(("sdpa", True, True))
    for attn, packed, quantized in variants:
        name = f"{model}/{'qlora' if quantized else 'sft'}-{attn}-{'packed' if packed else 'unpacked'}"
        flags = common + ["--attn_implementation", attn] + (["--packing"] if packed else [])
        specs.append({"name": name, "kind": "sft", "group": "throughput", "model": model, "attention": attn,
                      "packed": packed, "qlora": quantized, "batch": batch, "packing_check": packed and not quantized,
                      "warmup_steps": settings["warmup_steps"],
                      "flags": flags + (["--load_in_kbits", "4"] if quantized else [])})
    return specs


def memory_specs(settings: dict, model: str, paths: dict) -> list:
    specs = []
    for length in settings["memory_lengths"]:
        common = sft_flags(settings, model, paths, f"memory-{length}", length, 1, 2)
        for chunked in (False, True):
            specs.append({"name": f"{model}/memory-{length}-{'chunked' if chunked else 'full'}", "kind": "sft",
                          "group": "memory", "model": model, "length": length, "chunked": chunked,
                          "warmup_steps": 0, "packing_check": False,
                          "flags": common + ["--attn_implementation", "sdpa", "--activation_checkpointing",
                                             "--chunked_loss", "true" if chunked else "false"]})
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
            "flags": flags}


def rollout_spec(settings: dict, model: str, paths: dict) -> dict:
    return {"name": f"{model}/rollout", "kind": "rollout", "group": "rollout", "model": model,
            "model_dir": paths[f"model:{model}"], "smoke": settings["smoke"], "rows": settings["ppo_prompts"],
            "prompt_len": settings["ppo_prompt_len"], "answer_len": settings["ppo_answer_len"], "timed_calls": 3}


def measurement_specs(settings: dict, paths: dict, attentions: list) -> list:
    specs = []
    for model, (_, _, batch) in settings["models"].items():
        specs += sft_specs(settings, model, batch, paths, attentions)
        if "memory" in settings["measure"]:
            specs += memory_specs(settings, model, paths)
        if "ppo" in settings["measure"]:
            specs += [ppo_spec(settings, model, paths), ppo_spec(settings, model, paths, compiled=True)]
        if "rollout" in settings["measure"]:
            specs.append(rollout_spec(settings, model, paths))
    return specs


def model_config(family: str, shape: dict, settings: dict) -> dict:
    return {"model_type": family, **shape, "max_position_embeddings": settings["max_positions"]}


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
                             "step_s": self.step_s, "bf16": bool(args.bf16)})
        self.done = True


class SFTProbe(RunProbe):
    """Also counts each batch's non-padding tokens and its samples' lengths (the collator is wrapped;
    a FIFO, since the dataloader may collate a batch ahead), and checks packed = alone before training."""

    def __init__(self, spec: dict):
        super().__init__(spec)
        self.pending, self.batches = deque(), []

    def trainer_built(self, trainer) -> None:
        collator = trainer.data_collator
        trainer.data_collator = self.counting(collator)
        super().trainer_built(trainer)
        if self.spec.get("packing_check"):
            rows = [trainer.train_dataset[index] for index in range(min(2, len(trainer.train_dataset)))]
            self.figures["packing_check"] = packing_check(trainer, collator, rows)
            reset_peak_memory()

    def counting(self, collator):
        def collate(features):
            lengths = []
            for feature in features:
                if "position_ids" in feature:
                    lengths += [end - start for start, end in sample_spans(feature["position_ids"])]
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


def packing_check(trainer, collator, rows: list) -> dict:
    """Each sample's loss in the packed rows (one batch, through the run's collator: position_ids, and the
    varlen bounds under a flash attention) against the sample run alone; the control runs each row as one
    causal sequence, its samples attending to each other, to show what a broken separation would give."""
    import torch

    model, device = trainer.model, trainer.args.device

    def logits_of(batch):
        inputs = {name: value.to(device) for name, value in batch.items() if name != "labels"}
        with torch.no_grad(), trainer.accelerator.autocast():
            return model(**inputs).logits

    model.eval()
    packed_logits = logits_of(collator([{k: row[k] for k in ("input_ids", "labels", "position_ids")}
                                        for row in rows]))
    packed, alone, across = [], [], []
    for index, row in enumerate(rows):
        spans, labels = sample_spans(row["position_ids"]), torch.tensor(row["labels"], device=device)
        packed += span_losses(packed_logits[index], labels, spans)
        for start, end in spans:
            sample = {"input_ids": row["input_ids"][start:end], "labels": row["labels"][start:end]}
            alone += span_losses(logits_of(collator([sample]))[0], labels[start:end], [(0, end - start)])
        across += span_losses(logits_of(collator([{"input_ids": row["input_ids"], "labels": row["labels"]}]))[0],
                              labels, spans)
    model.train()
    tolerance = 2e-2 if trainer.args.bf16 else 1e-4
    packed_diff = max(abs(a - b) for a, b in zip(packed, alone, strict=True))
    return {"samples": len(alone), "mean_loss": statistics.mean(alone), "packed_max_abs_diff": packed_diff,
            "cross_attending_max_abs_diff": max(abs(a - b) for a, b in zip(across, alone, strict=True)),
            "tolerance": tolerance, "equal": packed_diff <= tolerance}


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


def run_script(spec: dict, run_dir: Path) -> dict:
    """spec's stage script, unmodified, as its own __main__ would run it; the probe's figures."""
    probe = (SFTProbe if spec["kind"] == "sft" else PPOProbe)(spec)
    if not ACTIVE_PROBE:
        after_trainer_init(lambda trainer: ACTIVE_PROBE[-1].trainer_built(trainer))
    ACTIVE_PROBE[:] = [probe]
    script = SFT_SCRIPT if spec["kind"] == "sft" else PPO_SCRIPT
    sys.argv = [str(script), *spec["flags"], "--data_cache_dir", str(run_dir / "data_cache"),
                "--output_dir", str(run_dir / "out")]
    timers = synchronised_ppo_timers() if spec["kind"] == "ppo" else nullcontext()
    with timers:
        runpy.run_path(str(script), run_name="__main__")
    if not probe.done:
        raise RuntimeError("training did not run to its end")
    return probe.figures


def run_specs(specs: list, workdir: Path) -> dict:
    """Each spec in turn in this process; a failure (out of memory, a refusal) is recorded, not raised."""
    import torch

    results = {}
    for number, spec in enumerate(specs):
        run_dir = workdir / f"run{number}"
        run_dir.mkdir(parents=True)
        try:
            measure = {"prepare": prepare_inputs, "rollout": measure_rollout}.get(spec["kind"])
            results[spec["name"]] = measure(spec) if measure else run_script(spec, run_dir)
        except (Exception, SystemExit) as err:  # noqa: BLE001 - every failure is reported with the run
            results[spec["name"]] = {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:500]}"}
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        error = results[spec["name"]].get("error")
        print(f"  {spec['name']}: {'FAILED ' + error if error else 'done'}", flush=True)
    return results


def prepare_inputs(spec: dict) -> dict:
    """The models (random seeded weights, bf16 on a GPU) and, for PPO, their reward adapters."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    on_gpu = torch.cuda.is_available() and not spec["smoke"]
    for model, config_fields in spec["models"].items():
        fields = dict(config_fields)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields, pad_token_id=tokenizer.pad_token_id,
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        torch.manual_seed(SEED)
        with torch.device("cuda" if on_gpu else "cpu"):
            network = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if on_gpu else torch.float32)
        network.save_pretrained(spec["model_dirs"][model])
        tokenizer.save_pretrained(spec["model_dirs"][model])
        del network
        if spec["reward_dirs"]:
            from bench_ppo import write_reward_adapter

            write_reward_adapter(spec["model_dirs"][model], Path(spec["reward_dirs"][model]))
    return {"device": torch.cuda.get_device_name() if on_gpu else f"CPU ({os.cpu_count()} cores)",
            "attentions": ["sdpa"] + (["flash_attention_2"] if on_gpu and flash_attention_2_available() else [])}


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


def measure_rollout(spec: dict) -> dict:
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


def flash_attention_2_available() -> bool:
    from transformers.utils import is_flash_attn_2_available

    return is_flash_attn_2_available()


def run_child(args) -> None:
    specs = json.loads(Path(args.specs).read_text(encoding="utf-8"))
    write_json(args.metrics, run_specs(specs, Path(args.workdir)))


# ----------------------------------------------------------------------------- driver


def spawn(specs: list, work: Path, label: str) -> dict:
    """specs in one child process of this script; on a crash of the child every spec gets its error."""
    specs_path = work / f"{label}.json"
    write_json(specs_path, specs)
    try:
        results, usage, _, _ = run_child_benchmark(sys.executable, str(Path(__file__).resolve()), "run",
                                                   work / label, ["--specs", specs_path])
    except SystemExit as err:
        return {spec["name"]: {"error": str(err)[-2000:]} for spec in specs}
    for result in results.values():
        result["child_peak_rss_mb"] = usage.peak_rss_mb
    return results


def execute(settings: dict, work: Path, paths: dict) -> tuple:
    """(the prepare step's result: device and attentions, {measurement: spec and figures}): one child per
    measurement on a GPU, each with its own clean memory; in the smoke run one child for everything (an
    import of the stack costs more there than a tiny run)."""
    models = settings["models"]
    for model in models:
        paths[f"model:{model}"] = str(work / "models" / model)
        paths[f"reward:{model}"] = str(work / "models" / f"{model}-reward")
    prepare = {"name": "prepare", "kind": "prepare", "smoke": settings["smoke"], "tokenizer": paths["tokenizer"],
               "models": {m: model_config(family, shape, settings) for m, (family, shape, _) in models.items()},
               "model_dirs": {m: paths[f"model:{m}"] for m in models},
               "reward_dirs": {m: paths[f"reward:{m}"] for m in models} if "ppo" in settings["measure"] else {}}
    if settings["smoke"]:
        specs = measurement_specs(settings, paths, ["sdpa"])
        results = spawn([prepare, *specs], work, "smoke")
        prepared = results.pop("prepare")
    else:
        prepared = spawn([prepare], work, "prepare")["prepare"]
        if "error" in prepared:
            return prepared, {}
        specs = measurement_specs(settings, paths, prepared["attentions"])
        results = {}
        for number, spec in enumerate(specs):
            results.update(spawn([spec], work, f"child{number}"))
    return prepared, {spec["name"]: {**spec, **results[spec["name"]]} for spec in specs}


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


def group_lines(results: dict, group: str, name_width: int, row) -> list:
    """One table line per run of the group: row(name, result), or the run's error."""
    lines = []
    for name, r in results.items():
        if r["group"] == group:
            lines.append(f"{name:<{name_width}} FAILED: {r['error'][:80]}" if "error" in r else row(name, r))
    return lines


def sft_row(name: str, r: dict) -> str:
    check = r.get("packing_check")
    equal = (f"{'yes' if check['equal'] else 'NO'} ({check['packed_max_abs_diff']:.1e}; "
             f"control {check['cross_attending_max_abs_diff']:.1e})") if check else "-"
    mfu = f"{100 * r['mfu']:.1f}" if r["mfu"] is not None else "-"
    return (f"{name:<34} {r['batch']:>5} {r['tokens_per_s']:>10.0f} {r['padding_pct']:>8.1f} "
            f"{r['median_step_s']:>7.3f} {r['model_tflops_per_s']:>8.1f} {mfu:>6} "
            f"{gb(r['peak_memory_mb']):>8}  {equal}")


def memory_row(name: str, r: dict) -> str:
    return (f"{name:<34} {r['length']:>7} {'chunked' if r['chunked'] else 'full':>9} "
            f"{gb(r['peak_memory_mb']):>8} {gb(r['memory_at_trainer_mb']):>10} {gb(r['growth_mb']):>9}")


def ppo_row(name: str, r: dict) -> str:
    return (f"{name:<24} {r['iteration_s']:>11.2f} {r['generation_s']:>12.2f} {r['scoring_s']:>9.2f} "
            f"{r['training_s']:>10.2f} {r['response_length']:>10.1f} {gb(r['peak_memory_mb']):>8}")


def rollout_lines(results: dict) -> list:
    """One table line per engine of each rollout measurement (or the measurement's error)."""
    lines = []
    for name, r in results.items():
        if r["group"] != "rollout":
            continue
        if "error" in r:
            lines.append(f"{name:<20} FAILED: {r['error'][:80]}")
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


def judge(results: dict, settings: dict, device: str) -> tuple:
    """(the memory ratios, the verdicts of both targets) over the runs that finished."""
    finished = {name: r for name, r in results.items() if "error" not in r}
    ratios = Ratios(finished)
    longest = max(settings["memory_lengths"])
    for model in settings["models"]:
        for length in settings["memory_lengths"]:
            ratios.add(f"{model} {length} tokens: chunked/full peak memory", f"{model}/memory-{length}-chunked",
                       f"{model}/memory-{length}-full", "peak_memory_mb",
                       target=MEMORY_TARGET if length == longest else None)
            ratios.add(f"{model} {length} tokens: chunked/full growth", f"{model}/memory-{length}-chunked",
                       f"{model}/memory-{length}-full", "growth_mb")
    verdicts = [{"target": f"{name}: peak memory ratio <= {target}", "value": value, "meets": ok}
                for name, value, target, ok, _ in ratios.verdicts]
    for model in settings["models"]:
        mfus = [r["mfu"] for r in finished.values()
                if r["model"] == model and r["group"] == "throughput" and not r["qlora"] and r["mfu"] is not None]
        if model.endswith("-7b") and mfus and "H100" in device and settings["seq_len"] == 2048:
            verdicts.append({"target": f"{model}: best LoRA SFT MFU >= {MFU_TARGET:.0%} (H100, seq 2048)",
                             "value": max(mfus), "meets": max(mfus) >= MFU_TARGET})
    return ratios, verdicts + rollout_verdicts(finished, device)


def print_report(results: dict, settings: dict, prepared: dict, peak_flops, ratios: Ratios, verdicts: list) -> None:
    print(f"\nDevice: {prepared.get('device', '?')}; peak bf16 dense: "
          f"{f'{peak_flops / 1e12:.0f} TFLOP/s' if peak_flops else 'unknown (MFU not reported)'}")
    print(f"\nLoRA SFT, seq {settings['seq_len']}, {settings['steps'] - settings['warmup_steps']} measured steps "
          f"(after {settings['warmup_steps']} warm-up)")
    print_table(f"{'run':<34} {'batch':>5} {'tokens/s':>10} {'padding%':>8} {'step s':>7} {'TFLOP/s':>8} "
                f"{'MFU%':>6} {'peak GB':>8}  packed loss = alone (max |diff|; cross-attending control)",
                group_lines(results, "throughput", 34, sft_row))
    print("\nPeak memory, one row, batch 1, activation checkpointing (loaded: the model as loaded; growth: the "
          "peak over it)")
    print_table(f"{'run':<34} {'tokens':>7} {'loss':>9} {'peak GB':>8} {'loaded GB':>10} {'growth GB':>9}",
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
    ratios.print(56)
    for verdict in verdicts:
        if "MFU" in verdict["target"]:
            print(f"{verdict['target']}: {100 * verdict['value']:.1f}% ({'meets' if verdict['meets'] else 'MISSES'})")
        elif "memory ratio" not in verdict["target"]:
            print(f"{verdict['target']}: {verdict['value']:.2f} ({'meets' if verdict['meets'] else 'MISSES'})")
    if settings["smoke"]:
        print("\n(--cpu_smoke: tiny shapes on the CPU, every run in one process: the figures only show that each "
              "code path runs; memory is the process's peak RSS so far)")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    settings = settings_of(args)
    import torch

    if not settings["smoke"] and not torch.cuda.is_available():
        bad_flag("no CUDA device here; run it on a GPU machine (make gpu-check), or add --cpu_smoke to check its "
                 "code paths on tiny shapes on the CPU")
    os.chdir(REPO)
    quiet_offline_env()
    print(f"GPU benchmark{' (CPU smoke run)' if settings['smoke'] else ''}: {', '.join(settings['models'])}; "
          f"measuring {', '.join(settings['measure'])}", flush=True)
    with scratch_dir("bench_gpu-", keep=args.keep) as work:
        os.environ["HF_DATASETS_CACHE"] = str(work / "hf_datasets")
        prepared, results = execute(settings, work, write_data(work, settings))
    peak_flops = peak_bf16_flops(prepared.get("device", "")) if not settings["smoke"] else None
    for result in results.values():
        if "error" not in result and result["group"] == "throughput":
            summarise_sft(result, settings["models"][result["model"]][1], peak_flops)
        elif "error" not in result and result["group"] == "ppo":
            summarise_ppo(result)
    ratios, verdicts = judge(results, settings, prepared.get("device", ""))
    print_report(results, settings, prepared, peak_flops, ratios, verdicts)
    output = args.output or ("outputs/bench/gpu_cpu_smoke.json" if settings["smoke"] else "outputs/bench/gpu.json")
    report = {"benchmark": "gpu", "device": prepared.get("device"), "prepare": prepared,
              "peak_bf16_flops": peak_flops,
              "mfu_formula": "(4 N + 6 N_lora) t + 12 L d t^2 model FLOPs per sample of t tokens",
              "settings": {**settings, "models": {name: {"family": family, "config": shape, "batch": batch}
                                                  for name, (family, shape, batch) in settings["models"].items()}},
              "environment": environment("torch", "transformers", "peft"), "results": results,
              "ratios": ratios.values, "verdicts": verdicts}
    write_json(output, report)
    print(f"\nwrote {output}")
    return report


if __name__ == "__main__":
    main()
