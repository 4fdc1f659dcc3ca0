"""The figures of each finished run, the ratios and the targets' verdicts over them, and the JSON report.

Throughput figures, over the steps after --warmup_steps: non-padding tokens/s (the measured steps' tokens over their
summed time) and at the median step (their mean tokens per step over the median step time: the steady state, which
a few slow steps of new shapes or recompiles do not move), padding, seconds per step, MFU (flops.py), peak GPU memory.
Ratios ours/TRL (tokens/s, both ways, and peak memory) at each headline model: ours' best packed run (whose packed loss
equals the loss alone) against TRL, and against TRL with Liger. RL runs (PPO, GRPO): seconds per iteration split into
generation, scoring and training (the trainer's own timers, made to synchronise the GPU), and the sampler gap (the KL
and mean |log-prob difference| per answer token between the rollout engine's sampling and the training forward),
medians over the iterations after the first (which pays the compile).

Targets (issues), each printed with its verdict: at the 7B shapes, seq 2048, on an H100 or H200: the best run of
ours at MFU >= 35% (on the way to 45%), its tokens/s >= 2x TRL + Liger's best and its peak memory <= TRL + Liger's;
QLoRA's step time <= 1.3x the bf16 packed run's; at the longest memory row length the chunked loss's peak memory
<= 0.5x and its growth over the loaded model <= 0.3x transformers' own loss path (the dropout-free run beside it shows
what LoRA's dropout costs); at the Llama-7B shape, batch 8 x 256 new tokens: the compiled decode <= 12 ms per new token
and a PPO iteration with it <= 5 s.
"""

from __future__ import annotations

import importlib.metadata
import statistics

from measure import Ratios, environment

from .flops import attention_width, matmul_parameters, peak_bf16_flops, training_flops
from .plan import PLANS, best_ours_packed, passes
from .specs import ROLLOUT_ENGINES, run_name
from .state import RunState

# Issue 33's targets at the 7B shapes, seq 2048, packed, on an H100 or H200: MFU >= 35% (on the way to 45%), tokens/s
# >= 2x TRL + Liger's best, peak memory <= its; QLoRA's step time within 1.3x of the bf16 run's; at 8k tokens the
# chunked loss's peak <= 0.5x transformers' loss path and its growth over the loaded model <= 0.3x.
MFU_TARGET, PEER_SPEED_TARGET, PEER_MEMORY_TARGET, QLORA_TIME_TARGET = 0.35, 2.0, 1.0, 1.3
MEMORY_TARGET, GROWTH_TARGET = 0.5, 0.3
DECODE_MS_TARGET, PPO_ITERATION_S_TARGET = 12.0, 5.0  # Llama-7B shape, 8 x 256, on an H100 or H200
RL_PHASES = ("generation", "scoring", "training")
SAMPLER_GAP = ("sampler_gap/kl", "sampler_gap/logprob_abs")


# ----------------------------------------------------------------------------- each run's figures


def summarise_sft(result: dict, config: dict, peak_flops: float | None) -> None:
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


def later_median(values: list) -> float | None:
    """The median after the first value (all of them when there is one); None when there are none."""
    values = values[1:] or values
    return statistics.median(values) if values else None


def summarise_rl(result: dict) -> None:
    """Medians over the iterations after the first: the iteration, its phases, the answer length, the sampler gap."""
    timed = [log for log in result["logs"] if "time_generation" in log]
    result.update({"iteration_s": later_median(result["step_s"]),
                   **{f"{phase}_s": later_median([log[f"time_{phase}"] for log in timed]) for phase in RL_PHASES},
                   "response_length": later_median([log.get("response_length", 0.0) for log in timed]),
                   **{key.replace("/", "_"): later_median([log[key] for log in result["logs"] if key in log])
                      for key in SAMPLER_GAP}})


# ----------------------------------------------------------------------------- ratios and verdicts


def packed_equal(result: dict) -> bool:
    """Packed loss = loss alone (the control aside): what the ours/TRL ratios take as ours' packed run."""
    return isinstance(result.get("packing_check"), dict) and result["packing_check"]["equal"]


def trl_run(finished: dict, model: str, liger: bool) -> dict | None:
    return next((r for r in finished.values() if r["group"] == "throughput" and r["side"] == "trl"
                 and r["model"] == model and ("liger" in r["options"]) == liger), None)


def peer_ratios(ratios: Ratios, finished: dict, models: list) -> list:
    """ours' best packed run against TRL and TRL+Liger at each headline model (tokens/s, peak memory); notes
    where the two sides did not train the same number of LoRA weights."""
    notes = []
    for model in models:
        ours = best_ours_packed(finished, model, packed_equal)
        for label, liger in (("TRL", False), ("TRL+Liger", True)):
            peer = trl_run(finished, model, liger)
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


def memory_ratios(ratios: Ratios, settings: dict) -> None:
    """The chunked loss against transformers' at each memory row length (judged at the longest), and QLoRA's step
    time against bf16's."""
    longest = max(settings["memory_lengths"])
    for model in settings["models"]:
        for length in settings["memory_lengths"]:
            judged = length == longest
            ratios.add(f"{model} {length} tokens: chunked/full peak memory", f"{model}/memory-{length}-chunked",
                       f"{model}/memory-{length}-full", "peak_memory_mb", target=MEMORY_TARGET if judged else None)
            ratios.add(f"{model} {length} tokens: chunked/full growth", f"{model}/memory-{length}-chunked",
                       f"{model}/memory-{length}-full", "growth_mb", target=GROWTH_TARGET if judged else None)
        ratios.add(f"{model} {longest} tokens: chunked, dropout 0/full growth",
                   f"{model}/memory-{longest}-chunked-dropout0", f"{model}/memory-{longest}-full", "growth_mb")
        ratios.add(f"{model}: QLoRA/bf16 step time", run_name(model, "qlora", "sdpa", True),
                   run_name(model, "sft", "sdpa", True), "median_step_s", target=QLORA_TIME_TARGET)


def on_h100_class(device: str) -> bool:
    """The targets are set for an H100 or H200; elsewhere they are not judged."""
    return "H100" in device or "H200" in device


def mfu_verdicts(finished: dict, settings: dict, device: str) -> list:
    verdicts = []
    for model in settings["models"]:
        mfus = [r["mfu"] for r in finished.values() if r["model"] == model and r["group"] == "throughput"
                and r["side"] == "ours" and not r["qlora"] and r["mfu"] is not None]
        if model.endswith("-7b") and mfus and on_h100_class(device) and settings["seq_len"] == 2048:
            verdicts.append({"target": f"{model}: best LoRA SFT MFU >= {MFU_TARGET:.0%} (H100/H200, seq 2048)",
                             "value": max(mfus), "meets": max(mfus) >= MFU_TARGET})
    return verdicts


def rollout_verdicts(finished: dict, device: str) -> list:
    """The decode and PPO-iteration targets, judged at the Llama-7B shape on an H100 or H200 only."""
    if not on_h100_class(device):
        return []
    verdicts = []
    rollout = finished.get("llama-7b/rollout")
    if rollout:
        value = rollout["engines"][ROLLOUT_ENGINES[-1][0]]["ms_per_token"]
        verdicts.append({"target": f"llama-7b: compiled decode <= {DECODE_MS_TARGET} ms per new token (batch 8)",
                         "value": value, "meets": value <= DECODE_MS_TARGET})
    ppo = finished.get("llama-7b/ppo-compiled")
    if ppo and ppo["iteration_s"] is not None:
        value = ppo["iteration_s"]
        verdicts.append({"target": f"llama-7b: PPO iteration (8 x 256, compiled decode) <= {PPO_ITERATION_S_TARGET} s",
                         "value": value, "meets": value <= PPO_ITERATION_S_TARGET})
    return verdicts


def judge(state: RunState) -> tuple[Ratios, list, list]:
    """(the ratios, the verdicts, notes) over the runs that finished."""
    finished = {name: r for name, r in state.results.items() if r["status"] == "done"}
    ratios = Ratios(finished)
    notes = peer_ratios(ratios, finished, state.settings["headline"])
    memory_ratios(ratios, state.settings)
    # The ratios' verdicts (Ratios.print shows them) beside the others, which tables.print_report shows.
    verdicts = [{"target": f"{name} {'<=' if at_most else '>='} {target}", "value": value, "meets": ok, "ratio": True}
                for name, value, target, ok, at_most in ratios.verdicts]
    verdicts += mfu_verdicts(finished, state.settings, state.device) + rollout_verdicts(finished, state.device)
    return ratios, verdicts, notes


# ----------------------------------------------------------------------------- the JSON report


def installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def plan_record(settings: dict) -> dict:
    """The plan as run: its name, what it measures, its budget and the steps --measure kept."""
    plan = PLANS[settings["plan"]]
    return {"name": plan.name, "measures": plan.measures, "budget_s": plan.budget_s,
            "steps": [step.specs.__name__ for step in plan.steps if step.measurement in settings["measure"]]}


def build_report(state: RunState, complete: bool) -> dict:
    settings = state.settings
    ratios, verdicts, notes = judge(state)
    failing = {name: r["packing_check"]["verdict"] for name, r in state.results.items()
               if isinstance(r.get("packing_check"), dict) and not passes(r)}
    return {"benchmark": "gpu", "complete": complete, "device": state.device,
            "peak_bf16_flops": peak_bf16_flops(state.device),
            "mfu_formula": "(4 N + 6 N_lora) t + 12 L d t^2 model FLOPs per sample of t tokens",
            "time_budget_s": settings["time_budget_s"], "elapsed_s": settings["time_budget_s"] - state.left_s(),
            "settings": {**settings, "models": {name: {"family": family, "config": shape, "batch": batch}
                                                for name, (family, shape, batch) in settings["models"].items()}},
            "environment": {**environment("torch", "transformers", "peft"),
                            **{name: installed_version(name) for name in ("trl", "liger_kernel", "flash_attn")}},
            "flash_attention_2": state.flash_attention, "plan": plan_record(settings),
            "prepared": state.prepared, "results": state.results, "winners": state.winners,
            "packing_checks_failing": failing,
            "without_figures": {name: f"{r['status']}: {r.get('message', '')}" for name, r in state.results.items()
                                if r["status"] != "done"},
            "ratios": ratios.values, "verdicts": verdicts, "notes": notes}
