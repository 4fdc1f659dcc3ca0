"""The console script: `lorakit NAME ARGS...` runs one command with its own arguments, as its script under
scripts/ would (`lorakit sft ...` = `python scripts/training/run_sft_with_peft.py ...`); `lorakit --help` lists
them. Also `python -m lorakit`."""

import importlib
import sys

from lorakit import __version__
from lorakit.commands import COMMANDS


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name:<{width}}  {command.summary} ({command.script})" for name, command in COMMANDS.items()]
    return "\n".join(["usage: lorakit COMMAND [ARGS...]   (lorakit COMMAND --help: the command's arguments)", "",
                      "commands:", *lines])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if argv else 2)
    if argv[0] in ("-V", "--version"):
        print(f"lorakit {__version__}")
        return
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"error: lorakit has no command {argv[0]!r}; the commands: {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(2)
    sys.argv = [f"lorakit {argv[0]}", *argv[1:]]
    importlib.import_module(command.module).entry_point()


if __name__ == "__main__":
    main()
