"""Every command of the toolkit, in one table: the name `lorakit NAME` takes, the command module whose entry_point()
runs it (this package's submodules: a command is the top of the layers, and nothing in the library imports one),
the module that defines its arguments, and the script under scripts/ that users run for it (the design card's file
names, kept). This table is torch-free and import-free, so the console script answers `lorakit --help` at once and
the pipeline and the tests find a stage's modules from the script a command line names."""

import os
from typing import NamedTuple


class Command(NamedTuple):
    module: str  # the command module with entry_point(), lorakit.commands.NAME: nothing in the library imports one
    config: str | None  # where its arguments are defined (ARGUMENT_CLASSES or build_parser()), for the pipeline's
    # flag checks; None for a command the pipeline never runs as a stage
    script: str  # the entry script, relative to the repository root
    summary: str


COMMANDS = {
    "pt": Command("lorakit.commands.pt", "lorakit.trainers.pt_config", "scripts/training/run_clm_pt_with_peft.py",
                  "continued pretraining with LoRA (+ trainable embeddings)"),
    "sft": Command("lorakit.commands.sft", "lorakit.trainers.sft_config", "scripts/training/run_sft_with_peft.py",
                   "supervised fine-tuning with LoRA"),
    "reward": Command("lorakit.commands.reward", "lorakit.trainers.reward_config", "scripts/training/run_reward.py",
                      "pairwise reward model with LoRA"),
    "dpo": Command("lorakit.commands.dpo", "lorakit.trainers.dpo_config", "scripts/training/run_dpo.py",
                   "DPO and its loss variants with LoRA"),
    "ppo": Command("lorakit.commands.ppo", "lorakit.rl.ppo_config", "scripts/training/run_ppo.py",
                   "PPO against the reward model (actor, critic, reference, reward)"),
    "grpo": Command("lorakit.commands.grpo", "lorakit.rl.grpo_config", "scripts/training/run_grpo.py",
                    "GRPO, RLOO and REINFORCE++ with reward functions (group-relative RL)"),
    "merge": Command("lorakit.commands.merge", "lorakit.merge.merge_config", "scripts/merge/merge_llama_with_lora.py",
                     "fold LoRA adapters into the base model"),
    "merge-tokenizers": Command("lorakit.commands.merge_tokenizers", "lorakit.merge.tokenizers_config",
                                "scripts/merge/merge_tokenizers.py", "extend a tokenizer's vocabulary"),
    "chat": Command("lorakit.commands.chat", "lorakit.serve.chat_config", "scripts/inference/chat.py",
                    "chat with a model on the terminal"),
    "serve": Command("lorakit.commands.serve", None, "scripts/inference/openai_api_server.py",
                     "OpenAI-compatible server"),
    "pipeline": Command("lorakit.commands.pipeline", None, "scripts/run_pipeline.py",
                        "the whole path from one YAML config"),
    "estimate-memory": Command("lorakit.commands.estimate_memory", None, "scripts/training/estimate_memory.py",
                               "which ZeRO config and how many GPUs"),
    "launch": Command("lorakit.commands.launch", None, "scripts/training/launch.py",
                      "torchrun that keeps the one-line bad-input contract"),
    "demo": Command("lorakit.commands.demo", None, "scripts/demo/run_demo.py",
                    "the demo: the whole path on a real small model"),
}


# How a process runs a toolkit command: `python -m lorakit NAME ARGS...` (the console script's code, lorakit.__main__),
# the same code as the command's script, and found wherever the package is installed: a plain `pip install .` has
# no scripts/ folder. Also what torchrun's workers run (`torchrun ... -m lorakit NAME ARGS...`).
RUN_AS_MODULE = ["-m", "lorakit"]


def command_line(python: str, name: str) -> list[str]:
    """The process command line that runs command NAME with the interpreter PYTHON (its arguments to follow)."""
    return [python, *RUN_AS_MODULE, name]


def module_of_script(script: str) -> str:
    """The package module behind an entry script, named by its path or file name."""
    name = os.path.basename(script)
    for command in COMMANDS.values():
        if os.path.basename(command.script) == name:
            return command.module
    raise KeyError(f"{script} is not one of the toolkit's entry scripts")
