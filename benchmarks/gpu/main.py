"""The benchmark's top: the child's runs, or the plan in the parent (benchmarks/bench_gpu.py calls main)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from measure import REPO, quiet_offline_env, scratch_dir

from .budget import Session, flash_attention_2_available
from .child import run_child
from .inputs import write_data
from .settings import bad_flag, parse_args, settings_of
from .state import RunState
from .tables import print_report


def default_output(settings: dict) -> str:
    """One file per plan, so a call of one plan leaves the others' results alone."""
    return f"outputs/bench/gpu{'_cpu_smoke' if settings['smoke'] else ''}-{settings['plan']}.json"


def paths_of(work: Path, settings: dict) -> dict:
    """The inputs' paths (written now) and each model's directory and reward adapter's (written when prepared)."""
    models = {f"{kind}:{model}": str(work / "models" / f"{model}{suffix}")
              for model in settings["models"] for kind, suffix in (("model", ""), ("reward", "-reward"))}
    return {**write_data(work, settings), **models}


def main(argv: list | None = None) -> dict | None:
    args = parse_args(argv)
    if args.child:
        return run_child(args)
    started = time.monotonic()
    settings = settings_of(args)
    import torch

    if not settings["smoke"] and not torch.cuda.is_available():
        bad_flag("no CUDA device here; run it on a GPU machine (make gpu-check), or add --cpu_smoke to check its "
                 "code paths on tiny shapes on the CPU")
    os.chdir(REPO)
    quiet_offline_env()
    output = args.output or default_output(settings)
    print(f"GPU benchmark{' (CPU smoke run)' if settings['smoke'] else ''}, plan {settings['plan']}: "
          f"{', '.join(settings['models'])}; measuring {', '.join(settings['measure'])}; "
          f"{settings['time_budget_s']:.0f} s budget", flush=True)
    with scratch_dir("bench_gpu-", keep=args.keep) as work:
        os.environ["HF_DATASETS_CACHE"] = str(work / "hf_datasets")
        state = RunState(settings, paths_of(work, settings), started + settings["time_budget_s"],
                         flash_attention=not settings["smoke"] and flash_attention_2_available())
        session = Session(state, work, output)
        session.run()
    report = session.save(complete=True)
    print_report(state, report)
    print(f"\nwrote {output}")
    return report
