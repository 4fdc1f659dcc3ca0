#!/usr/bin/env python
"""Pairwise reward model with LoRA (DeepSpeed-Chat's step 2): the base or SFT-merged causal LM
loaded as a sequence classifier with one output, trained so that the chosen answer of each
pair scores above the rejected one.

The command `lorakit reward`; its code and full description: lorakit.commands.reward."""

import sys

try:
    from lorakit.commands.reward import entry_point
except ModuleNotFoundError as missing:
    if missing.name != "lorakit":
        raise
    print(f"error: the lorakit package is not installed for {sys.executable}: run `make install` in the "
          "repository (or `pip install -e .` there)", file=sys.stderr)
    sys.exit(2)

entry_point()
