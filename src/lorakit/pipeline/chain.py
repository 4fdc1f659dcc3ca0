"""The chain of stages one pipeline command line asks for: which of the planned stages it selects (--stages,
--from_stage), the check that none of their directories is a link, and each selected stage's decision (skip, run,
resume) and run, in order. The command itself (its arguments, the lock, the report line): lorakit.commands.pipeline.
"""

import argparse
import os
import shlex
from typing import NamedTuple

from lorakit.core.cli import InputError
from lorakit.pipeline.config import PipelineConfig
from lorakit.pipeline.markers import decide, inputs_of
from lorakit.pipeline.runner import RunContext, command_in, run_stage
from lorakit.pipeline.stages import PlannedStage


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


def refuse_linked_stage_dirs(selected: list[PlannedStage]) -> None:
    """A stage's directory is replaced whole by its rerun, and cleared before a first run: through a symbolic link
    that would replace the link (or delete nothing). Refused; output_dir itself may be a link."""
    for stage in selected:
        if os.path.islink(stage.out_dir):
            raise InputError(f"{stage.out_dir} is a symbolic link (to {os.readlink(stage.out_dir)}): the pipeline "
                             "replaces a stage's directory whole and does not follow links out of output_dir; make "
                             "output_dir itself the link, or put a directory in its place")


class StageReport(NamedTuple):
    name: str
    action: str  # skipped | run | resume
    seconds: float


def run_stages(planned: list[PlannedStage], selected: list[PlannedStage], forced: str | None,
               config: PipelineConfig, run: RunContext | None) -> list[StageReport]:
    """Decide and run each selected stage in order (run None: a dry run, which prints and runs nothing)."""
    rerun_reason = f"--from_stage {forced}" if forced else None
    report = []
    for stage in selected:
        inputs = inputs_of(planned, stage, config.output_dir)
        decision = decide(stage, config.output_dir, inputs, rerun_reason)
        name = stage.config.name
        where = (f"; builds in {decision.build_dir}, which replaces {stage.out_dir} when it succeeds"
                 if decision.action == "run" and decision.build_dir != stage.out_dir else "")
        print(f"pipeline: stage '{name}' ({stage.config.kind}): {decision.action} -- {decision.reason}{where}",
              flush=True)
        if decision.action == "skip":
            report.append(StageReport(name, "skipped", 0.0))
            continue
        print(f"pipeline: $ {shlex.join(command_in(stage, decision.build_dir))}", flush=True)
        rerun_reason = "an earlier stage runs first"
        if run is not None:
            report.append(StageReport(name, decision.action, run_stage(stage, decision, inputs, run)))
    return report
