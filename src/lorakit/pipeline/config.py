"""The pipeline's YAML file: what it may hold, read and checked as a whole before anything runs.

    base_model: path/to/base            # required: the model every stage chains from
    tokenizer: path/to/tokenizer        # optional (default: the base model's)
    output_dir: outputs/pipeline        # required: stage outputs go to OUTPUT/<stage name>/
                                        # (logs in OUTPUT/logs/, markers in OUTPUT/.pipeline/)
    deployment:                         # optional
      mode: single_node                 # single_gpu | single_node | multi_node
      nproc_per_node: 8                 # default: the GPUs visible (1 without one)
      nnodes: 2                         # multi_node: with node_rank, master_addr, master_port
      deepspeed: ds_configs/ds_zero2_no_offload.json   # every training stage's, unless it names its own
    training_flags: {bf16: true}        # optional: flags of every training stage (a stage's own win)
    stages:                             # run in this order
      - stage: pretraining              # vocabulary | pretraining | sft | reward | ppo | grpo | dpo | merge | chat
        name: pretraining               # optional (default: the kind); OUTPUT/<name>/, unique, not logs
        dataset_dir: data/pt            # any flag of that stage's script, without the dashes
      - stage: chat
        turns: ["你好"]                  # chat only: what the scripted chat check says

Relative paths are taken from the current directory, as on the scripts' own command lines.
Command-line overrides name a key by its path: `sft.learning_rate=1e-4` (a stage by its name),
`deployment.nproc_per_node=4`, `output_dir=/data/run2`; the value is read as YAML.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from lorakit.core.cli import InputError, read_yaml

STAGE_KINDS = ("vocabulary", "pretraining", "sft", "reward", "ppo", "grpo", "dpo", "merge", "chat")
TOP_LEVEL_KEYS = ("base_model", "tokenizer", "output_dir", "deployment", "training_flags", "stages")
MODES = ("single_gpu", "single_node", "multi_node")
DEPLOYMENT_DEFAULTS = {"mode": "single_node", "nproc_per_node": None, "nnodes": 1, "node_rank": 0,
                       "master_addr": "127.0.0.1", "master_port": 29500, "deepspeed": None}
# Keys of a stage entry that are the pipeline's, not flags of the stage's script.
PIPELINE_STAGE_KEYS = {"stage", "name", "turns"}
# Directories of output_dir that are the pipeline's own: a stage of that name would delete or mix with them.
RESERVED_NAMES = ("logs", ".pipeline")


@dataclass
class Deployment:
    mode: str
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    deepspeed: str | None


@dataclass
class StageConfig:
    kind: str
    name: str
    flags: dict[str, Any]  # the user's flags of the stage's script, training_flags folded in
    turns: list[str] = field(default_factory=list)  # chat only


@dataclass
class PipelineConfig:
    path: str
    base_model: str
    tokenizer: str | None
    output_dir: str
    deployment: Deployment
    stages: list[StageConfig]


def load_config(path: str, overrides: list[str]) -> PipelineConfig:
    raw = read_yaml(path, "pipeline config")
    for override in overrides:
        apply_override(raw, override, path)
    unknown = sorted(set(raw) - set(TOP_LEVEL_KEYS))
    if unknown:
        raise InputError(f"{path}: unknown key '{unknown[0]}' (the keys are: {', '.join(TOP_LEVEL_KEYS)})")
    for key in ("base_model", "output_dir", "stages"):
        if not raw.get(key):
            raise InputError(f"{path}: '{key}' is missing")
    for key, value in raw.items():
        if key != "stages" and holds_nul(value):
            raise InputError(f"{path}: '{key}' {HOLDS_NUL}")
    training_flags = mapping_of(raw.get("training_flags") or {}, path, "training_flags")
    return PipelineConfig(path=path, base_model=str(raw["base_model"]),
                          tokenizer=str(raw["tokenizer"]) if raw.get("tokenizer") else None,
                          output_dir=str(raw["output_dir"]),
                          deployment=deployment_of(mapping_of(raw.get("deployment") or {}, path, "deployment"), path),
                          stages=stages_of(raw["stages"], training_flags, path))


def mapping_of(value: Any, path: str, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InputError(f"{path}: '{key}' must be a mapping of names to values")
    return value


def deployment_of(raw: dict[str, Any], path: str) -> Deployment:
    unknown = sorted(set(raw) - set(DEPLOYMENT_DEFAULTS))
    if unknown:
        raise InputError(f"{path}: deployment: unknown key '{unknown[0]}' "
                         f"(the keys are: {', '.join(DEPLOYMENT_DEFAULTS)})")
    values = {**DEPLOYMENT_DEFAULTS, **{key: value for key, value in raw.items() if value is not None}}
    if values["mode"] not in MODES:
        raise InputError(f"{path}: deployment.mode '{values['mode']}' is not one of {', '.join(MODES)}")
    if values["nproc_per_node"] is None:
        values["nproc_per_node"] = 1 if values["mode"] == "single_gpu" else visible_gpus()
    for key in ("nproc_per_node", "nnodes", "node_rank", "master_port"):
        if not isinstance(values[key], int) or isinstance(values[key], bool) or values[key] < 0:
            raise InputError(f"{path}: deployment.{key} must be a whole number, got {values[key]!r}")
    if values["mode"] == "single_gpu" and values["nproc_per_node"] != 1:
        raise InputError(f"{path}: deployment.mode single_gpu runs 1 process, not nproc_per_node "
                         f"{values['nproc_per_node']} (use single_node)")
    if values["mode"] != "multi_node" and values["nnodes"] != 1:
        raise InputError(f"{path}: deployment.nnodes {values['nnodes']} needs deployment.mode multi_node")
    if not values["node_rank"] < values["nnodes"]:
        raise InputError(f"{path}: deployment.node_rank {values['node_rank']} is not below nnodes {values['nnodes']}")
    return Deployment(**values)


def visible_gpus() -> int:
    """What the run_*.sh wrappers default to: the GPUs this process may use, at least 1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return max(1, len([device for device in visible.split(",") if device.strip()]))
    try:
        import torch

        return max(1, torch.cuda.device_count())
    except ImportError:
        return 1


def stages_of(raw: Any, training_flags: dict[str, Any], path: str) -> list[StageConfig]:
    if not isinstance(raw, list):
        raise InputError(f"{path}: 'stages' must be a list of stages")
    stages, names = [], set()
    for number, entry in enumerate(raw, start=1):
        where = f"{path}: stages[{number}]"
        if not isinstance(entry, dict) or "stage" not in entry:
            raise InputError(f"{where}: a stage is a mapping with a 'stage' key ({', '.join(STAGE_KINDS)})")
        kind = entry["stage"]
        if kind not in STAGE_KINDS:
            raise InputError(f"{where}: unknown stage '{kind}' (the stages are: {', '.join(STAGE_KINDS)})")
        name = str(entry.get("name") or kind)
        if any(ord(character) < 32 or ord(character) == 127 for character in name):
            raise InputError(f"{where}: 'name' {name!r} holds a control character: a stage's name is its output "
                             "directory and appears in every line the pipeline writes about it; give it a plain name")
        if name in RESERVED_NAMES:
            raise InputError(f"{where}: stage name '{name}' is reserved: the pipeline keeps its logs in "
                             "output_dir/logs/ and its markers in output_dir/.pipeline/; give the stage another 'name'")
        if name in names or "/" in name or name.startswith(".") or name in (os.curdir, os.pardir):
            raise InputError(f"{where}: stage name '{name}' is used twice or is not a directory name; "
                             "give each stage of the same kind its own 'name'")
        names.add(name)
        turns = entry.get("turns") or []
        if turns and (kind != "chat" or not all(isinstance(turn, str) for turn in turns)):
            raise InputError(f"{where}: 'turns' is a list of strings, for a chat stage only")
        flags = {key: value for key, value in entry.items() if key not in PIPELINE_STAGE_KEYS}
        for key, value in {**training_flags, **flags}.items():
            if holds_nul(value):
                raise InputError(f"{where} ('{name}'): '{key}' {HOLDS_NUL}")
        from_all = training_flags if kind in ("pretraining", "sft", "reward", "ppo", "grpo", "dpo") else {}
        stages.append(StageConfig(kind=kind, name=name, flags={**from_all, **flags}, turns=list(turns)))
    return stages


# Paths and command lines are C strings: open() and the stage's process would fail with a traceback on one.
HOLDS_NUL = "holds a NUL byte, which no path or command line can carry"


def holds_nul(value: Any) -> bool:
    """Whether a string in value (or in its lists and mappings) holds a NUL byte."""
    if isinstance(value, str):
        return "\0" in value
    if isinstance(value, dict):
        return any(holds_nul(key) or holds_nul(item) for key, item in value.items())
    if isinstance(value, list):
        return any(holds_nul(item) for item in value)
    return False


def apply_override(raw: dict[str, Any], text: str, path: str) -> None:
    """`a.b=value` sets raw's key a.b; the first part may name a stage. The value is read as YAML."""
    import yaml

    key_path, separator, value_text = text.partition("=")
    keys = key_path.split(".")
    if not separator or not all(keys):
        raise InputError(f"override '{text}': write it as key=value, e.g. sft.learning_rate=1e-4")
    try:
        value = yaml.safe_load(value_text)
    except yaml.YAMLError:
        raise InputError(f"override '{text}': the value is not valid YAML") from None
    stages = {str(entry.get("name") or entry.get("stage")): entry
              for entry in raw.get("stages") or [] if isinstance(entry, dict)}
    target = stages[keys[0]] if len(keys) > 1 and keys[0] in stages else None
    if target is None:
        target = raw
        for key in keys[:-1]:
            target = target.setdefault(key, {})
            if not isinstance(target, dict):
                raise InputError(f"override '{text}': {path} holds no mapping at '{key}'")
        target[keys[-1]] = value
    else:
        target[".".join(keys[1:])] = value
