"""What every script's command line shares: argument parsing, reading a JSON file the user
named, and the bad-input contract (an InputError becomes one line on stderr naming file, line
and field, and exit status 2, with no traceback). Kept free of heavy imports so the merge
tools, which start with torch alone, and the torch-free record readers share it with the
training scripts."""

import json
import logging
import os
import sys
from typing import Callable


class InputError(Exception):
    """Bad input from the user: reported as one line naming file, line and field, exit status 2."""


def run_cli(main: Callable[[], None]) -> None:
    """Run a script's main(); turn an InputError into one clear line on stderr and exit 2."""
    try:
        main()
        leave_process_group()
    except InputError as err:
        message = " ".join(str(err).split())  # one line, whatever the message's origin
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


ARGUMENT_FILE_SUFFIXES = (".json", ".yaml", ".yml")


def parse_args(dataclass_types, argv=None):
    """Parse the dataclasses from the command line, optionally led by a .json/.yaml file of
    arguments: `script.py my.yaml --learning_rate 1e-4` takes the file first and lets the command
    line win. The file may also follow the `--local_rank=N` the DeepSpeed launcher puts first."""
    from transformers import HfArgumentParser  # here, not at the top: records and merge import this module torch-free

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = HfArgumentParser(dataclass_types)
    path, command_line = split_argument_file(argv)
    file_tokens = argument_file_tokens(path, parser) if path else []
    return parser.parse_args_into_dataclasses(args=file_tokens + command_line)


def split_argument_file(argv: list) -> tuple:
    """(argument file or None, the other arguments)."""
    launcher = []
    rest = list(argv)
    while rest and rest[0].startswith("--local_rank"):
        taken = 1 if "=" in rest[0] else 2
        launcher, rest = launcher + rest[:taken], rest[taken:]
    if rest and not rest[0].startswith("-") and rest[0].endswith(ARGUMENT_FILE_SUFFIXES):
        return rest[0], launcher + rest[1:]
    return None, list(argv)


def argument_file_tokens(path: str, parser) -> list:
    """The file's arguments as command-line tokens, so they go through the same parsing (types,
    choices, the old flags' mapping) as typed ones; an unknown name is refused, naming the file."""
    if path.endswith(".json"):
        values = read_json(path, "argument file")
    else:
        values = read_yaml(path, "argument file")
    known = {action.dest for action in parser._actions}
    tokens = []
    for name, value in values.items():
        if name not in known:
            raise InputError(f"{path}: field '{name}' is not an argument of this script")
        if value is None or value == []:
            continue  # the script's default
        if isinstance(value, dict):
            value = json.dumps(value)
        tokens += [f"--{name}", *(map(str, value) if isinstance(value, list) else [str(value)])]
    return tokens


def read_yaml(path: str, what: str) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            value = yaml.safe_load(handle)
    except FileNotFoundError:
        raise InputError(f"{path}: {what} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: cannot read {what} ({err})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise InputError(f"{path}{line}: {what} is not valid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: {what} must hold a mapping of argument names to values")
    return value


def read_json(path: str, what: str) -> dict:
    """The JSON object in the file at path. A missing, unreadable or invalid file, or one that
    holds something other than an object, is an InputError naming the file; what says which
    file it is to the user ("config.json", "adapter_config.json")."""
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except FileNotFoundError:
        raise InputError(f"{path}: {what} does not exist") from None
    except OSError as err:
        raise InputError(f"{path}: cannot read {what} ({err.strerror or err})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: {what} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: {what} is not a JSON object")
    return value


def leave_process_group() -> None:
    """In a multi-process run, every rank waits for the others at the end, then the process ends
    at once. Left to interpreter exit (or to destroy_process_group), a rank can tear gloo's and
    DeepSpeed's C++ state down while a peer still talks to it and abort ("terminate called
    without an active exception", exit -6) after a complete run, failing the whole torchrun.
    Everything the run writes is on disk once every rank has passed the barrier, so skipping the
    teardown loses nothing. torch is looked up, not imported: the merge tools never load it."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return
    torch.distributed.barrier()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
