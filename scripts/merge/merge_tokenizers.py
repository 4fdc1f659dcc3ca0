#!/usr/bin/env python
"""Extend a tokenizer's vocabulary with pieces learned on a corpus (Chinese, or any language).

The command `lorakit merge-tokenizers`; its code: lorakit.commands.merge_tokenizers; its full description:
lorakit.merge.tokenizers."""

import sys

try:
    from lorakit.commands.merge_tokenizers import entry_point
except ModuleNotFoundError as missing:
    if missing.name != "lorakit":
        raise
    print(f"error: the lorakit package is not installed for {sys.executable}: run `make install` in the "
          "repository (or `pip install -e .` there)", file=sys.stderr)
    sys.exit(2)

entry_point()
