"""The demo's PPO recipe, swept: after a `make demo`, PPO again beside the chain with the KL coefficient at three
values, each against two reward models: the demo's (one rejected answer in four is an arithmetic answer, "The answer
is 42.") and one trained on the same pairs with only negative reviews as rejected answers (the demo's until this
sweep); each run's health alarms, held-out figures and minutes in one table; the best recipe that held (no alarm, no
collapse of the held-out answers against the SFT policy's) runs again with a second seed.

    python -m lorakit.demo.ppo_sweep                  # after make demo: outputs/demo/ppo_sweep/{sweep.json,sweep.md}
    python -m lorakit.demo.ppo_sweep --measure_only   # the figures again from the runs already there

Every run is the pipeline's own PPO command for demo.yaml (the same actor, SFT adapter, prompts, steps and
learning rates), changed only in the flags its variant names, into outputs/demo/ppo_sweep/<variant>/. Held-out
figures: the greedy answers to the 20 held-out review prompts, scored by the demo's reward model (so every run is
comparable) and, for the sentiment-only variants, by their own; how far those answers collapsed (distinct answers,
answers in the arithmetic task's form). About 2 minutes a PPO run and 3 for the second reward model on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lorakit.core.cli import ArgumentParser, InputError, run_cli
from lorakit.demo.plan import DEMO_CONFIG, FULL, HELDOUT_FRACTION, PPO_SECOND_SEED, SPLIT_SEED, Demo
from lorakit.demo.prepare_default import prepare_model, write_pretraining_corpus
from lorakit.demo.report import Figures
from lorakit.demo.review_tasks import prompt_split
from lorakit.demo.sft_tasks import ANSWER_FORMAT
from lorakit.demo.stage_evaluation import (
    answer_collapse,
    heldout_answers,
    load_reward_scorer,
    reward_scorer,
    score_answers,
)
from lorakit.demo.stages import (
    health_alarms,
    last_logged,
    log_history,
    read_stage_result,
    run_beside_the_chain,
    sentiment_pairs,
    with_flag,
    write_jsonl,
)
from lorakit.demo.verdicts import collapse
from lorakit.pipeline.config import load_config
from lorakit.pipeline.stages import PlannedStage, plan_stages

logger = logging.getLogger("ppo_sweep")

# The KL coefficients tried: 0.05 (the demo's before the sweep, which collapsed), 0.2 and 0.5 (the demo's since).
KL_VALUES = (0.05, 0.2, 0.5)
DEMO_SEED = 42  # the Trainer's default, which the demo's PPO stage runs with


@dataclass(frozen=True)
class Variant:
    """One PPO run of the sweep: the demo's recipe with these changes."""

    name: str
    kl_ctl: float
    # Against the demo's reward model (one rejected answer in OTHER_TASK_EVERY from the arithmetic task), or against
    # one the sweep trains on the same pairs with every rejected answer a negative review (the demo's until the sweep).
    other_task_rejections: bool = True
    seed: int = DEMO_SEED


def sweep_variants() -> list[Variant]:
    """Each KL coefficient against the sentiment-only reward model, then against the demo's."""
    return [Variant(f"kl{kl:g}-{'other-task' if other else 'sentiment'}-rm", kl, other_task_rejections=other)
            for other in (False, True) for kl in KL_VALUES]


def demo_after_run(cache_dir: Path, output_dir: Path) -> Demo:
    """The Demo of a finished full `make demo` in output_dir: its paths, flags and held-out prompts (nothing is
    trained or written; the cached model and corpus are found where the demo left them)."""
    for needed in ("pt_merged", "sft/sft_lora_model", "reward/rm_lora_model", "rm_data/train/pairs.jsonl"):
        if not (output_dir / needed).exists():
            raise InputError(f"{output_dir / needed} is missing: run `make demo` (in full, not QUICK) first")
    report = output_dir / "report.json"
    if report.is_file() and json.loads(report.read_text(encoding="utf-8")).get("quick"):
        raise InputError(f"{report}: a `make demo QUICK=1` run (3 training steps); the sweep needs a full "
                         "`make demo`")
    pairs = read_jsonl(output_dir / "rm_data" / "train" / "pairs.jsonl")
    if not any(pair["rejected"].startswith(ANSWER_FORMAT.split("{}")[0]) for pair in pairs):
        raise InputError(f"{output_dir / 'rm_data' / 'train' / 'pairs.jsonl'}: no rejected answer from the "
                         "arithmetic task: a demo run from before the sweep's recipe; run `make demo` again first")
    demo = Demo(plan=FULL, cache_dir=cache_dir, output_dir=output_dir, model_dir=prepare_model(cache_dir))
    corpus_dir = cache_dir / f"corpus-heldout{HELDOUT_FRACTION:g}-seed{SPLIT_SEED}"
    demo.train_dir = write_pretraining_corpus(corpus_dir, HELDOUT_FRACTION, SPLIT_SEED).train_dir
    demo.flags = {stage.name: stage.flags for stage in load_config(str(DEMO_CONFIG), demo.overrides()).stages}
    demo.ppo_heldout_prompts = prompt_split().heldout[:FULL.ppo_heldout_prompts]
    return demo


def planned(demo: Demo, name: str) -> PlannedStage:
    return next(stage for stage in plan_stages(load_config(str(DEMO_CONFIG), demo.overrides()), sys.executable)
                if stage.config.name == name)


def sentiment_reward_model(demo: Demo, sweep_dir: Path, train: bool = True) -> Path:
    """The demo's reward stage again, on its pairs before the other task's rejected answers went in (train False,
    or trained on the same pairs before: the adapter already there); returns the adapter."""
    data_dir, out = sweep_dir / "rm_data_sentiment" / "train", sweep_dir / "reward_sentiment"
    pairs, written = sentiment_pairs(demo).train, data_dir / "pairs.jsonl"
    if not train or (out / "rm_lora_model").is_dir() and written.is_file() and read_jsonl(written) == pairs:
        logger.info("reusing %s: trained on these pairs by an earlier sweep", out / "rm_lora_model")
        return out / "rm_lora_model"
    write_jsonl(written, pairs)
    command = with_flag(with_flag(planned(demo, "reward").command, "dataset_dir", str(data_dir)), "output_dir",
                        str(out))
    run_beside_the_chain(command, out, "the reward stage on sentiment pairs only")
    return out / "rm_lora_model"


def run_variant(demo: Demo, variant: Variant, sweep_dir: Path, reward_adapter: Path, sft_answers: Figures,
                train: bool = True) -> Figures:
    """One PPO run beside the chain (or, train False, the one an earlier sweep left in its directory) and its
    figures."""
    out = sweep_dir / variant.name
    if train:
        command = planned(demo, "ppo").command
        for flag, value in (("output_dir", out), ("kl_ctl", variant.kl_ctl), ("reward_lora_model", reward_adapter)):
            command = with_flag(command, flag, str(value))
        run_beside_the_chain(command + ["--seed", str(variant.seed)], out, f"PPO {variant.name}")
    alarms = health_alarms(out)
    figures = {"variant": variant.name, "kl_ctl": variant.kl_ctl, "seed": variant.seed,
               "other_task_rejections": variant.other_task_rejections,
               # The Trainer's own time of the run: the same whether measured now or from an earlier sweep's run.
               "minutes": read_stage_result(out / "train_results.json")["train_runtime"] / 60,
               "kl_last": last_logged(log_history(out), "kl"), "alarms": alarms,
               "published": (alarms["ending"] or {}).get("published_from") or "last"}
    if not (out / "ppo_lora_model").is_dir():  # an alarm active at the end and no checkpoint saved before it
        figures.update(published="nothing", answers=[], holds=False)
        logger.info("%s: published nothing (alarms: %s)", variant.name, alarm_text(alarms))
        return figures
    answers = heldout_answers(demo, out / "ppo_lora_model")
    reward = mean(score_answers(demo, reward_scorer(demo), answers))
    figures.update(reward_mean=reward, reward_gain=reward - sft_answers["reward_mean"], **answer_collapse(answers),
                   answers=answers)
    if not variant.other_task_rejections:
        own = load_reward_scorer(demo, reward_adapter)
        figures["own_reward_mean"] = mean(score_answers(demo, own, answers))
        figures["own_reward_sft"] = mean(score_answers(demo, own, sft_answers["answers"]))
    figures["holds"] = holds(figures, sft_answers)
    logger.info("%s: %s", variant.name, summary_line(figures))
    return figures


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def rejudged(run: Figures, sft: Figures) -> Figures:
    """An earlier sweep's run with its collapse figures and verdict computed again, by today's rules."""
    if not run["answers"]:  # it published nothing
        return run
    run = {**run, **answer_collapse(run["answers"])}
    return {**run, "holds": holds(run, sft)}


def reward_accuracy(reward_dir: Path) -> float | None:
    """A reward stage's held-out pair accuracy (its rm_report.json), where it has one."""
    report = reward_dir / "rm_report.json"
    if not report.is_file():
        return None
    return json.loads(report.read_text(encoding="utf-8"))["sets"]["held_out"]["accuracy"]["accuracy"]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def holds(figures: Figures, sft: Figures) -> bool:
    """No alarm raised, and the held-out greedy answers not collapsed (verdicts.collapse, the demo report's rule: by
    the floor or against the SFT policy's; missing figures do not hold)."""
    return not figures["alarms"]["first"] and collapse(figures, sft, gain=0.0).holds is True


def best_variant(results: list[Figures]) -> str | None:
    """The name of the run that held with the largest held-out reward gain, or None where none held."""
    held = [figures for figures in results if figures["holds"]]
    return max(held, key=lambda figures: figures["reward_gain"])["variant"] if held else None


def alarm_text(alarms: dict[str, Any]) -> str:
    if not alarms["first"]:
        return "none"
    return ", ".join(f"{alarm['signal']} at step {alarm['step']}" for alarm in alarms["first"])


def summary_line(figures: Figures) -> str:
    return (f"alarms: {alarm_text(figures['alarms'])}; held-out reward {figures['reward_mean']:+.3f} "
            f"({figures['reward_gain']:+.3f} over SFT); distinct answers {figures['distinct_answer_share']:.2f}, "
            f"in the other task's form {figures['other_task_answer_share']:.2f}; {figures['minutes']:.1f} min")


def heldout_cells(figures: Figures) -> str:
    """The held-out reward, distinct answers and other-task answers cells of a run's row ("-" where it published
    nothing)."""
    if not figures["answers"]:
        return "- | - | -"
    own = (f"; own RM {figures['own_reward_sft']:+.3f} -> {figures['own_reward_mean']:+.3f}"
           if "own_reward_mean" in figures else "")
    return (f"{figures['reward_mean']:+.3f} ({figures['reward_gain']:+.3f}{own}) | "
            f"{figures['distinct_answer_share']:.2f} | {figures['other_task_answer_share']:.2f}")


def render_table(results: list[Figures], sft: Figures, best: str | None) -> str:
    """The sweep as a markdown table, with the SFT policy's row first and the verdict last."""
    lines = ["| run | KL coef | seed | alarms (first step) | published | held-out reward (gain over SFT) | distinct "
             "answers | other-task answers | KL last (per answer) | minutes | holds |",
             "|---|---|---|---|---|---|---|---|---|---|---|",
             f"| SFT policy (before PPO) | | | | | {sft['reward_mean']:+.3f} | {sft['distinct_answer_share']:.2f} | "
             f"{sft['other_task_answer_share']:.2f} | | | |"]
    for figures in results:
        lines.append(f"| {figures['variant']} | {figures['kl_ctl']:g} | {figures['seed']} | "
                     f"{alarm_text(figures['alarms'])} | {figures['published']} | {heldout_cells(figures)} | "
                     f"{figures['kl_last']:.3f} | {figures['minutes']:.1f} | {'yes' if figures['holds'] else 'no'} |")
    verdict = (f"Best recipe that held: **{best}**." if best else
               "**No recipe held** without an alarm or a collapse on SmolLM2-135M.")
    return "\n".join(lines) + "\n\n" + verdict + "\n"


def reward_line(accuracy: dict[str, float | None]) -> str:
    if accuracy["sentiment"] is None:
        return ""
    return (f"\nHeld-out sentiment pair accuracy of the reward models: the demo's (other-task rejected answers) "
            f"{accuracy['demo']:.3f}, the sentiment-only one {accuracy['sentiment']:.3f}.\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", type=Path, default=Path.cwd() / ".cache" / "demo")
    parser.add_argument("--output_dir", type=Path, default=Path.cwd() / "outputs" / "demo",
                        help="a finished make demo's outputs; the sweep goes to its ppo_sweep/")
    parser.add_argument("--variants", nargs="+", choices=[variant.name for variant in sweep_variants()],
                        help="run only these, keeping the other runs' figures from an earlier sweep.json (default: "
                             "all); either way the best that held runs again with a second seed")
    parser.add_argument("--measure_only", action="store_true",
                        help="train nothing: measure the runs an earlier sweep left in ppo_sweep/ again")
    return parser.parse_args(argv)


class Sweep:
    """One invocation's runs: trained (or, --measure_only, found) and measured in order, sweep.json rewritten after
    each, so a sweep stopped half-way keeps what it measured."""

    def __init__(self, demo: Demo, args: argparse.Namespace) -> None:
        self.demo, self.args, self.dir = demo, args, demo.path("ppo_sweep")
        self.dir.mkdir(exist_ok=True)
        answers = heldout_answers(demo, demo.path("sft", "sft_lora_model"))
        self.sft = {"reward_mean": mean(score_answers(demo, reward_scorer(demo), answers)), "answers": answers,
                    **answer_collapse(answers)}
        self.rewards = {True: demo.path("reward", "rm_lora_model"), False: None}
        earlier = self.dir / "sweep.json"
        self.runs = {run["variant"]: rejudged(run, self.sft)
                     for run in (json.loads(earlier.read_text(encoding="utf-8"))["runs"] if earlier.is_file() else [])
                     if not self.wanted(run["variant"])}

    def wanted(self, name: str) -> bool:
        """Whether this invocation measures the run: one --variants names (all without it), and under --measure_only
        one an earlier sweep left; the others keep their figures from sweep.json."""
        named = not self.args.variants or name.split("-seed")[0] in self.args.variants
        return named and (not self.args.measure_only or (self.dir / name / "train_results.json").is_file())

    def measure(self, variant: Variant) -> None:
        if not self.wanted(variant.name):
            return
        reward_model = self.rewards[variant.other_task_rejections]
        if reward_model is None:  # only the sentiment reward model (False) is made when first needed
            reward_model = self.rewards[False] = sentiment_reward_model(self.demo, self.dir,
                                                                        train=not self.args.measure_only)
        self.runs[variant.name] = run_variant(self.demo, variant, self.dir, reward_model, self.sft,
                                              train=not self.args.measure_only)
        self.save(best_variant(self.ordered()))

    def ordered(self) -> list[Figures]:
        """The runs in the sweep's order, each second-seed run after its first."""
        order = {variant.name: index for index, variant in enumerate(sweep_variants())}
        return sorted(self.runs.values(), key=lambda run: (order.get(run["variant"].split("-seed")[0], len(order)),
                                                           run["variant"]))

    def save(self, best: str | None) -> str:
        accuracy = {"demo": reward_accuracy(self.demo.path("reward")),
                    "sentiment": reward_accuracy(self.dir / "reward_sentiment")}
        table = render_table(self.ordered(), self.sft, best) + reward_line(accuracy)
        (self.dir / "sweep.md").write_text(table, encoding="utf-8")
        (self.dir / "sweep.json").write_text(json.dumps(
            {"sft": self.sft, "runs": self.ordered(), "best": best, "reward_accuracy": accuracy}, indent=2,
            ensure_ascii=False), encoding="utf-8")
        return table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    sweep = Sweep(demo_after_run(args.cache_dir.resolve(), args.output_dir.resolve()), args)
    for variant in sweep_variants():
        sweep.measure(variant)
    best = best_variant([run for run in sweep.ordered() if "-seed" not in run["variant"]])
    if best:
        chosen = next(variant for variant in sweep_variants() if variant.name == best)
        sweep.measure(replace(chosen, name=f"{best}-seed{PPO_SECOND_SEED}", seed=PPO_SECOND_SEED))
    print("\n" + sweep.save(best))
    return 0


def entry_point() -> None:
    run_cli(lambda: sys.exit(main()))


if __name__ == "__main__":
    entry_point()
