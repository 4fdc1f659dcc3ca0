"""The time budget: a plan's runs in order, each in a child process with a time limit, the results recorded and the
JSON rewritten as they arrive.

Each plan states its budget (plan.Plan.budget_s, 480 s: one call of at most 8 minutes; --time_budget_s overrides it).
Each run goes in a child process with a time limit of its kind's maximum or what is left, whichever is less
(specs.TIME_LIMITS), so a slow or hung run loses only itself: the limit stops its whole process group and it is
recorded "timed out". A run that would start with less than its kind's minimum left is recorded "skipped: out of time".
A child that crashes loses the run it was in, and the runs after it go on in a new child. The JSON is rewritten after
every child, so a run stopped from outside keeps what finished. On a GPU every run has its own child (a clean device,
and no run's kernel patches leak into the next), its model prepared first in a child of its own; the smoke run puts
the runs of consecutive steps in one child (an import of the stack costs more there than a tiny run).
"""

from __future__ import annotations

import importlib.util
import signal
import sys
from pathlib import Path

from measure import ChildUsage, log_tail, read_results, run_child_until, write_json

from .flops import peak_bf16_flops
from .plan import PLANS, Step
from .report import build_report, summarise_rl, summarise_sft
from .specs import prepare_spec
from .state import RunState

# The benchmark's entry script, which runs a list of specs in a child process when given --child run.
ENTRY = Path(__file__).resolve().parents[1] / "bench_gpu.py"


def missing_need(need: str, on_cpu: bool) -> str | None:
    """Why a need ("cuda" or a module) is not met here, seen from the parent (nothing imported), or None."""
    if need == "cuda":
        return "needs a CUDA GPU" if on_cpu else None
    return None if importlib.util.find_spec(need) else f"{need} is not installed"


def ended_early(usage: ChildUsage, limit_s: float, log_path: Path) -> dict:
    """The result of the run a child was in when it ended without its figures."""
    if usage.timed_out:
        return {"status": "timed out", "message": f"stopped at its time limit, {limit_s:.0f} s"}
    last = next((line.strip() for line in reversed(log_tail(log_path).splitlines()) if line.strip()), "")
    how = f"killed by {signal.Signals(-usage.exit_code).name}" if usage.exit_code < 0 else f"exit {usage.exit_code}"
    return {"status": "crashed", "message": f"its process ended ({how}); its log's last line: {last[:300]}"}


def flash_attention_2_available() -> bool:
    from transformers.utils import is_flash_attn_2_available

    return is_flash_attn_2_available()


def chosen_steps(settings: dict) -> list[Step]:
    return [step for step in PLANS[settings["plan"]].steps if step.measurement in settings["measure"]]


class Session:
    """One benchmark run: the plan's chosen steps in order within the time budget, each run's result recorded in the
    state, and the JSON rewritten, as it arrives."""

    def __init__(self, state: RunState, work: Path, output: str) -> None:
        self.state, self.work, self.output, self.children = state, work, output, 0
        self.steps = chosen_steps(state.settings)
        # The models PPO runs at get a reward adapter when prepared. A step that reads results builds no PPO run.
        self.reward_models = {spec["model"] for step in self.steps if not step.reads_results
                              for spec in step.specs(state) if spec["kind"] == "ppo"}

    def run(self) -> None:
        """The steps' runs in order; a step built from results waits for every run before it."""
        pending = []
        for step in self.steps:
            if step.reads_results:
                self.run_specs(pending)
                pending = []
            planned = set(self.state.results) | {spec["name"] for spec in pending}
            pending += [spec for spec in step.specs(self.state) if spec["name"] not in planned]
        self.run_specs(pending)

    def run_specs(self, specs: list) -> None:
        """On a GPU each run in a child of its own, its model prepared first in one of its own; in the smoke run all
        in one child."""
        if self.state.settings["smoke"]:
            return self.run_in_children(self.prepare_specs(specs) + specs)
        for spec in specs:
            for prepare in self.prepare_specs([spec]):
                self.run_in_children([prepare])
            prepared = self.state.prepared[spec["model"]]
            if prepared["status"] != "done":
                self.record(spec, {"status": "skipped",
                                   "message": f"its model was not prepared ({prepared['status']})"})
            else:
                self.run_in_children([spec])

    def prepare_specs(self, specs: list) -> list:
        prepared = self.state.prepared
        models = [model for model in dict.fromkeys(spec["model"] for spec in specs) if model not in prepared]
        prepared.update({model: {"status": "pending"} for model in models})
        return [prepare_spec(self.state.settings, self.state.paths, model, model in self.reward_models)
                for model in models]

    def run_in_children(self, specs: list) -> None:
        """specs in one child within the budget; a child that crashes or reaches its time limit loses the run it
        was in, and the runs after it go on in a new child. TRL's runs start only where trl (and Liger) are
        installed: where not, they are recorded "not available" without a child."""
        specs = [spec for spec in specs if not self.lacks_start_need(spec)]
        while specs:
            if self.state.left_s() >= specs[0]["min_s"]:
                specs = self.run_in_child(specs)
                continue
            spec = specs.pop(0)
            self.record(spec, {"status": "skipped: out of time",
                               "message": f"{self.state.left_s():.0f} s left, it needs {spec['min_s']:.0f} s"})

    def lacks_start_need(self, spec: dict) -> bool:
        needs = spec["requires"] if spec["kind"] == "trl" else []
        absent = next(filter(None, (missing_need(need, spec["on_cpu"]) for need in needs)), None)
        if absent:
            self.record(spec, {"status": "not available", "message": absent})
        return absent is not None

    def run_in_child(self, specs: list) -> list:
        """specs in one child, limited to their kinds' maxima or what is left; the specs still to run after it."""
        limit_s = min(self.state.left_s(), sum(spec["max_s"] for spec in specs))
        results, usage, log_path = self.spawn(specs, limit_s)
        for spec in specs:
            if spec["name"] in results:
                self.record(spec, {**results[spec["name"]], "child_peak_rss_mb": usage.peak_rss_mb})
        rest = [spec for spec in specs if spec["name"] not in results]
        if rest:  # the child ended in the first of them
            self.record(rest.pop(0), ended_early(usage, limit_s, log_path))
        self.save(complete=False)
        return rest

    def spawn(self, specs: list, limit_s: float) -> tuple[dict, ChildUsage, Path]:
        """(the results the child wrote, however it ended; its usage; its log)."""
        self.children += 1
        run_dir = self.work / f"child{self.children}"
        run_dir.mkdir()
        metrics = run_dir / "metrics.json"
        command = [sys.executable, str(ENTRY), "--child", "run", "--workdir", run_dir, "--metrics", metrics,
                   "--specs", write_json(run_dir / "specs.json", specs)]
        usage = run_child_until(command, run_dir / "log.txt", limit_s)
        return read_results(metrics) if metrics.is_file() else {}, usage, run_dir / "log.txt"

    def record(self, spec: dict, result: dict) -> None:
        entry = {**spec, **result}
        if spec["kind"] == "prepare":
            self.state.prepared[spec["model"]] = entry
        else:
            if entry["status"] == "done" and entry["group"] == "throughput":
                config = self.state.settings["models"][entry["model"]][1]
                summarise_sft(entry, config, peak_bf16_flops(self.state.device))
            elif entry["status"] == "done" and entry["group"] == "rl":
                summarise_rl(entry)
            self.state.results[spec["name"]] = entry
        figure = f" {entry['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in entry else ""
        message = f": {entry['message'][:160]}" if entry.get("message") else ""
        print(f"  {spec['name']}: {entry['status']}{figure}{message} ({self.state.left_s():.0f} s left)", flush=True)

    def save(self, complete: bool) -> dict:
        report = build_report(self.state, complete)
        write_json(self.output, report)
        return report
