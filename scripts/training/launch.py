#!/usr/bin/env python
"""torchrun, keeping the bad-input contract through the launcher: every process meets the same bad
input (or the same diverged loss), so each leaves its one-line message in torchrun's error file
(lorakit.core.cli.hand_to_launcher) instead of printing it; when the job failed only on that (the other
processes exited with the same status or were stopped by torchrun after the first), the launcher
prints the first message once and exits with that status (2 for bad input), without torchrun's
traceback and failure report. Any other failure is torchrun's, reported in full.

The command `lorakit launch`; its code and full description: lorakit.commands.launch."""

import sys

try:
    from lorakit.commands.launch import entry_point
except ModuleNotFoundError as missing:
    if missing.name != "lorakit":
        raise
    print(f"error: the lorakit package is not installed for {sys.executable}: run `make install` in the "
          "repository (or `pip install -e .` there)", file=sys.stderr)
    sys.exit(2)

entry_point()
