"""What every script's command line shares: argument parsing, reading a JSON file the user
named, and the bad-input contract (an InputError becomes one line on stderr naming file, line
and field, and exit status 2, with no traceback). Kept free of heavy imports so the merge
tools, which start with torch alone, and the torch-free record readers share it with the
training scripts."""

import argparse
import difflib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar, cast, overload

_N = TypeVar("_N")


class ReportedError(Exception):
    """A stop the user must act on: reported as one line on stderr, no traceback, exit status exit_status."""

    exit_status = 1


class InputError(ReportedError):
    """Bad input from the user: reported as one line naming file, line and field, exit status 2."""

    exit_status = 2


def run_cli(main: Callable[[], None]) -> None:
    """Run a script's main(); turn an InputError (any ReportedError) into one clear line on stderr and exit 2
    (its exit_status)."""
    try:
        main()
        leave_process_group()
    except ReportedError as err:
        message = " ".join(str(err).split())  # one line, whatever the message's origin
        if not hand_to_launcher(message):
            print(f"error: {message}", file=sys.stderr, flush=True)
        if in_process_group() and sys.modules["torch"].distributed.get_world_size() > 1:
            # Mid-run (a diverged loss) the teardown at interpreter exit can abort (see leave_process_group) and
            # turn the reported status into a crash: nothing is left to write, so the process ends at once.
            logging.shutdown()
            sys.stdout.flush()
            os._exit(err.exit_status)
        sys.exit(err.exit_status)


# Set by launch.py for the processes it starts: every rank meets the same bad input (or the same diverged loss),
# so the launcher prints the first one's line once instead of one line per rank.
LAUNCHER_REPORTS_INPUT_ERRORS = "LAUNCHER_REPORTS_INPUT_ERRORS"


def hand_to_launcher(message: str) -> bool:
    """Under launch.py, leave the message in torchrun's per-process error file (the format its elastic agent reads
    into each failure's message) for the launcher to report; False where no launcher will."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file or os.environ.get(LAUNCHER_REPORTS_INPUT_ERRORS) != "1":
        return False
    with open(error_file, "w", encoding="utf-8") as handle:
        json.dump({"message": message, "timestamp": int(time.time())}, handle)
    return True


ARGUMENT_FILE_SUFFIXES = (".json", ".yaml", ".yml")


def parse_args(dataclass_types: type | Iterable[type], argv: Sequence[str] | None = None) -> tuple[Any, ...]:
    """Parse the dataclasses from the command line, optionally led by a .json/.yaml file of
    arguments: `script.py my.yaml --learning_rate 1e-4` takes the file first and lets the command
    line win. The file may also follow the `--local_rank=N` the DeepSpeed launcher puts first."""
    from transformers import HfArgumentParser  # here, not at the top: records and merge import this module torch-free

    argv = sys.argv[1:] if argv is None else list(argv)
    # No prefix abbreviations: argparse would take --learning_rat for --learning_rate without a word.
    # transformers types the argument as DataClassType, a NewType no plain dataclass matches without its wrapper.
    parser = HfArgumentParser(cast(Any, dataclass_types), allow_abbrev=False)
    path, command_line = split_argument_file(argv)
    file_tokens = argument_file_tokens(path, parser) if path else []
    tokens = file_tokens + bare_switch_as_empty(command_line, "--deepspeed")
    refuse_unknown_flags(parser, tokens)
    *parsed, rest = parser.parse_args_into_dataclasses(args=tokens, return_remaining_strings=True)
    if rest:
        raise InputError(f"unexpected argument {rest[0]!r}: arguments are --name value pairs")
    return tuple(parsed)


def bare_switch_as_empty(argv: list[str], flag: str) -> list[str]:
    """DeepSpeed-Chat's scripts take --deepspeed as a bare switch (--zero_stage picks the config); here it
    names a config file. A bare one gets an empty value, which trainers.arguments.map_zero_stage notes."""
    tokens = []
    for index, token in enumerate(argv):
        tokens.append(token)
        if token == flag and (index + 1 == len(argv) or argv[index + 1].startswith("--")):
            tokens.append("")
    return tokens


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the tools that do without HfArgumentParser (the merge tools, the demo): no prefix abbreviations,
    and an argument it does not know is an InputError naming it and the closest known flag, not a usage dump."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    # argparse's own overloads: a namespace passed in comes back filled in, else a new Namespace.
    @overload
    def parse_args(self, args: Sequence[str] | None = None, namespace: None = None) -> argparse.Namespace: ...
    @overload
    def parse_args(self, args: Sequence[str] | None, namespace: _N) -> _N: ...
    @overload
    def parse_args(self, *, namespace: _N) -> _N: ...

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        tokens = sys.argv[1:] if args is None else [str(token) for token in args]
        refuse_unknown_flags(self, tokens)
        parsed, rest = self.parse_known_args(tokens, namespace)
        if rest:
            raise InputError(f"unexpected argument {rest[0]!r}: arguments are --name value pairs")
        return parsed


# argparse's own test for a token that is a value, not a flag, although it starts with "-".
NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def refuse_unknown_flags(parser: argparse.ArgumentParser, tokens: list[str]) -> None:
    """Refuse the first token argparse would read as a flag that parser does not have, before parsing: a misspelled
    flag is named even where the parse would first stop on something it causes (a required flag missing). Tokens
    after a bare "--" are values."""
    for token in tokens:
        if token == "--":
            return
        flag = token.split("=", 1)[0]
        if (len(token) < 2 or token[0] not in parser.prefix_chars or " " in token or NEGATIVE_NUMBER.match(token)
                or token in parser._option_string_actions or flag in parser._option_string_actions):
            continue
        raise unknown_flag_error(parser, flag)


def unknown_flag_error(parser: argparse.ArgumentParser, flag: str, owner: str = "this script") -> InputError:
    """The one line for a flag parser does not know, naming the closest it does (closest_names)."""
    close = closest_names(flag, [option for option in parser._option_string_actions if option.startswith("--")])
    hint = f"did you mean {' or '.join(close)}?" if close else "--help lists them"
    return InputError(f"{flag} is not an argument of {owner} ({hint})")


def closest_names(name: str, known: Iterable[str]) -> list[str]:
    """The known names that name abbreviates (what argparse's prefix matching would have taken it for), shortest
    first, at most three; else the closest by difflib, if one is close; else none."""
    known = sorted(known, key=lambda option: (len(option), option))
    return [option for option in known if option.startswith(name)][:3] or difflib.get_close_matches(name, known, n=1)


class ArgumentFile(NamedTuple):
    """A command line split into its leading argument file (None without one) and the other arguments."""

    path: str | None
    rest: list[str]


def split_argument_file(argv: list[str]) -> ArgumentFile:
    """The argument file (or None) and the other arguments."""
    launcher: list[str] = []
    rest = list(argv)
    while rest and rest[0].startswith("--local_rank"):
        taken = 1 if "=" in rest[0] else 2
        launcher, rest = launcher + rest[:taken], rest[taken:]
    if rest and not rest[0].startswith("-") and rest[0].endswith(ARGUMENT_FILE_SUFFIXES):
        return ArgumentFile(rest[0], launcher + rest[1:])
    return ArgumentFile(None, list(argv))


def argument_file_tokens(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The file's arguments as command-line tokens, so they go through the same parsing (types,
    choices, the old flags' mapping) as typed ones; an unknown name is refused, naming the file."""
    if path.endswith(".json"):
        values = read_json(path, "argument file")
    else:
        values = read_yaml(path, "argument file")
    known = {action.dest for action in parser._actions} - {"help"}
    tokens = []
    for name, value in values.items():
        if name not in known:
            close = closest_names(str(name), known)
            hint = f"did you mean {' or '.join(map(repr, close))}?" if close else "--help lists them"
            raise InputError(f"{path}: field '{name}' is not an argument of this script ({hint})")
        if value is None or value == []:
            continue  # the script's default
        if isinstance(value, dict):
            value = json.dumps(value)
        tokens += [f"--{name}", *(map(str, value) if isinstance(value, list) else [str(value)])]
    return tokens


def read_yaml(path: str, what: str) -> dict[str, Any]:
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


def read_json(path: str, what: str) -> dict[str, Any]:
    """The JSON object in the file at path. A missing, unreadable or invalid file, or one that
    holds something other than an object, is an InputError naming the file; what says which
    file it is to the user ("config.json", "adapter_config.json")."""
    try:
        with open(path, encoding="utf-8-sig") as handle:  # -sig: a byte order mark in front is not JSON's business
            value = json.load(handle)
    except FileNotFoundError:
        raise InputError(f"{path}: {what} does not exist") from None
    except OSError as err:
        raise InputError(f"{path}: cannot read {what} ({err.strerror or err})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: {what} is not valid JSON ({err})") from None
    except RecursionError:  # json's decoder is recursive
        raise InputError(f"{path}: {what} nests lists and objects too deep to read") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: {what} is not a JSON object")
    return value


def in_process_group() -> bool:
    """Whether this process is one rank of an initialized torch.distributed group. torch is looked up, not
    imported: the merge tools never load it."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized()


def leave_process_group() -> None:
    """In a multi-process run, every rank waits for the others at the end, then the process ends
    at once. Left to interpreter exit (or to destroy_process_group), a rank can tear gloo's and
    DeepSpeed's C++ state down while a peer still talks to it and abort ("terminate called
    without an active exception", exit -6) after a complete run, failing the whole torchrun.
    Everything the run writes is on disk once every rank has passed the barrier, so skipping the
    teardown loses nothing."""
    if not in_process_group():
        return
    sys.modules["torch"].distributed.barrier()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
