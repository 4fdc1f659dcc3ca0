"""What each stage of the pipeline runs, and how stages chain: every stage's command is the
stage's own command (`python -m lorakit sft ...`, the code of scripts/training/run_sft_with_peft.py) with the
flags a user would type, the inputs filled in from what earlier
stages produced (vocabulary -> tokenizer, pretraining/SFT/PPO -> an adapter on the current
model, DPO -> its adapter after the one it started from, merge -> a new current model, reward ->
the reward adapter PPO scores with).

Everything here is checked before any stage runs: unknown flags (against the script's own
argument parser), missing files, and a stage whose input no earlier stage produces."""

from __future__ import annotations

import argparse
import difflib
import functools
import hashlib
import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NamedTuple

from lorakit.commands import COMMANDS, RUN_AS_MODULE, command_line
from lorakit.core.cli import InputError
from lorakit.pipeline.config import Deployment, PipelineConfig, StageConfig


@dataclass(frozen=True)
class Script:
    command: str  # the stage's command in lorakit.commands.COMMANDS: its script and package module
    distributed: bool  # runs under torchrun with the deployment's processes

    @property
    def path(self) -> str:
        """The entry script, relative to the repository."""
        return COMMANDS[self.command].script


SCRIPTS = {
    "vocabulary": Script("merge-tokenizers", False),
    "pretraining": Script("pt", True),
    "sft": Script("sft", True),
    "reward": Script("reward", True),
    "ppo": Script("ppo", True),
    "grpo": Script("grpo", True),
    "dpo": Script("dpo", True),
    "merge": Script("merge", False),
    "chat": Script("chat", False),
}
# The adapter directory each training stage writes into its output_dir.
ADAPTER_DIRS = {"pretraining": "pt_lora_model", "sft": "sft_lora_model", "reward": "rm_lora_model",
                "ppo": "ppo_lora_model", "grpo": "grpo_lora_model", "dpo": "dpo_lora_model"}
# Flags the pipeline owns: it decides where each stage writes and what reruns.
OWNED_FLAGS = ("output_dir", "overwrite_output_dir")
# Flags naming a file or directory that must exist before anything runs (comma lists allowed).
PATH_FLAGS = ("dataset_dir", "validation_file", "train_corpus", "extra_sp_model", "eval_corpus", "deepspeed",
              "model_name_or_path", "tokenizer_name_or_path", "peft_path", "actor_model_name_or_path",
              "actor_lora_model", "reward_model_name_or_path", "reward_lora_model", "critic_model_name_or_path",
              "sft_only_data_path", "data_path", "data_file", "base_model", "lora_model", "sft_answers_file")
CHAT_DEFAULTS = {"temperature": 0, "max_new_tokens": 48}
# {"model" | "adapter" | "tokenizer" | "reward": the name of the stage that produced the chain's current one, or None}
Producers = dict[str, str | None]


class RewardModel(NamedTuple):
    """The reward model a reward stage left for PPO to score with."""

    model: str  # its base model (the reward stage's output itself when trained in full)
    adapter: str | None  # the reward adapter on it, None when trained in full


@dataclass
class Chain:
    """What the stages so far produced, for the next stage to start from."""

    model: str
    tokenizer: str | None  # a tokenizer other than the model's own (the config's, or a vocabulary stage's)
    adapter: str | None = None  # trained on `model`, not merged yet; after DPO "sft adapter,dpo adapter"
    reward: RewardModel | None = None
    extended: bool = False  # the tokenizer came from a vocabulary stage and has reached no model yet


@dataclass
class PlannedStage:
    config: StageConfig
    out_dir: str
    command: list[str]
    flags_hash: str  # this stage's flags and every earlier stage's flags hash (the base model's path included)
    distributed: bool
    stdin: str | None = None  # the chat stage's scripted turns
    product_dirs: list[str] = field(default_factory=list)  # what the next stages read, under out_dir
    input_paths: list[str] = field(default_factory=list)  # the data files and models its own flags name
    config_hash: str = ""  # flags_hash and the contents of every input path so far (hash_contents)


def plan_stages(config: PipelineConfig, python: str) -> list[PlannedStage]:
    """Every stage's command, in order; refuses (InputError) any stage that cannot run."""
    check_paths(config.path, "", {"base_model": config.base_model, "tokenizer": config.tokenizer,
                                  "deepspeed": config.deployment.deepspeed})
    chain = Chain(model=config.base_model, tokenizer=config.tokenizer)
    producers: Producers = {"model": None, "adapter": None, "tokenizer": None, "reward": None}
    upstream_hash = digest({"base_model": config.base_model, "tokenizer": config.tokenizer})
    planned = []
    for stage in config.stages:
        where = f"{config.path}: stage '{stage.name}'"
        script = SCRIPTS[stage.kind]
        check_flags(stage, script, where)
        check_paths(config.path, f" stage '{stage.name}':", stage.flags)
        out_dir = os.path.join(config.output_dir, stage.name)
        pipeline_flags = WIRING[stage.kind](chain, stage, out_dir, where, producers)
        flags = {**pipeline_flags, **stage.flags}
        if stage.kind != "chat":  # the chat check writes its transcript from here, not through chat.py
            flags["output_dir"] = out_dir
        if script.distributed and "deepspeed" not in flags and config.deployment.deepspeed:
            flags["deepspeed"] = config.deployment.deepspeed
        upstream_hash = digest({"kind": stage.kind, "flags": stage.flags, "turns": stage.turns,
                                "upstream": upstream_hash})
        command = stage_program(python, script, config.deployment) + argv_of(flags, hf_parser(stage.kind))
        stdin = "".join(turn + "\n" for turn in stage.turns) + "/quit\n" if stage.kind == "chat" else None
        planned.append(PlannedStage(stage, out_dir, command, upstream_hash, script.distributed, stdin,
                                    product_dirs_of(stage, out_dir), paths_named(stage.flags)))
    return planned


def product_dirs_of(stage: StageConfig, out_dir: str) -> list[str]:
    """The directories of out_dir the next stages read: a training stage's adapter (its whole model when trained
    in full), the tokenizer, merged model or transcript the other stages write at its top."""
    if stage.kind in ADAPTER_DIRS and not stage.flags.get("full_finetuning"):
        return [os.path.join(out_dir, ADAPTER_DIRS[stage.kind])]
    return [out_dir]


def paths_named(flags: dict[str, Any]) -> list[str]:
    """The files and directories flags name (PATH_FLAGS; comma lists split; a reward function's file), in order."""
    paths = []
    for flag, value in flags.items():
        if flag in PATH_FLAGS + ("tokenizer",) and value not in (None, "", []):
            values = value if isinstance(value, list) else str(value).split(",")
            paths += [path for path in (str(item).strip() for item in values) if path]
    paths += reward_function_files(flags)
    return paths


def reward_function_files(flags: dict[str, Any]) -> list[str]:
    """The files of a GRPO stage's `path/to/file.py:function` reward functions (an edit of one reruns the stage)."""
    value = flags.get("reward_funcs") or []
    names = value if isinstance(value, list) else str(value).split()
    return [name.rpartition(":")[0] for name in map(str, names) if name.rpartition(":")[0].endswith(".py")]


def hash_contents(planned: list[PlannedStage], config: PipelineConfig, fingerprint: Callable[[str], str]) -> None:
    """Fill in each stage's config_hash: its flags hash and the contents of the base model, the tokenizer and every
    data file and model the stages up to it name, so an edited record or a model replaced in place reruns the
    stage that reads it and every stage after it. fingerprint: a file's content hash (a FingerprintMemo, which
    reads a file once and then only stats it until it changes)."""
    contents = digest(contents_of(paths_named({"base_model": config.base_model, "tokenizer": config.tokenizer}),
                                  fingerprint))
    for stage in planned:
        contents = digest({"upstream": contents, "files": contents_of(stage.input_paths, fingerprint)})
        stage.config_hash = digest({"flags": stage.flags_hash, "contents": contents})


def contents_of(paths: list[str], fingerprint: Callable[[str], str]) -> dict[str, Any]:
    """{path: its fingerprint, or for a directory {file under it: fingerprint}}; hidden files and directories
    (.git, .cache) are left out, and so is anything missing (the plan refused it already)."""
    contents: dict[str, Any] = {}
    for path in paths:
        if os.path.isfile(path):
            contents[path] = fingerprint(path)
        elif os.path.isdir(path):
            files = {}
            for root, directories, names in os.walk(path, followlinks=True):
                directories[:] = sorted(name for name in directories if not name.startswith("."))
                for name in sorted(name for name in names if not name.startswith(".")):
                    if os.path.isfile(os.path.join(root, name)):  # not a dangling link
                        files[os.path.relpath(os.path.join(root, name), path)] = fingerprint(os.path.join(root, name))
            contents[path] = files
    return contents


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def stage_program(python: str, script: Script, deployment: Deployment) -> list[str]:
    """The command line up to the stage's flags: the stage's command, under the launcher (torchrun keeping exit 2)
    with the deployment's processes when it is distributed."""
    if not script.distributed:
        return command_line(python, script.command)
    return [*command_line(python, "launch"), *launcher_arguments(deployment), *RUN_AS_MODULE, script.command]


def launcher_arguments(deployment: Deployment) -> list[str]:
    """torchrun's options for the deployment."""
    arguments = ["--nproc_per_node", str(deployment.nproc_per_node)]
    if deployment.mode == "multi_node":
        return arguments + ["--nnodes", str(deployment.nnodes), "--node_rank", str(deployment.node_rank),
                            "--master_addr", deployment.master_addr, "--master_port", str(deployment.master_port)]
    return arguments + ["--standalone"]


def argv_of(flags: dict[str, Any], hf: bool) -> list[str]:
    """Flags as the script's command line. False is spelled out for HfArgumentParser's booleans and
    left out for argparse's store_true switches, whose default it is."""
    argv = []
    for name, value in flags.items():
        if value is None or (value is False and not hf):
            continue
        if value is True:
            argv.append(f"--{name}")
        elif isinstance(value, list):
            argv += [f"--{name}", *map(str, value)]
        elif isinstance(value, dict):
            argv += [f"--{name}", json.dumps(value)]
        else:
            argv += [f"--{name}", str(value)]
    return argv


# ----------------------------------------------------------------------------- flag and file checks


def script_module(kind: str) -> ModuleType:
    """The module that defines the stage's arguments: its argument classes or parser (never the command module,
    never the script)."""
    config = COMMANDS[SCRIPTS[kind].command].config
    assert config is not None, f"the {kind} stage's command names no argument module"
    return importlib.import_module(config)


def hf_parser(kind: str) -> bool:
    return SCRIPTS[kind].path.startswith("scripts/training") or kind == "chat"


@functools.cache  # two merge stages ask once
def flag_actions(kind: str) -> dict[str, argparse.Action]:
    """The options the stage's script accepts, by name, each with what it takes, from its own argument parser."""
    module = script_module(kind)
    if hasattr(module, "build_parser"):
        parser = module.build_parser()
    else:
        from transformers import HfArgumentParser

        parser = HfArgumentParser(module.ARGUMENT_CLASSES)
    return {option[2:]: action for option, action in parser._option_string_actions.items() if option.startswith("--")}


def known_flags(kind: str) -> set[str]:
    """The option names the stage's script accepts."""
    return set(flag_actions(kind))


def check_flags(stage: StageConfig, script: Script, where: str) -> None:
    for flag in stage.flags:
        if flag in OWNED_FLAGS:
            raise InputError(f"{where}: '{flag}' is the pipeline's: stage outputs go to output_dir/{stage.name}/, "
                             "and a changed config reruns the stage")
    unknown = sorted(set(stage.flags) - known_flags(stage.kind))
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known_flags(stage.kind)), n=1)
        hint = f"did you mean '{close[0]}'?" if close else "see its --help"
        raise InputError(f"{where}: '{unknown[0]}' is not a flag of {script.path} ({hint})")
    for flag, value in stage.flags.items():
        check_value(flag, value, flag_actions(stage.kind)[flag], where)


# A list is one value per item on the command line (argv_of): only options that take several accept it.
TAKES_SEVERAL = ("+", "*")


def check_value(flag: str, value: Any, action: argparse.Action, where: str) -> None:
    """Refuse a value the stage's own parser would refuse, as the stage's command line (argv_of) would spell it: a
    list where one value belongs, a value for a switch, or one its type or choices do not take. Caught here, it is
    the config's one line before anything runs, not a stage failing after the stages before it ran."""
    if value is None:
        return
    if action.nargs == 0:  # argparse's store_true: given or not
        if not isinstance(value, bool):
            raise InputError(f"{where}: '{flag}' is a switch: true or false, not {value!r}")
        return
    if isinstance(value, list) and action.nargs not in TAKES_SEVERAL and not isinstance(action.nargs, int):
        raise InputError(f"{where}: '{flag}' takes one value, not a list ({value!r})")
    if value is True and action.nargs != "?":  # spelled as the bare flag, which only an optional value allows
        raise InputError(f"{where}: '{flag}' takes a value, not true")
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, (list, dict)) and isinstance(value, list):
            raise InputError(f"{where}: '{flag}' takes a list of values, not of lists or mappings ({value!r})")
        check_one_value(flag, item, action, where)


def check_one_value(flag: str, item: Any, action: argparse.Action, where: str) -> None:
    """item, as argv_of writes it, converted by the option's type and found among its choices."""
    if item is True:
        return
    text = json.dumps(item) if isinstance(item, dict) else str(item)
    try:
        converted = action.type(text) if callable(action.type) else text
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        kind = getattr(action.type, "__name__", "a value of its type")
        raise InputError(f"{where}: '{flag}' takes {NUMBER_TYPES.get(kind, kind)}, not {item!r}") from None
    if action.choices is not None and converted not in action.choices:
        raise InputError(f"{where}: '{flag}' is one of {', '.join(map(str, action.choices))}, not {item!r}")


NUMBER_TYPES = {"int": "a whole number", "float": "a number"}


def check_paths(config_path: str, where: str, flags: dict[str, Any]) -> None:
    for flag, value in flags.items():
        if flag not in PATH_FLAGS + ("tokenizer",) or value in (None, "", []):
            continue
        values = value if isinstance(value, list) else str(value).split(",")
        for path in (str(item).strip() for item in values):
            if path and not os.path.exists(path):
                raise InputError(f"{config_path}:{where} {flag} {path} does not exist")
    for path in reward_function_files(flags):
        if not os.path.isfile(path):
            raise InputError(f"{config_path}:{where} reward_funcs {path} does not exist")


# ----------------------------------------------------------------------------- chaining


def needs_merged_model(chain: Chain, where: str, producers: Producers) -> None:
    if chain.adapter:
        raise InputError(f"{where}: starts from a model, but stage '{producers['adapter']}' left an adapter "
                         "unmerged: put a merge stage before it")


def needs_one_adapter(chain: Chain, where: str, producers: Producers) -> None:
    """A stage that takes the current adapter as one directory: after DPO there are two (the SFT adapter it
    started from, then its own), which only a merge applies."""
    if chain.adapter and "," in chain.adapter:
        raise InputError(f"{where}: takes one adapter, but stage '{producers['adapter']}' left two unmerged "
                         f"({chain.adapter}): put a merge stage before it")


def training_flags(chain: Chain) -> dict[str, Any]:
    flags = {"model_name_or_path": chain.model, "do_train": True}
    if chain.tokenizer:
        flags["tokenizer_name_or_path"] = chain.tokenizer
    return flags


def wire_vocabulary(chain: Chain, stage: StageConfig, out_dir: str, where: str, producers: Producers) -> dict[str, Any]:
    flags = {"base_tokenizer": chain.tokenizer or chain.model}
    chain.tokenizer, chain.extended = out_dir, True
    producers["tokenizer"] = stage.name
    return flags


def wire_adapter_training(chain: Chain, stage: StageConfig, out_dir: str, where: str,
                          producers: Producers) -> dict[str, Any]:
    """Pretraining and SFT: a new adapter on the current (merged) model."""
    needs_merged_model(chain, where, producers)
    if chain.extended and not (stage.flags.get("modules_to_save") or stage.flags.get("full_finetuning")):
        raise InputError(f"{where}: the tokenizer of stage '{producers['tokenizer']}' adds tokens whose embedding "
                         "rows would never be trained: give this stage modules_to_save (e.g. embed_tokens,lm_head)")
    flags = training_flags(chain)
    if stage.flags.get("full_finetuning"):
        chain.model, chain.tokenizer = out_dir, None
        producers["model"] = stage.name
    else:
        chain.adapter = os.path.join(out_dir, ADAPTER_DIRS[stage.kind])
        producers["adapter"] = stage.name
    chain.extended = False
    return flags


def wire_reward(chain: Chain, stage: StageConfig, out_dir: str, where: str, producers: Producers) -> dict[str, Any]:
    """The reward model starts from the current model (the SFT adapter's base, so PPO can put every
    role on one base) unless the stage names its own model_name_or_path."""
    flags = training_flags(chain)
    base = stage.flags.get("model_name_or_path", chain.model)
    adapter = None if stage.flags.get("full_finetuning") else os.path.join(out_dir, ADAPTER_DIRS["reward"])
    chain.reward = RewardModel(out_dir, None) if adapter is None else RewardModel(base, adapter)
    producers["reward"] = stage.name
    return flags


def wire_ppo(chain: Chain, stage: StageConfig, out_dir: str, where: str, producers: Producers) -> dict[str, Any]:
    if chain.reward is None and "reward_model_name_or_path" not in stage.flags:
        raise InputError(f"{where}: PPO needs a reward model: put a reward stage before it, "
                         "or give reward_model_name_or_path")
    needs_one_adapter(chain, where, producers)
    flags = {"actor_model_name_or_path": chain.model, "actor_lora_model": chain.adapter}
    if chain.reward is not None:
        flags.update(reward_model_name_or_path=chain.reward.model, reward_lora_model=chain.reward.adapter)
    if chain.tokenizer:
        flags["tokenizer_name_or_path"] = chain.tokenizer
    chain.adapter = os.path.join(out_dir, ADAPTER_DIRS["ppo"])  # it continues the actor's adapter
    producers["adapter"] = stage.name
    return flags


def wire_grpo(chain: Chain, stage: StageConfig, out_dir: str, where: str, producers: Producers) -> dict[str, Any]:
    """GRPO continues the current adapter (SFT's) on the current model; its reward: the stage's reward_funcs, else
    the reward stage's adapter (on the same base), else it is refused."""
    needs_one_adapter(chain, where, producers)
    flags = training_flags(chain)
    if chain.adapter:
        flags["peft_path"] = chain.adapter
    if not stage.flags.get("reward_funcs") and "reward_lora_model" not in stage.flags:
        if chain.reward is None or chain.reward.adapter is None:
            raise InputError(f"{where}: GRPO needs a reward: give reward_funcs (e.g. exact_match), or put a reward "
                             "stage (LoRA, on the same model) before it")
        flags.update(reward_model_name_or_path=chain.reward.model, reward_lora_model=chain.reward.adapter)
    chain.adapter = os.path.join(out_dir, ADAPTER_DIRS["grpo"])  # it continues the current adapter
    producers["adapter"] = stage.name
    return flags


def wire_dpo(chain: Chain, stage: StageConfig, out_dir: str, where: str, producers: Producers) -> dict[str, Any]:
    """The policy and its reference are the current model with the current adapter (SFT's) folded in; a new
    LoRA trains on top, so the chain's adapter becomes both, in order, as the merge tool applies them."""
    needs_one_adapter(chain, where, producers)
    flags = training_flags(chain)
    if chain.adapter:
        flags["peft_path"] = chain.adapter
    if stage.flags.get("full_finetuning"):  # the whole model, the folded adapter included
        chain.model, chain.adapter, chain.tokenizer = out_dir, None, None
        producers["model"], producers["adapter"] = stage.name, None
    else:
        chain.adapter = ",".join(filter(None, (chain.adapter, os.path.join(out_dir, ADAPTER_DIRS["dpo"]))))
        producers["adapter"] = stage.name
    return flags


def wire_merge(chain: Chain, stage: StageConfig, out_dir: str, where: str, producers: Producers) -> dict[str, Any]:
    if not chain.adapter:
        raise InputError(f"{where}: nothing to merge: no earlier stage left an adapter "
                         "(pretraining, sft, ppo, grpo or dpo)")
    flags = {"base_model": chain.model, "lora_model": chain.adapter}
    # The adapter directory carries the tokenizer it was trained with (an extended vocabulary too);
    # the merge writes it into the merged model.
    chain.model, chain.adapter, chain.tokenizer = out_dir, None, None
    producers["model"], producers["adapter"], producers["tokenizer"] = stage.name, None, None
    return flags


def wire_chat(chain: Chain, stage: StageConfig, out_dir: str, where: str, producers: Producers) -> dict[str, Any]:
    if not stage.turns:
        raise InputError(f"{where}: a chat stage needs 'turns', what the scripted chat says")
    needs_one_adapter(chain, where, producers)
    return {"base_model": chain.model, "lora_model": chain.adapter, **CHAT_DEFAULTS}


WIRING = {"vocabulary": wire_vocabulary, "pretraining": wire_adapter_training, "sft": wire_adapter_training,
          "reward": wire_reward, "ppo": wire_ppo, "grpo": wire_grpo, "dpo": wire_dpo, "merge": wire_merge,
          "chat": wire_chat}
