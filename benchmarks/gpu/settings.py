"""The command line and the run's settings: the plan chosen, its measurements, its models and sizes, on a GPU or in
the CPU smoke run; a bad flag is one line and exit status 2."""

from __future__ import annotations

import argparse
import sys
import textwrap

from measure import add_child_arguments

from . import __doc__ as OVERVIEW
from .plan import DEFAULT_PLAN, MEASUREMENTS, PLANS, Plan
from .shapes import EXPLORED_FOR, ROLE_MODELS, SHAPES, SMOKE_EXPLORED_FOR, SMOKE_ROLE_MODELS, SMOKE_SHAPES, is_moe

# The sizes of every plan's runs on a GPU (a plan changes some: Plan.gpu_defaults) and in the smoke run, each
# overridden by its flag.
DEFAULTS = {"seq_len": 2048, "steps": 12, "warmup_steps": 2, "memory_lengths": [4096, 8192], "ppo_prompts": 8,
            "ppo_answer_len": 256, "ppo_iterations": 3, "grpo_generations": 8}
SMOKE_DEFAULTS = {"seq_len": 64, "steps": 3, "warmup_steps": 1, "memory_lengths": [64, 128], "ppo_prompts": 2,
                  "ppo_answer_len": 8, "ppo_iterations": 2, "grpo_generations": 2}


def plan_list() -> str:
    """Each plan with its budget and what it measures, for --help."""
    return "plans (--plan):\n" + "\n".join(textwrap.fill(f"{plan.name:<5} {plan.budget_s:.0f} s: {plan.measures}",
                                                         100, initial_indent="  ", subsequent_indent=" " * 8)
                                           for plan in PLANS.values())


def parse_args(argv: list | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=OVERVIEW.split("\n\n")[0], epilog=plan_list(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", choices=PLANS, default=None,
                        help=f"which measurements to run (default {DEFAULT_PLAN}; with --measure alone, full)")
    parser.add_argument("--measure", nargs="+", default=None, choices=MEASUREMENTS,
                        help="only the plan's steps of these measurements")
    parser.add_argument("--cpu_smoke", action="store_true",
                        help="the plan on tiny shapes on the CPU (checks the code paths; no real figures)")
    parser.add_argument("--models", nargs="+", default=None,
                        help=f"shapes to build and measure (default: the plan's; any of {', '.join(SHAPES)})")
    parser.add_argument("--time_budget_s", type=float, default=None,
                        help="seconds for the whole run (default: the plan's budget): each run gets a time limit from "
                             "what is left, and a run that would start with less than its minimum left is skipped")
    parser.add_argument("--seq_len", type=int, default=None, help="SFT sequence length (default 2048; smoke 64)")
    parser.add_argument("--steps", type=int, default=None, help="SFT optimizer steps per run (default 12; smoke 3)")
    parser.add_argument("--warmup_steps", type=int, default=None,
                        help="first steps left out of the figures (default 2; smoke 1)")
    parser.add_argument("--memory_lengths", type=int, nargs="+", default=None,
                        help="row lengths of the memory runs (default 4096 8192; the sft plan's 8192 16384; smoke "
                             "64 128)")
    parser.add_argument("--ppo_prompts", type=int, default=None, help="prompts per PPO or GRPO iteration (default 8)")
    parser.add_argument("--ppo_answer_len", type=int, default=None, help="new tokens per answer (default 256)")
    parser.add_argument("--ppo_iterations", type=int, default=None,
                        help="PPO iterations and GRPO steps (default 3; smoke 2)")
    parser.add_argument("--grpo_generations", type=int, default=None, help="answers per prompt in GRPO (default 8)")
    parser.add_argument("--output", default=None,
                        help="JSON results (default outputs/bench/gpu-PLAN.json; smoke outputs/bench/"
                             "gpu_cpu_smoke-PLAN.json)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (models, logs, outputs)")
    add_child_arguments(parser, ["run"])  # internal: measurements in this process
    parser.add_argument("--specs", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def bad_flag(message: str) -> None:
    """One line on stderr and exit status 2, as every script of the toolkit refuses bad input."""
    print(f"bench_gpu.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def chosen_plan(args: argparse.Namespace) -> Plan:
    """--plan; without it the default plan, or the full one when --measure names what to run (as before plans)."""
    return PLANS[args.plan or ("full" if args.measure else DEFAULT_PLAN)]


def chosen_measurements(plan: Plan, args: argparse.Namespace) -> list:
    """The plan's measurements that --measure keeps (all without it), in the plan's order."""
    own = list(dict.fromkeys(step.measurement for step in plan.steps))
    chosen = [name for name in own if args.measure is None or name in args.measure]
    if not chosen:
        bad_flag(f"--measure {' '.join(args.measure)}: not in the {plan.name} plan, whose measurements are "
                 f"{', '.join(own)}")
    return chosen


def chosen_models(plan: Plan, args: argparse.Namespace) -> dict:
    """{name: (family, config, batch)} of --models, or of the plan's roles."""
    shapes = SMOKE_SHAPES if args.cpu_smoke else SHAPES
    roles = SMOKE_ROLE_MODELS if args.cpu_smoke else ROLE_MODELS
    models = args.models or [roles[role] for role in plan.roles]
    unknown = [name for name in models if name not in shapes]
    if unknown:
        bad_flag(f"--models: unknown shape(s) {', '.join(unknown)}; choose from {', '.join(shapes)}")
    return {name: shapes[name] for name in models}


def model_roles(models: list, explored_for: dict) -> dict:
    """headline: the 7B shapes chosen (every shape chosen where none is); explored: {each 1B shape chosen: its
    family's 7B shape if chosen, else None}."""
    explored = {model: explored_for[model] if explored_for[model] in models else None
                for model in models if model in explored_for}
    return {"headline": [model for model in models if model not in explored] or list(models), "explored": explored}


def sizes(plan: Plan, args: argparse.Namespace) -> dict:
    """The runs' sizes: the defaults (the plan's on a GPU), each overridden by its flag."""
    defaults = SMOKE_DEFAULTS if args.cpu_smoke else {**DEFAULTS, **plan.gpu_defaults}
    chosen = {name: getattr(args, name) if getattr(args, name) is not None else value
              for name, value in defaults.items()}
    if chosen["warmup_steps"] >= chosen["steps"]:
        bad_flag(f"--warmup_steps {chosen['warmup_steps']} leaves none of --steps {chosen['steps']} measured")
    if chosen["grpo_generations"] < 2:
        bad_flag(f"--grpo_generations {chosen['grpo_generations']}: a group needs at least 2 answers")
    return chosen


def settings_of(args: argparse.Namespace) -> dict:
    """The run's settings (JSON-able: the report keeps them)."""
    smoke, plan = args.cpu_smoke, chosen_plan(args)
    budget_s = plan.budget_s if args.time_budget_s is None else args.time_budget_s
    if budget_s <= 0:
        bad_flag(f"--time_budget_s must be positive, got {budget_s:g}")
    models = chosen_models(plan, args)
    precision = ["--torch_dtype", "float32", "--use_cpu"] if smoke else ["--torch_dtype", "bfloat16", "--bf16"]
    return {**sizes(plan, args), "smoke": smoke, "plan": plan.name, "measure": chosen_measurements(plan, args),
            "models": models, **model_roles(list(models), SMOKE_EXPLORED_FOR if smoke else EXPLORED_FOR),
            "moe": [name for name, (_, shape, _) in models.items() if is_moe(shape)], "precision": precision,
            "ppo_prompt_len": 32 if smoke else 64, "max_positions": 256 if smoke else 32768,
            "time_budget_s": budget_s}
