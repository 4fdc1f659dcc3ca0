#!/usr/bin/env python
"""Take a model through the whole path in one command: vocabulary extension, continued
pretraining, merge, SFT, reward model, PPO, merge, chat check -- each stage through its own
script (under torchrun for the training stages), chained on the previous stage's output.

    python scripts/run_pipeline.py configs/pipeline/llama2_7b_zero2_8gpu.yaml
    python scripts/run_pipeline.py my.yaml sft.learning_rate=1e-4 deployment.nproc_per_node=4
    python scripts/run_pipeline.py my.yaml --dry_run          # print the commands, run nothing
    python scripts/run_pipeline.py my.yaml --from_stage reward   # rerun reward and what follows
    python scripts/run_pipeline.py my.yaml --stages sft,reward

A rerun skips completed stages, resumes an interrupted one from its checkpoint and reruns a stage
whose config, data files or input models changed with every stage after it; a rerun of a completed stage
replaces its output only when it succeeds. One run at a time per output directory (and node): a second is
refused at once, naming the first. The config format: lorakit.pipeline.config; the rerun rules:
lorakit.pipeline.markers; SIGTERM and SIGINT: lorakit.pipeline.process.
"""

import argparse
import os
import sys
from collections.abc import Sequence

from lorakit.core.cli import ArgumentParser, refuse_unknown_flags, run_cli
from lorakit.core.fingerprints import FingerprintMemo
from lorakit.pipeline.chain import refuse_linked_stage_dirs, run_stages, select
from lorakit.pipeline.config import load_config
from lorakit.pipeline.lock import OutputLock
from lorakit.pipeline.markers import MARKER_DIR, check_selection_inputs
from lorakit.pipeline.process import FORWARDING
from lorakit.pipeline.runner import RunContext
from lorakit.pipeline.stages import hash_contents, plan_stages


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="The pipeline's YAML file.")
    parser.add_argument("overrides", nargs="*", help="key=value, e.g. sft.learning_rate=1e-4 (the value as YAML).")
    parser.add_argument("--dry_run", action="store_true", help="Print what each stage would do and its command.")
    parser.add_argument("--stages", default=None, help="Only these stages (names, comma-separated).")
    parser.add_argument("--from_stage", default=None, help="Rerun this stage and every stage after it.")
    parser.add_argument("--python", default=sys.executable, help="The interpreter the stages run with.")
    tokens = sys.argv[1:] if argv is None else list(argv)
    refuse_unknown_flags(parser, tokens)  # one line naming the closest flag; no abbreviations (allow_abbrev=False)
    return parser.parse_intermixed_args(tokens)  # overrides may come after the options


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    config = load_config(args.config, args.overrides)
    lock = OutputLock(config.output_dir, config.deployment.node_rank)
    if not args.dry_run:
        lock.check_free()  # at once, before planning imports every stage's script
    planned = plan_stages(config, args.python)
    fingerprints = os.path.join(config.output_dir, MARKER_DIR, "fingerprints")
    memo = FingerprintMemo(fingerprints)
    hash_contents(planned, config, memo)
    selected, forced = select(planned, args)
    if len(selected) < len(planned):
        check_selection_inputs(planned, selected, config.output_dir)
    refuse_linked_stage_dirs(selected)
    if args.dry_run:
        run_stages(planned, selected, forced, config, None)
        return
    with lock, FORWARDING.installed():
        memo_dir = os.path.join(fingerprints, f"node-{config.deployment.node_rank}")
        os.makedirs(memo_dir, exist_ok=True)
        memo.save_into(memo_dir)
        run = RunContext(config.output_dir, config.deployment.node_rank, lock.token)
        report = run_stages(planned, selected, forced, config, run)
    print("pipeline: done. " + "; ".join(f"{name} {action} {seconds:.0f}s" for name, action, seconds in report))


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands). A stage that fails
    ends the pipeline with its exit status (lorakit.pipeline.runner.StageFailed); SIGTERM or SIGINT with 128 + its
    number, after the stage's processes ended."""
    run_cli(main)


if __name__ == "__main__":
    entry_point()
