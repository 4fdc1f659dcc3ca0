"""Every command of the toolkit, in one table: the name `lorakit NAME` takes, the package module whose
entry_point() runs it, and the script under scripts/ that users run for it (the design card's file names, kept).
Torch-free and import-free, so the console script answers `lorakit --help` at once and the pipeline and the tests
find a stage's module from the script a command line names."""

import os
from typing import NamedTuple


class Command(NamedTuple):
    module: str  # the package module with entry_point() (and, for a training stage, ARGUMENT_CLASSES)
    script: str  # the entry script, relative to the repository root
    summary: str


COMMANDS = {
    "pt": Command("lorakit.trainers.pt", "scripts/training/run_clm_pt_with_peft.py",
                  "continued pretraining with LoRA (+ trainable embeddings)"),
    "sft": Command("lorakit.trainers.sft", "scripts/training/run_sft_with_peft.py",
                   "supervised fine-tuning with LoRA"),
    "reward": Command("lorakit.trainers.reward", "scripts/training/run_reward.py", "pairwise reward model with LoRA"),
    "dpo": Command("lorakit.trainers.dpo", "scripts/training/run_dpo.py", "DPO and its loss variants with LoRA"),
    "ppo": Command("lorakit.rl.ppo", "scripts/training/run_ppo.py",
                   "PPO against the reward model (actor, critic, reference, reward)"),
    "grpo": Command("lorakit.rl.grpo", "scripts/training/run_grpo.py",
                    "GRPO, RLOO and REINFORCE++ with reward functions (group-relative RL)"),
    "merge": Command("lorakit.merge.lora", "scripts/merge/merge_llama_with_lora.py",
                     "fold LoRA adapters into the base model"),
    "merge-tokenizers": Command("lorakit.merge.tokenizers", "scripts/merge/merge_tokenizers.py",
                                "extend a tokenizer's vocabulary"),
    "chat": Command("lorakit.serve.chat", "scripts/inference/chat.py", "chat with a model on the terminal"),
    "serve": Command("lorakit.serve.openai_api", "scripts/inference/openai_api_server.py",
                     "OpenAI-compatible server"),
    "pipeline": Command("lorakit.pipeline.launcher", "scripts/run_pipeline.py",
                        "the whole path from one YAML config"),
    "estimate-memory": Command("lorakit.models.estimate_memory", "scripts/training/estimate_memory.py",
                               "which ZeRO config and how many GPUs"),
    "launch": Command("lorakit.trainers.launch", "scripts/training/launch.py",
                      "torchrun that keeps the one-line bad-input contract"),
    "demo": Command("lorakit.demo.run_demo", "scripts/demo/run_demo.py",
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
