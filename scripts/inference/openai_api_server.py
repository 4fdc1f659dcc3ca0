#!/usr/bin/env python
"""An OpenAI-compatible HTTP server for a merged model, or a base model + LoRA adapter.

The command `lorakit serve`; its code and full description: lorakit.commands.serve."""

import sys

try:
    from lorakit.commands.serve import entry_point
except ModuleNotFoundError as missing:
    if missing.name != "lorakit":
        raise
    print(f"error: the lorakit package is not installed for {sys.executable}: run `make install` in the "
          "repository (or `pip install -e .` there)", file=sys.stderr)
    sys.exit(2)

entry_point()
