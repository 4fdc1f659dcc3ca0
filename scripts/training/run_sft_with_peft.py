#!/usr/bin/env python
"""Supervised fine-tuning with LoRA on conversations (alpaca, sharegpt or messages records),
loss on the assistant answers only, optionally packed into padding-free rows.

The command `lorakit sft`; its code and full description: lorakit.commands.sft."""

import sys

try:
    from lorakit.commands.sft import entry_point
except ModuleNotFoundError as missing:
    if missing.name != "lorakit":
        raise
    print(f"error: the lorakit package is not installed for {sys.executable}: run `make install` in the "
          "repository (or `pip install -e .` there)", file=sys.stderr)
    sys.exit(2)

entry_point()
