"""Inside a child: the runs the parent wrote into --specs, in turn, each result written as it arrives.

Our runs are our stage scripts run unmodified (runpy, as __main__) under a probe (probes.py); TRL's is
trl_sft_runner.py under the same probe; a rollout run times the engines (rollout_probe.py); a preparation writes a
model (and a reward adapter). A run of ours whose flag our script does not have yet is refused by it in one line,
recorded "refused" with that line, and the plan goes on; a run whose needs are not met here (a module, a CUDA GPU) is
"not available"; any other failure is "failed" with its one line.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import runpy
import sys
from contextlib import nullcontext, redirect_stderr
from pathlib import Path
from typing import Any

from measure import REPO, write_json

from .probes import RLProbe, SFTProbe, attach_probe, probe_figures, synchronised_rl_timers
from .rollout_probe import measure_rollout
from .shapes import SEED

SCRIPTS = {kind: REPO / "scripts" / "training" / name
           for kind, name in (("sft", "run_sft_with_peft.py"), ("ppo", "run_ppo.py"), ("grpo", "run_grpo.py"))}
# How our script words a flag it does not have (lorakit.core.cli; argparse's own): such a run is "refused".
UNKNOWN_FLAG_SIGNS = ("is not an argument of", "unrecognized arguments")


class NotAvailable(Exception):
    """What a run needs is not here (a module that does not import, a CUDA GPU)."""


def missing_module(name: str) -> str | None:
    """Why the module does not import here, in words, or None."""
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        return f"{name} is not installed" if err.name == name else f"{name} does not import: {err}"
    except Exception as err:  # noqa: BLE001 - a module that fails to import is not available, whatever the error
        return f"{name} does not import: {type(err).__name__}: {err}"[:300]
    return None


def unmet_need(spec: dict) -> str | None:
    """The first of the run's needs not met here, in words, or None."""
    import torch

    for need in spec.get("requires", []):
        if need == "cuda":
            if spec["on_cpu"] or not torch.cuda.is_available():
                return "needs a CUDA GPU"
            continue
        missing = missing_module(need)
        if missing:
            return missing
    return None


def run_script(spec: dict, run_dir: Path) -> dict:
    """spec's stage script, unmodified, as its own __main__ would run it; the probe's figures."""
    probe = attach_probe((SFTProbe if spec["kind"] == "sft" else RLProbe)(spec))
    script = SCRIPTS[spec["kind"]]
    sys.argv = [str(script), *spec["flags"], "--data_cache_dir", str(run_dir / "data_cache"),
                "--output_dir", str(run_dir / "out")]
    with synchronised_rl_timers() if spec["kind"] != "sft" else nullcontext():
        runpy.run_path(str(script), run_name="__main__")
    return probe_figures(probe)


def run_trl(spec: dict, run_dir: Path) -> dict:
    """TRL's SFTTrainer (trl_sft_runner.py) under the same probe as ours; "not available" without trl or Liger."""
    unmet = unmet_need(spec)
    if unmet:
        raise NotAvailable(unmet)
    from trl_sft_runner import train_with_trl

    probe = attach_probe(SFTProbe(spec))
    train_with_trl(spec["trl"], str(run_dir / "out"))
    return probe_figures(probe)


def prepare_model(spec: dict, run_dir: Path) -> dict:
    """The model (random seeded weights, bf16 on a GPU) and, for PPO, its reward adapter."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    on_gpu = torch.cuda.is_available() and not spec["smoke"]
    fields = dict(spec["config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields, pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(SEED)
    with torch.device("cuda" if on_gpu else "cpu"):
        network = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if on_gpu else torch.float32)
    network.save_pretrained(spec["model_dir"])
    tokenizer.save_pretrained(spec["model_dir"])
    del network
    if spec["reward_dir"]:
        from bench_ppo import write_reward_adapter

        write_reward_adapter(spec["model_dir"], Path(spec["reward_dir"]))
    return {"device": torch.cuda.get_device_name() if on_gpu else f"CPU ({os.cpu_count()} cores)"}


class StderrTail:
    """sys.stderr that also keeps what was written to it last: our script's refusal is one line there."""

    def __init__(self, stream: Any, keep: int = 8000) -> None:
        self.stream, self.keep, self.text = stream, keep, ""

    def write(self, text: str) -> int:
        self.text = (self.text + text)[-self.keep:]
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    def error_line(self) -> str | None:
        """The last line that says "error:" (lorakit.core.cli's and argparse's refusals), or None."""
        return next((line.strip() for line in reversed(self.text.splitlines()) if "error:" in line), None)


def failure(spec: dict, err: BaseException, stderr: StderrTail) -> dict:
    """A run that ended without its figures: refused (our script's exit 2; a flag it does not have yet), not
    available (what it needs is not here), or failed, with the one line that says why."""
    code = err.code if isinstance(err, SystemExit) else None
    said = stderr.error_line() if code is not None else None
    message = said or " ".join(f"{type(err).__name__}: {err}".split())[:500]
    if isinstance(err, NotAvailable):
        return {"status": "not available", "message": str(err)}
    if code == 2 and any(sign in message for sign in UNKNOWN_FLAG_SIGNS):
        return {"status": "refused", "message": f"flag not in this version of our script: {message}"}
    unmet = unmet_need(spec)
    if unmet:
        return {"status": "not available", "message": f"{unmet}; {message}"}
    return {"status": "refused" if code == 2 else "failed", "message": message}


def run_one(spec: dict, run_dir: Path) -> dict:
    """One run's result: its figures with status "done", or why it has none."""
    measure = {"prepare": prepare_model, "rollout": measure_rollout, "trl": run_trl}.get(spec["kind"], run_script)
    stderr = StderrTail(sys.stderr)
    with redirect_stderr(stderr):
        try:
            return {"status": "done", **measure(spec, run_dir)}
        except (Exception, SystemExit) as err:  # noqa: BLE001 - every failure is reported with the run
            return failure(spec, err, stderr)


def run_specs(specs: list, workdir: Path, metrics: Path) -> None:
    """Each spec in turn in this process, the results written after each: a process stopped or crashed later
    keeps what finished."""
    import torch

    results = {}
    for number, spec in enumerate(specs):
        run_dir = workdir / f"run{number}"
        run_dir.mkdir(parents=True)
        results[spec["name"]] = run_one(spec, run_dir)
        write_json(metrics, results)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        result = results[spec["name"]]
        print(f"  {spec['name']}: {result['status']} {result.get('message', '')}", flush=True)


def run_child(args: argparse.Namespace) -> None:
    run_specs(json.loads(Path(args.specs).read_text(encoding="utf-8")), Path(args.workdir), Path(args.metrics))
