#!/usr/bin/env python
"""PPO against a reward model with LoRA (DeepSpeed-Chat's step 3, InstructGPT's RL stage).

The command `lorakit ppo`; its code and full description: lorakit.commands.ppo."""

import sys

try:
    from lorakit.commands.ppo import entry_point
except ModuleNotFoundError as missing:
    if missing.name != "lorakit":
        raise
    print(f"error: the lorakit package is not installed for {sys.executable}: run `make install` in the "
          "repository (or `pip install -e .` there)", file=sys.stderr)
    sys.exit(2)

entry_point()
