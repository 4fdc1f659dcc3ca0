#!/usr/bin/env python
"""Chat with a merged model, or a base model + LoRA adapter, in the terminal; or answer a file of
prompts in batches.

The command `lorakit chat`; its code and full description: lorakit.commands.chat."""

import sys

try:
    from lorakit.commands.chat import entry_point
except ModuleNotFoundError as missing:
    if missing.name != "lorakit":
        raise
    print(f"error: the lorakit package is not installed for {sys.executable}: run `make install` in the "
          "repository (or `pip install -e .` there)", file=sys.stderr)
    sys.exit(2)

entry_point()
