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


def parse_args(dataclass_types, argv=None):
    """Parse the dataclasses from the command line, or from a single .json/.yaml file."""
    argv = sys.argv[1:] if argv is None else list(argv)
    from transformers import HfArgumentParser  # here, not at the top: records and merge import this module torch-free

    parser = HfArgumentParser(dataclass_types)
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        path = os.path.abspath(argv[0])
        if not os.path.isfile(path):
            raise InputError(f"{argv[0]}: argument file does not exist")
        if path.endswith(".json"):
            return parser.parse_json_file(path, allow_extra_keys=False)
        return parser.parse_yaml_file(path, allow_extra_keys=False)
    return parser.parse_args_into_dataclasses(args=argv)


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
