#!/usr/bin/env python
"""Take a model through the whole path in one command: vocabulary extension, continued
pretraining, merge, SFT, reward model, PPO, merge, chat check -- each stage through its own
script (under torchrun for the training stages), chained on the previous stage's output.

The command `lorakit pipeline`; its code and full description: lorakit.commands.pipeline."""

import sys

try:
    from lorakit.commands.pipeline import entry_point
except ModuleNotFoundError as missing:
    if missing.name != "lorakit":
        raise
    print(f"error: the lorakit package is not installed for {sys.executable}: run `make install` in the "
          "repository (or `pip install -e .` there)", file=sys.stderr)
    sys.exit(2)

entry_point()
