#!/usr/bin/env python
"""Fold one or more LoRA adapters into their base model, tensor by tensor, in bounded memory.

The command `lorakit merge`; its code and full description: lorakit.commands.merge."""

import sys

try:
    from lorakit.commands.merge import entry_point
except ModuleNotFoundError as missing:
    if missing.name != "lorakit":
        raise
    print(f"error: the lorakit package is not installed for {sys.executable}: run `make install` in the "
          "repository (or `pip install -e .` there)", file=sys.stderr)
    sys.exit(2)

entry_point()
