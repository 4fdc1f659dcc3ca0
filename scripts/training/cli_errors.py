"""The bad-input contract every script keeps: an InputError becomes one line on stderr naming
file, line and field, and exit status 2, with no traceback. Kept free of heavy imports so the
merge tools, which start with torch alone, share it with the training scripts."""

import sys
from typing import Callable


class InputError(Exception):
    """Bad input from the user: reported as one line naming file, line and field, exit status 2."""


def run_cli(main: Callable[[], None]) -> None:
    """Run a script's main(); turn an InputError into one clear line on stderr and exit 2."""
    try:
        main()
    except InputError as err:
        message = " ".join(str(err).split())  # one line, whatever the message's origin
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)
