#!/usr/bin/env python
"""Take a model through the whole path in one command: vocabulary extension, continued
pretraining, merge, SFT, reward model, PPO, merge, chat check -- each stage through its own
script (under torchrun for the training stages), chained on the previous stage's output.

    python scripts/run_pipeline.py configs/pipeline/llama2_7b_zero2_8gpu.yaml
    python scripts/run_pipeline.py my.yaml sft.learning_rate=1e-4 deployment.nproc_per_node=4
    python scripts/run_pipeline.py my.yaml --dry_run          # print the commands, run nothing
    python scripts/run_pipeline.py my.yaml --from_stage reward   # rerun reward and what follows
    python scripts/run_pipeline.py my.yaml --stages sft,reward

A rerun skips completed stages, resumes an interrupted one from its checkpoint and reruns a
stage whose config changed with every stage after it. The config format: lorakit.pipeline.config.
"""

import argparse
import shlex
import sys
from collections.abc import Sequence
from typing import NamedTuple

from lorakit.core.cli import InputError, run_cli
from lorakit.pipeline.config import load_config
from lorakit.pipeline.runner import StageFailed, check_selection_inputs, decide, inputs_of, run_stage
from lorakit.pipeline.stages import PlannedStage, plan_stages


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="The pipeline's YAML file.")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. sft.learning_rate=1e-4 (the value as YAML).")
    parser.add_argument("--dry_run", action="store_true", help="Print what each stage would do and its command.")
    parser.add_argument("--stages", default=None, help="Only these stages (names, comma-separated).")
    parser.add_argument("--from_stage", default=None, help="Rerun this stage and every stage after it.")
    parser.add_argument("--python", default=sys.executable, help="The interpreter the stages run with.")
    return parser.parse_intermixed_args(argv)  # overrides may come after the options


class Selection(NamedTuple):
    """The stages a command line asks for."""

    stages: list[PlannedStage]  # those to consider, in order
    forced: str | None  # the first stage forced to rerun (--from_stage), or None


def select(planned: list[PlannedStage], args: argparse.Namespace) -> Selection:
    """The stages to consider, and the first stage forced to rerun or None."""
    names = [stage.config.name for stage in planned]
    if args.stages and args.from_stage:
        raise InputError("give --stages or --from_stage, not both")
    wanted = [name.strip() for name in args.stages.split(",")] if args.stages else []
    if args.from_stage:
        wanted = [args.from_stage]
    for name in wanted:
        if name not in names:
            raise InputError(f"{args.config}: no stage named '{name}' (the stages are: {', '.join(names)})")
    if args.from_stage:
        return Selection(planned[names.index(args.from_stage):], args.from_stage)
    return Selection([stage for stage in planned if stage.config.name in wanted] if wanted else planned, None)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    config = load_config(args.config, args.overrides)
    planned = plan_stages(config, args.python)
    selected, forced = select(planned, args)
    if len(selected) < len(planned):
        check_selection_inputs(planned, selected, config.output_dir)
    rerun_reason = f"--from_stage {forced}" if forced else None
    report = []
    for stage in selected:
        inputs = inputs_of(planned, stage, config.output_dir)
        decision = decide(stage, config.output_dir, inputs, rerun_reason)
        name = stage.config.name
        print(f"pipeline: stage '{name}' ({stage.config.kind}): {decision.action} -- {decision.reason}", flush=True)
        if decision.action == "skip":
            report.append((name, "skipped", 0.0))
            continue
        print(f"pipeline: $ {shlex.join(stage.command)}", flush=True)
        rerun_reason = "an earlier stage runs first"
        if not args.dry_run:
            report.append((name, decision.action, run_stage(stage, config.output_dir, decision, inputs,
                                                            config.deployment.node_rank)))
    if not args.dry_run:
        print("pipeline: done. " + "; ".join(f"{name} {action} {seconds:.0f}s" for name, action, seconds in report))


def run() -> None:
    try:
        main()
    except StageFailed as failure:
        print(f"error: {failure}", file=sys.stderr, flush=True)
        sys.exit(2 if failure.status == 2 else 1)


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    run_cli(run)


if __name__ == "__main__":
    entry_point()
