"""What the two merge tools share: the bad-input contract (one line, exit 2, nothing written),
output-directory rules (refuse what would overwrite; lorakit.core.atomic builds the result in a temporary
sibling and renames it into place when complete); which files make up a tokenizer comes from core.model_files.

InputError, read_json and run_cli come from lorakit.core.cli, which imports nothing heavy: the LoRA merge must
start with torch alone (trainers.common would pull in transformers' 6 s and 500 MB of imports)."""

import logging
import os
import shutil
import sys
from collections.abc import Iterable

from lorakit.core.cli import InputError, read_json, run_cli  # noqa: F401  (re-exported to the merge tools)
from lorakit.core.model_files import tokenizer_files  # noqa: F401  (re-exported to the merge tools)

logger = logging.getLogger(__name__)


def setup_tool_logging() -> None:
    """Progress lines with a timestamp on stdout: a merge tool runs as one process, no ranks."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.INFO, stream=sys.stdout, force=True)


def check_output_dir(output_dir: str, inputs: dict[str, str | None]) -> None:
    """Refuse an output directory that would overwrite a result or an input.

    inputs maps a flag name (for the message) to the directory it names. An existing empty
    directory is accepted (it is replaced by the finished result)."""
    out = os.path.realpath(output_dir)
    for flag, path in inputs.items():
        if path and os.path.realpath(path) == out:
            raise InputError(f"{output_dir}: --output_dir is the same directory as {flag}; "
                             "choose a new directory (inputs are never modified)")
    if os.path.exists(output_dir):
        if not os.path.isdir(output_dir):
            raise InputError(f"{output_dir}: --output_dir exists and is not a directory")
        if os.listdir(output_dir):
            raise InputError(f"{output_dir}: --output_dir exists and is not empty; "
                             "choose a new directory or remove it first")


def code_files(directory: str) -> list[str]:
    """The Python files of a model or tokenizer that ships its own code (config.json's or
    tokenizer_config.json's auto_map, loaded with --trust_remote_code): a merged copy needs them
    beside its config to load at all. The merge copies them and never runs them."""
    return sorted(name for name in os.listdir(directory)
                  if name.endswith(".py") and os.path.isfile(os.path.join(directory, name)))


def copy_files(source_dir: str, names: Iterable[str], target_dir: str) -> None:
    for name in names:
        shutil.copyfile(os.path.join(source_dir, name), os.path.join(target_dir, name))
