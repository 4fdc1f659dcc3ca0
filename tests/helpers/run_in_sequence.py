"""Test-only wrapper: `python run_in_sequence.py SCRIPT ARGS_1 ::: ARGS_2 [::: ...]` (or under torchrun) runs the
script's main() once per argument list, one after the other in the same processes, as one run_cli: several short
distributed runs pay for one interpreter start, one torchrun and one rendezvous. Each run parses its own
arguments and builds its own TrainingArguments, which resets accelerate's state and DeepSpeed's config."""

import importlib
import sys

from lorakit.commands import module_of_script
from lorakit.core.cli import run_cli

SEPARATOR = ":::"

script, arguments = sys.argv[1], sys.argv[2:]
runs = [[]]
for argument in arguments:
    if argument == SEPARATOR:
        runs.append([])
    else:
        runs[-1].append(argument)

module = importlib.import_module(module_of_script(script))


def main_of_each_run() -> None:
    for run in runs:
        sys.argv = [script] + run
        module.main()


run_cli(main_of_each_run)
