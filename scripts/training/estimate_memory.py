#!/usr/bin/env python
"""How much GPU and CPU memory a LoRA or QLoRA run needs under each ZeRO config we ship, from
DeepSpeed's own estimators, for the user's model and GPU count; reads only config.json.

The command `lorakit estimate-memory`; its code and full description: lorakit.commands.estimate_memory."""

import sys

try:
    from lorakit.commands.estimate_memory import entry_point
except ModuleNotFoundError as missing:
    if missing.name != "lorakit":
        raise
    print(f"error: the lorakit package is not installed for {sys.executable}: run `make install` in the "
          "repository (or `pip install -e .` there)", file=sys.stderr)
    sys.exit(2)

entry_point()
