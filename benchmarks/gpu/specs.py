"""Run specs: what one measured run is (its kind, its model, our script's flags or TRL's options, its needs) and the
time it may take. A spec is a JSON-able dict: the parent writes the specs a child runs into a file, the child reads
them back, and the report keeps each spec beside its result."""

from __future__ import annotations

from typing import NamedTuple

from .shapes import LARGE, LEARNING_RATE, LORA, SEED, model_config


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
# (seconds a run needs left to start, seconds it may run at most) by kind, at a large shape (shapes.LARGE) on an H100
# or H200 (at a smaller shape the minimum is halved): estimates from the runs so far, imports and model loading
# included.
TIME_LIMITS = {"prepare": (40, 240), "sft": (50, 240), "trl": (50, 240), "ppo": (60, 300), "grpo": (60, 300),
               "rollout": (60, 300)}
SMOKE_TIME_LIMITS = (1, 300)
# (label, --rollout_engine, --enable_hybrid_engine) of each engine the rollout measurement times, in this order.
ROLLOUT_ENGINES = (("eager, adapter unmerged", "eager", False), ("eager, adapter merged", "eager", True),
                   ("compiled, adapter merged", "compiled", True))
# PPO's and GRPO's sampling and bookkeeping, the same in every RL run: plain sampling (nothing cut from the
# distribution), sdpa, no checkpoints or trackers, a log line every iteration (the phase timers ride on it).
RL_COMMON = {"template": "human_assistant", "temperature": 1.0, "top_k": 0, "top_p": 1.0, "attn_implementation": "sdpa",
             "report_to": "none", "save_strategy": "no", "logging_steps": 1, "seed": SEED}
# The merged adapter and the compiled decode (static KV cache, torch.compile): the engine the RL plan measures.
COMPILED_ENGINE = {"enable_hybrid_engine": "true", "rollout_engine": "compiled"}


def time_limits(kind: str, model: str, settings: dict) -> dict:
    """The run's min_s (what it needs left to start) and max_s (its time limit, unless less is left)."""
    if settings["smoke"]:
        least, most = SMOKE_TIME_LIMITS
    else:
        least, most = TIME_LIMITS[kind]
        least = least if model in LARGE else least / 2
    return {"min_s": least, "max_s": most}


def run_name(model: str, side: str, attention: str, packed: bool, options: tuple = ()) -> str:
    """e.g. llama-7b/sft-sdpa-packed+liger+compile (ours), llama-7b/trl-sdpa-unpacked+liger (TRL's)."""
    return f"{model}/{side}-{attention}-{'packed' if packed else 'unpacked'}" + "".join(f"+{o}" for o in options)


def as_flags(options: dict) -> list:
    """{name: value} as a script's command line: --name value ..."""
    return [part for name, value in options.items() for part in (f"--{name}", str(value))]


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


# (--chunked_loss, extra flags) of each memory case: transformers' loss over the full logits, the chunked loss, and
# the chunked loss without LoRA's dropout (what the dropout's copies of each adapted layer's input cost:
# estimate_memory's rule).
MEMORY_CASES = {"full": (False, ()), "chunked": (True, ()), "chunked-dropout0": (True, ("--lora_dropout", "0"))}


def memory_specs(settings: dict, model: str, paths: dict, labels: tuple = tuple(MEMORY_CASES)) -> list:
    """Each length of --memory_lengths in each of the cases labelled (MEMORY_CASES), the dropout-free case at the
    longest length only."""
    longest = max(settings["memory_lengths"])
    return [memory_spec(settings, model, paths, length, label) for length in settings["memory_lengths"]
            for label in labels if label != "chunked-dropout0" or length == longest]


def memory_spec(settings: dict, model: str, paths: dict, length: int, label: str) -> dict:
    """One row of length tokens, batch 1, --activation_checkpointing as a long-sequence run is set up."""
    chunked, extra = MEMORY_CASES[label]
    flags = sft_flags(settings, model, paths, f"memory-{length}", length, 1, 2)
    flags += ["--attn_implementation", "sdpa", "--activation_checkpointing", "--chunked_loss",
              "true" if chunked else "false", *extra]
    return {"name": f"{model}/memory-{length}-{label}", "kind": "sft", "group": "memory", "side": "ours",
            "model": model, "length": length, "chunked": chunked, "dropout": 0.0 if extra else LORA["dropout"],
            "warmup_steps": 0, "check_packing": False, "requires": [], "on_cpu": settings["smoke"], "flags": flags,
            **time_limits("sft", model, settings)}


def ppo_spec(settings: dict, model: str, paths: dict, compiled: bool = False, quantized: bool = False) -> dict:
    """run_ppo.py's flags for one PPO run on a shared base: its default eager decode, or (compiled) the merged adapter
    and the compiled decode; quantized: QLoRA (a 4-bit base, which decodes eager)."""
    model_dir = paths[f"model:{model}"]
    options = {"actor_model_name_or_path": model_dir, "reward_model_name_or_path": model_dir,
               "reward_lora_model": paths[f"reward:{model}"], "data_path": paths["prompts"], "shared_base": "true",
               "max_prompt_seq_len": settings["ppo_prompt_len"], "max_answer_seq_len": settings["ppo_answer_len"],
               "per_device_generation_batch_size": settings["ppo_prompts"],
               "per_device_training_batch_size": settings["ppo_prompts"], "max_steps": settings["ppo_iterations"],
               **RL_COMMON, **(COMPILED_ENGINE if compiled else {}), **({"load_in_kbits": 4} if quantized else {})}
    suffix = "-compiled" if compiled else "-qlora" if quantized else ""
    return {"name": f"{model}/ppo{suffix}", "kind": "ppo", "group": "rl", "model": model,
            "requires": ["bitsandbytes", "cuda"] if quantized else [], "on_cpu": settings["smoke"],
            "flags": list(settings["precision"]) + as_flags(options), **time_limits("ppo", model, settings)}


def grpo_spec(settings: dict, model: str, paths: dict) -> dict:
    """run_grpo.py's flags for one GRPO run with the compiled engine: --ppo_prompts prompts x --grpo_generations
    answers of up to --ppo_answer_len new tokens per step, sampled in one pass and trained in micro-batches of
    --ppo_prompts answers; the benchmark's reward function (bench_grpo.py's), beta 0 (no reference pass)."""
    prompts, group = settings["ppo_prompts"], settings["grpo_generations"]
    options = {"model_name_or_path": paths[f"model:{model}"], "data_path": paths["prompts"],
               "reward_funcs": f"{paths['reward_function']}:reward", "num_generations": group,
               "max_prompt_seq_len": settings["ppo_prompt_len"], "max_completion_length": settings["ppo_answer_len"],
               "per_device_train_batch_size": prompts, "gradient_accumulation_steps": group,
               "per_device_generation_batch_size": prompts * group, "beta": 0.0,
               "max_steps": settings["ppo_iterations"], **RL_COMMON, **COMPILED_ENGINE}
    return {"name": f"{model}/grpo-compiled", "kind": "grpo", "group": "rl", "model": model, "requires": [],
            "on_cpu": settings["smoke"], "flags": list(settings["precision"]) + as_flags(options),
            **time_limits("grpo", model, settings)}


def rollout_spec(settings: dict, model: str, paths: dict) -> dict:
    return {"name": f"{model}/rollout", "kind": "rollout", "group": "rollout", "model": model, "requires": [],
            "model_dir": paths[f"model:{model}"], "smoke": settings["smoke"], "rows": settings["ppo_prompts"],
            "prompt_len": settings["ppo_prompt_len"], "answer_len": settings["ppo_answer_len"], "timed_calls": 3,
            **time_limits("rollout", model, settings)}


def prepare_spec(settings: dict, paths: dict, model: str, reward: bool) -> dict:
    """The model's directory (random seeded weights and the tokenizer) and, where PPO runs at it (reward), its
    reward adapter."""
    family, shape, _ = settings["models"][model]
    return {"name": f"{model}/prepare", "kind": "prepare", "model": model, "smoke": settings["smoke"],
            "tokenizer": paths["tokenizer"], "config": model_config(family, shape, settings["max_positions"]),
            "model_dir": paths[f"model:{model}"], "requires": [],
            "reward_dir": paths[f"reward:{model}"] if reward else None, **time_limits("prepare", model, settings)}
