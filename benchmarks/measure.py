"""What the benchmarks in benchmarks/ share: running a child process and reading its wall time,
peak RSS and CPU time; timing a transformers Trainer's steps from inside a child; best- and median-of-repeats
summaries, ratios against targets (and their median and spread over repeats), printed tables and the JSON reports
under outputs/bench/, each with its date, machine and commit from environment().

Not a benchmark itself (`make bench` runs benchmarks/bench_*.py): the scripts import it as
`measure`, their own directory being first on the import path when run as scripts.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import io
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Inherited by every child: nothing from a model hub, no progress bars, no experiment trackers.
QUIET_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                     "TQDM_DISABLE": "1", "DISABLE_MLFLOW_INTEGRATION": "TRUE", "WANDB_DISABLED": "true"}


# ----------------------------------------------------------------------------- setup


def quiet_offline_env(**extra: str) -> None:
    """QUIET_OFFLINE_ENV and `extra` into os.environ (before transformers/datasets read them)."""
    os.environ.update(QUIET_OFFLINE_ENV)
    os.environ.update(extra)


def prepared_model(cache_dir: str, label: str = "model") -> str:
    """lorakit.demo.prepare_default's SmolLM2-135M-Instruct directory (built once under cache_dir);
    prints how long preparing it took."""
    from lorakit.demo.prepare_default import prepare_model

    model_dir, seconds = timed(prepare_model, cache_dir)
    print(f"{label}: {model_dir} (prepared in {seconds:.1f}s)", flush=True)
    return model_dir


@contextlib.contextmanager
def scratch_dir(prefix: str, keep: bool = False, copy_to: str | None = None):
    """A temporary work directory, removed on exit unless keep (then its path is printed); with
    copy_to, first copied there (replacing what was there)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work
    finally:
        if copy_to:
            shutil.rmtree(copy_to, ignore_errors=True)
            shutil.copytree(work, copy_to)
        if keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


# ----------------------------------------------------------------------------- timing and child processes


def timed(function, *args):
    """(function(*args), its wall seconds)."""
    start = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - start


def loadavg() -> list:
    """The machine's 1, 5 and 15-minute load averages, rounded; [] where the OS has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


@dataclass
class ChildUsage:
    """One child process's own figures: os.wait4's rusage for that child alone (its own children included), and
    how it ended."""

    wall_s: float
    peak_rss_mb: float  # ru_maxrss (KiB on Linux) / 1024
    cpu_s: float  # user + system
    exit_code: int = 0  # negative: the signal that ended it
    timed_out: bool = False  # stopped at its time limit


# After SIGTERM at its time limit, a child gets this long to end before SIGKILL.
STOP_GRACE_S = 10.0


class TimeLimit:
    """Stops a child's whole process group (compile and dataloader workers included) once timeout_s have passed:
    SIGTERM, then SIGKILL after STOP_GRACE_S unless it has ended. Only signals: the thread that waits for the
    child reaps it (ended() then), so two waiters never race for it."""

    def __init__(self, pid: int, timeout_s: float):
        self.pid, self.fired, self.gone = pid, False, threading.Event()
        self.timer = threading.Timer(timeout_s, self.stop)
        self.timer.daemon = True
        self.timer.start()

    def stop(self) -> None:
        self.fired = True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.gone.is_set():
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)
            self.gone.wait(STOP_GRACE_S)

    def ended(self) -> None:
        self.gone.set()
        self.timer.cancel()


def run_child_until(command: list, log_path: Path, timeout_s: float | None = None,
                    env: dict | None = None) -> ChildUsage:
    """Runs command (from the repo root), its stdout and stderr into log_path, to its end or until timeout_s
    (TimeLimit); how it ended is in the ChildUsage, nothing is raised for it."""
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        # Its own session under a time limit, so that the limit stops the workers it started too.
        child = subprocess.Popen([str(part) for part in command], cwd=REPO, env=env, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=timeout_s is not None)
        limit = TimeLimit(child.pid, timeout_s) if timeout_s is not None else None
        try:
            _, status, usage = os.wait4(child.pid, 0)
        except BaseException:  # interrupted while waiting: the child (and its workers) must not outlive this process
            if limit:
                os.killpg(child.pid, signal.SIGKILL)
            else:
                child.kill()
            raise
        finally:
            if limit:
                limit.ended()
    code = os.waitstatus_to_exitcode(status)
    return ChildUsage(time.perf_counter() - start, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime, code,
                      bool(limit and limit.fired and code != 0))


def log_tail(log_path: Path, chars: int = 4000) -> str:
    return Path(log_path).read_text(encoding="utf-8", errors="replace")[-chars:]


def run_child(command: list, log_path: Path, what: str, env: dict | None = None,
              expect: Path | None = None) -> ChildUsage:
    """Runs command (from the repo root) to completion, its stdout and stderr into log_path.
    Raises SystemExit with the log's tail when it fails, or leaves no `expect` file."""
    usage = run_child_until(command, log_path, env=env)
    if usage.exit_code != 0 or (expect is not None and not expect.is_file()):
        raise SystemExit(f"{what} failed (exit {usage.exit_code}); last lines of {log_path}:\n{log_tail(log_path)}")
    return usage


def run_child_benchmark(python: str, script: str, run: str, run_dir: Path, flags: list) -> tuple:
    """`python script --child run --workdir run_dir --metrics run_dir/metrics.json *flags`, measured:
    (the metrics the child wrote, its ChildUsage, load average before, load average after)."""
    run_dir.mkdir()
    metrics = run_dir / "metrics.json"
    command = [python, script, "--child", run, "--workdir", run_dir, "--metrics", metrics, *flags]
    load_before = loadavg()
    usage = run_child(command, run_dir / "log.txt", f"run {run}", expect=metrics)
    return read_results(metrics), usage, load_before, loadavg()


def add_child_arguments(parser, runs) -> None:
    """The hidden flags by which a benchmark runs one of its runs in a child process of itself."""
    import argparse

    parser.add_argument("--child", choices=runs, help=argparse.SUPPRESS)
    for name in ("--model", "--data", "--workdir", "--metrics"):
        parser.add_argument(name, help=argparse.SUPPRESS)


def set_torch_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- inside a training child


def after_trainer_init(hook) -> None:
    """Every transformers Trainer built from now on (whatever the subclass) calls hook(trainer)
    at the end of its __init__."""
    from transformers import Trainer

    original_init = Trainer.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        hook(self)

    Trainer.__init__ = init


class TrainingClock:
    """Times a Trainer's optimizer steps through `self.callback`: the wall and CPU seconds of each,
    from on_train_begin (step 1) or the previous on_step_end to its on_step_end, passed to
    step_done(); keeps every log the trainer emits; calls finish(args) at on_train_end."""

    def __init__(self):
        from transformers import TrainerCallback

        clock = self

        class Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                clock.began = clock.last = (time.perf_counter(), time.process_time())

            def on_step_end(self, args, state, control, **kwargs):
                previous, clock.last = clock.last, (time.perf_counter(), time.process_time())
                clock.step_done(clock.last[0] - previous[0], clock.last[1] - previous[1])

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs:
                    clock.logs.append(dict(logs))

            def on_train_end(self, args, state, control, **kwargs):
                clock.finish(args)

        self.callback = Callback()
        self.began = self.last = None  # (perf_counter, process_time)
        self.logs = []

    def train_wall_s(self) -> float:
        return self.last[0] - self.began[0]

    def train_cpu_s(self) -> float:
        return self.last[1] - self.began[1]

    def step_done(self, wall_s: float, cpu_s: float) -> None:
        raise NotImplementedError

    def finish(self, args) -> None:
        raise NotImplementedError


# ----------------------------------------------------------------------------- results and reports


def best_of(results: list, key: str, higher_is_better: bool, with_worst: bool = False) -> dict:
    """The repeat with the best `key`, with every repeat's `key` (and the worst) beside it; its
    peak_rss_mb is the worst peak of all repeats: a memory bound must hold every time."""
    pick = max if higher_is_better else min
    best = dict(pick(results, key=lambda r: r[key]))
    best[f"{key}_all"] = [r[key] for r in results]
    if with_worst:
        best[f"{key}_worst"] = (min if higher_is_better else max)(best[f"{key}_all"])
    best["peak_rss_mb_all"] = [r["peak_rss_mb"] for r in results]
    best["peak_rss_mb"] = max(best["peak_rss_mb_all"])
    return best


def median_of(results: list, key: str) -> dict:
    """The repeat with the median `key` (the lower middle one of an even count: a real run, whose other figures
    belong with it), with every repeat's `key`, its min and max beside it; its peak_rss_mb is the worst peak of all
    repeats, as in best_of."""
    ordered = sorted(results, key=lambda r: r[key])
    middle = dict(ordered[(len(ordered) - 1) // 2])
    middle[f"{key}_all"] = [r[key] for r in results]
    middle[f"{key}_min"], middle[f"{key}_max"] = ordered[0][key], ordered[-1][key]
    middle["peak_rss_mb_all"] = [r["peak_rss_mb"] for r in results]
    middle["peak_rss_mb"] = max(middle["peak_rss_mb_all"])
    return middle


class Ratios:
    """Ratios of one run's figure to another's, in the order added, and the verdicts of those
    that have a target."""

    def __init__(self, results: dict):
        self.results, self.values, self.verdicts = results, {}, []

    def add(self, name: str, run: str, other: str, key: str, target: float | None = None,
            at_most: bool = True) -> None:
        """results[run][key] / results[other][key] (skipped unless both ran, and where the other's figure
        is 0 or missing: no ratio is known then, and a report written mid-run must not crash on it); a
        verdict when target is given: the ratio must be <= target (at_most) or >= it."""
        if run not in self.results or other not in self.results or not self.results[other].get(key):
            return
        value = self.results[run][key] / self.results[other][key]
        self.values[name] = value
        if target is not None:
            self.verdicts.append((name, value, target, value <= target if at_most else value >= target, at_most))

    def print(self, name_width: int, file=None) -> None:
        print(file=file)
        for name, value in self.values.items():
            print(f"{name:<{name_width}} {value:5.2f}", file=file)
        print_verdicts(self.verdicts, "", file)

    def verdict_records(self) -> list:
        return [{"ratio": n, "value": v, "target": t, "meets": ok} for n, v, t, ok, _ in self.verdicts]


def print_verdicts(verdicts: list, label: str, file=None) -> None:
    """Each ratio against its target (label: what the value is, e.g. "median ")."""
    print(file=file)
    for name, value, target, ok, at_most in verdicts:
        bound = "<=" if at_most else ">="
        print(f"{name}: {label}{value:.2f} ({'meets' if ok else 'MISSES'} target {bound} {target:g})", file=file)


class RepeatedRatios:
    """The ratios of a benchmark that runs every side --repeats times: each ratio taken within each repeat (repeat i
    of one run against repeat i of the other, measured close in time), then its median and its spread (min-max) over
    the repeats; a target is judged on the median. compare(results) builds one repeat's Ratios."""

    def __init__(self, raw: dict, compare):
        repeats = max((len(rows) for rows in raw.values()), default=0)
        self.per_repeat = [compare({run: rows[i] for run, rows in raw.items() if len(rows) > i})
                           for i in range(repeats)]
        self.spreads, targets = {}, {}
        for ratios in self.per_repeat:
            for name in ratios.values:
                self.spreads.setdefault(name, []).append(ratios.values[name])
            targets.update({name: (target, at_most) for name, _, target, _, at_most in ratios.verdicts})
        self.spreads = {name: {"median": statistics.median(values), "min": min(values), "max": max(values),
                               "all": values} for name, values in self.spreads.items()}
        self.values = {name: spread["median"] for name, spread in self.spreads.items()}
        self.verdicts = [(name, self.values[name], target,
                          self.values[name] <= target if at_most else self.values[name] >= target, at_most)
                         for name, (target, at_most) in targets.items()]

    def print(self, name_width: int, file=None) -> None:
        print(file=file)
        for name, spread in self.spreads.items():
            print(f"{name:<{name_width}} {spread['median']:5.2f}  ({spread['min']:.2f}-{spread['max']:.2f} over "
                  f"{len(spread['all'])} repeats)", file=file)
        print_verdicts(self.verdicts, "median ", file)

    def verdict_records(self) -> list:
        return [{"ratio": n, "median": v, "target": t, "meets": ok} for n, v, t, ok, _ in self.verdicts]


def report_stream(complete: bool):
    """Where a report prints: stdout for the final one, nowhere for the partial ones."""
    return sys.stdout if complete else io.StringIO()


def print_table(header: str, lines, file=None, rule: bool = True) -> None:
    """header, a rule of dashes as wide (unless rule is False), then the lines."""
    print(header, file=file)
    if rule:
        print("-" * len(header), file=file)
    for line in lines:
        print(line, file=file)


def environment(*packages: str, **settings) -> dict:
    """When, where and with what a report was measured: the date (UTC), the machine (machine()), the code
    (code_version()), CPU count, `settings`, Python, and the __version__ of each package named."""
    return {"measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "code": code_version(), "cpu_count": os.cpu_count(), **settings,
            "python": platform.python_version(),
            **{name: importlib.import_module(name).__version__ for name in packages}}


def proc_field(path: str, name: str) -> str | None:
    """The value of the first `name: value` line of a /proc file; None where there is none (not Linux)."""
    with contextlib.suppress(OSError):
        for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    return None


def machine() -> dict:
    """The machine a figure was measured on: CPU model, logical CPUs (and those this process may run on), memory,
    OS, and the load average at the time; `description` says it in one line."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory_kb = proc_field("/proc/meminfo", "MemTotal")
    memory_gb = round(int(memory_kb.split()[0]) / 1024 ** 2, 1) if memory_kb else None
    cpu = proc_field("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()
    description = (f"{cpu}, {usable} of {os.cpu_count()} logical CPUs usable, "
                   f"{memory_gb if memory_gb is not None else '?'} GB memory, {platform.platform()}")
    return {"description": description, "cpu_model": cpu, "logical_cpus": os.cpu_count(), "usable_cpus": usable,
            "memory_gb": memory_gb, "os": platform.platform(), "load_average": loadavg()}


def code_version() -> dict:
    """The commit the repository was at and whether its tracked files differed from it (a figure measured on
    uncommitted code says so); "unknown" where git or the repository is not there (a copy on another machine)."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    changed = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit or "unknown",
            "uncommitted_changes": None if changed is None or commit is None else bool(changed)}


def read_results(path: Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_json(path, data, ensure_ascii: bool = True) -> Path:
    """data as indented JSON at path (its folder made if missing); the path written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=ensure_ascii) + "\n", encoding="utf-8")
    return path


def write_jsonl(path: Path, records) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
