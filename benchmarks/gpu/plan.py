"""The plans: which measurements a call of the benchmark runs, in priority order, within its time budget.

Each plan names the model roles it builds (shapes.ROLE_MODELS: 7b, 1b, moe) and its steps; a step belongs to one
--measure choice and builds its runs (specs) from the run's state. A step built from the figures of the runs before it
(reads_results) waits for them. rl, sft and moe are each sized for one 8-minute call on one GPU: their budget, 480 s,
stops a run that overruns and skips what no longer fits (budget.py). full is the earlier single plan, every
measurement at the 7B and 1B shapes, which does not fit one call (its budget cuts the rest, in priority order).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from .specs import (
    OPTIONS,
    VARIANT_ATTENTIONS,
    grpo_spec,
    memory_specs,
    ours_sft_spec,
    ppo_spec,
    rollout_spec,
    run_name,
    trl_spec,
)
from .state import RunState


class Step(NamedTuple):
    measurement: str  # the --measure choice it belongs to
    reads_results: bool  # built from the figures of the runs before it: those finish first
    specs: Callable[[RunState], list]


class Plan(NamedTuple):
    name: str
    measures: str  # what it measures, in one line (--help, the report)
    roles: tuple  # the model roles it builds by default (shapes.ROLE_MODELS)
    steps: tuple  # its Steps, in priority order: what matters most first, so a budget cut loses the least
    budget_s: float = 480.0  # one call of at most 8 minutes (the lent machine's, its start-up aside)
    gpu_defaults: dict = {}  # settings it changes from settings.DEFAULTS on a GPU (the smoke run keeps its own)


# ----------------------------------------------------------------------------- results the steps read


def passes(result: dict | None) -> bool:
    """A packed run of ours that finished and whose packing check passed (its control included)."""
    return bool(result and result["status"] == "done" and isinstance(result.get("packing_check"), dict)
                and result["packing_check"]["passes"])


def best_ours_packed(results: dict, model: str, keep: Callable[[dict], bool] = passes) -> dict | None:
    """The fastest packed (not QLoRA) run of ours at model that keep accepts, or None."""
    runs = [r for r in results.values() if r["group"] == "throughput" and r["side"] == "ours" and r["model"] == model
            and r["packed"] and not r["qlora"] and keep(r)]
    return max(runs, key=lambda r: r["tokens_per_s"], default=None)


# ----------------------------------------------------------------------------- SFT steps


def baseline_step(state: RunState) -> list:
    return [ours_sft_spec(state.settings, state.paths, model) for model in state.settings["headline"]]


def peers_step(state: RunState) -> list:
    return [trl_spec(state.settings, state.paths, model, liger, state.flash_attention)
            for model in state.settings["headline"] for liger in (True, False)]


def variants_step(state: RunState) -> list:
    settings, paths = state.settings, state.paths
    attentions = [name for name in VARIANT_ATTENTIONS if name != "flash_attention_2" or state.flash_attention]
    specs = []
    for model in settings["explored"]:
        specs.append(ours_sft_spec(settings, paths, model))
        specs += [ours_sft_spec(settings, paths, model, options=(option,)) for option in OPTIONS]
        specs += [ours_sft_spec(settings, paths, model, attention=attention) for attention in attentions]
        specs.append(ours_sft_spec(settings, paths, model, packed=False))
    return specs


def combination_step(state: RunState) -> list:
    """At each explored shape, every change that beat its plain packed run, together (the fastest such attention,
    each such option), where that makes two or more. In the smoke run, whose timings mean nothing, every change
    that ran counts, so that the combination runs there too."""
    specs = []
    for model in state.settings["explored"]:
        plain = state.results.get(run_name(model, "sft", "sdpa", True))
        if not passes(plain):
            continue
        better = [r for r in state.results.values() if r["group"] == "throughput" and r["side"] == "ours"
                  and r["model"] == model and passes(r) and r is not plain
                  and (r["tokens_per_s"] > plain["tokens_per_s"] or state.settings["smoke"])]
        options = tuple(option for option in OPTIONS if any(option in r["options"] for r in better))
        attentions = [r for r in better if r["attention"] != "sdpa"]
        attention = max(attentions, key=lambda r: r["tokens_per_s"])["attention"] if attentions else "sdpa"
        if len(options) + (attention != "sdpa") >= 2:
            specs.append(ours_sft_spec(state.settings, state.paths, model, attention, True, options))
    return specs


def winners_step(state: RunState) -> list:
    """Each explored shape's best packed run (its check passed) re-run at its family's 7B shape, unless the best
    is the plain packed run, which ran there first."""
    specs = []
    for model, target in state.settings["explored"].items():
        best = best_ours_packed(state.results, model)
        if best is None:
            state.winners[model] = {"best": None, "re_run": None, "why": "no packed run passed its check"}
            continue
        plain = best["attention"] == "sdpa" and not best["options"]
        spec = ours_sft_spec(state.settings, state.paths, target, best["attention"], True,
                             tuple(best["options"])) if target and not plain else None
        state.winners[model] = {"best": best["name"], "tokens_per_s": best["tokens_per_s"],
                                "re_run": spec["name"] if spec else None,
                                "why": None if spec else ("the plain packed run is the best" if plain
                                                          else "its 7B shape is not among --models")}
        specs += [spec] if spec else []
    return specs


def qlora_step(state: RunState) -> list:
    return [ours_sft_spec(state.settings, state.paths, model, quantized=True) for model in state.settings["headline"]]


def memory_step(state: RunState) -> list:
    return [spec for model in state.settings["models"] for spec in memory_specs(state.settings, model, state.paths)]


# The 1B shape's winners so far (torch_varlen 1.43x sdpa at the median step, Liger 1.27x, dropout 0 1.12x), together:
# the run the sft plan puts against TRL + Liger at the 7B shape.
KNOWN_BEST = ("torch_varlen", ("liger", "dropout0"))


def known_best_step(state: RunState) -> list:
    attention, options = KNOWN_BEST
    return [ours_sft_spec(state.settings, state.paths, model, attention, True, options)
            for model in state.settings["headline"]]


def known_best_compiled_step(state: RunState) -> list:
    attention, options = KNOWN_BEST
    return [ours_sft_spec(state.settings, state.paths, model, attention, True, (*options, "compile"))
            for model in state.settings["headline"]]


def liger_peer_step(state: RunState) -> list:
    return [trl_spec(state.settings, state.paths, model, True, state.flash_attention)
            for model in state.settings["headline"]]


def long_memory_step(state: RunState) -> list:
    """Peak memory of the chunked loss (the toolkit's default) at each --memory_lengths row length."""
    return [spec for model in state.settings["headline"]
            for spec in memory_specs(state.settings, model, state.paths, ("chunked",))]


def moe_sft_step(state: RunState) -> list:
    return [ours_sft_spec(state.settings, state.paths, model) for model in state.settings["moe"]]


# ----------------------------------------------------------------------------- RL steps


def ppo_step(state: RunState) -> list:
    return [ppo_spec(state.settings, model, state.paths, compiled) for model in state.settings["models"]
            for compiled in (False, True)]


def compiled_ppo_step(state: RunState) -> list:
    return [ppo_spec(state.settings, model, state.paths, compiled=True) for model in state.settings["models"]]


def grpo_step(state: RunState) -> list:
    return [grpo_spec(state.settings, model, state.paths) for model in state.settings["models"]]


def rollout_step(state: RunState) -> list:
    return [rollout_spec(state.settings, model, state.paths) for model in state.settings["models"]]


def qlora_ppo_step(state: RunState) -> list:
    """PPO on a 4-bit base at each dense headline shape (a mixture of experts' fused experts stay 16-bit under QLoRA:
    docs/moe.md)."""
    return [ppo_spec(state.settings, model, state.paths, quantized=True) for model in state.settings["headline"]
            if model not in state.settings["moe"]]


PLANS = {
    "rl": Plan("rl", "the rollout engines' ms per new token (eager unmerged, merged, compiled), one PPO iteration and "
                     "one GRPO step (8 prompts x 8 answers x 256 tokens) with the compiled engine, their sampler gap",
               ("7b",), (Step("rollout", False, rollout_step), Step("ppo", False, compiled_ppo_step),
                         Step("grpo", False, grpo_step))),
    "sft": Plan("sft", "SFT at the 7B shape with torch_varlen, Liger and --lora_dropout 0 (then + --torch_compile) "
                       "against TRL + Liger in the same call; peak memory at 8k and 16k tokens; the plain packed run",
                ("7b",), (Step("sft", False, known_best_step), Step("peers", False, liger_peer_step),
                          Step("memory", False, long_memory_step), Step("variants", False, known_best_compiled_step),
                          Step("sft", False, baseline_step)),
                gpu_defaults={"memory_lengths": [8192, 16384]}),
    "moe": Plan("moe", "LoRA SFT at a Qwen3-MoE shape (the experts' LoRA included); QLoRA PPO at the 7B shape",
                ("moe", "7b"), (Step("sft", False, moe_sft_step), Step("qlora", False, qlora_ppo_step))),
    "full": Plan("full", "the earlier single plan: every measurement at the 7B and 1B shapes (more than one call)",
                 ("7b", "1b"),
                 (Step("sft", False, baseline_step), Step("peers", False, peers_step),
                  Step("variants", False, variants_step), Step("variants", True, combination_step),
                  Step("variants", True, winners_step), Step("qlora", False, qlora_step),
                  Step("memory", False, memory_step), Step("ppo", False, ppo_step),
                  Step("rollout", False, rollout_step))),
}
DEFAULT_PLAN = "rl"  # the first one the GPU plans ask for, and the one never measured
# Every --measure choice: the full plan's, in its order (the choices before plans), then the others'.
MEASUREMENTS = tuple(dict.fromkeys(step.measurement for plan in (PLANS["full"], *PLANS.values())
                                   for step in plan.steps))
