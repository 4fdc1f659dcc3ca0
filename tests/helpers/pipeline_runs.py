"""Running scripts/run_pipeline.py from the tests: its config written as YAML, the launcher as a process, and the
decision it printed for each stage."""

import json
import os
import subprocess
import sys

import yaml

from helpers.commands import REPO, script_env
from helpers.corpora import CHINESE, ENGLISH

PIPELINE = os.path.join(REPO, "scripts", "run_pipeline.py")
STEPS = {"max_steps": 4, "save_steps": 2, "logging_steps": 1, "learning_rate": 3e-3, "lora_rank": 8,
         "lora_alpha": 16, "lora_dropout": 0.0, "seed": 42, "torch_dtype": "float32", "report_to": "none"}


def words(rng, low, high):
    return " ".join(rng.choice(ENGLISH + CHINESE) for _ in range(rng.randint(low, high)))


def write_jsonl(path, records) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records), encoding="utf-8")
    return str(path)


def write_config(path, config) -> str:
    path.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    return str(path)


def pipeline_command(config_path, *arguments) -> list:
    return [sys.executable, PIPELINE, str(config_path), *map(str, arguments)]


def run_pipeline(config_path, *arguments, timeout=900):
    return subprocess.run(pipeline_command(config_path, *arguments), cwd=REPO, env=script_env(),
                          capture_output=True, text=True, timeout=timeout)


def actions(result) -> dict:
    """{stage name: skip | resume | run} from the pipeline's own lines."""
    found = {}
    for line in result.stdout.splitlines():
        if line.startswith("pipeline: stage '"):
            name = line.split("'")[1]
            found[name] = line.split("): ")[1].split(" ")[0]
    return found
