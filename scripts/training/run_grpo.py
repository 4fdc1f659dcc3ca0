#!/usr/bin/env python
"""Group-relative RL with LoRA: GRPO (Dr. GRPO's and DAPO's losses), RLOO and REINFORCE++ with reward functions.

The command `lorakit grpo`; its code and full description: lorakit.commands.grpo."""

import sys

try:
    from lorakit.commands.grpo import entry_point
except ModuleNotFoundError as missing:
    if missing.name != "lorakit":
        raise
    print(f"error: the lorakit package is not installed for {sys.executable}: run `make install` in the "
          "repository (or `pip install -e .` there)", file=sys.stderr)
    sys.exit(2)

entry_point()
