#!/usr/bin/env python
"""Continued pretraining of a LLaMA-family model with LoRA (optionally with trainable, resized
embeddings for an extended vocabulary), on every *.txt / *.jsonl file in --dataset_dir.

The command `lorakit pt`; its code and full description: lorakit.commands.pt."""

import sys

try:
    from lorakit.commands.pt import entry_point
except ModuleNotFoundError as missing:
    if missing.name != "lorakit":
        raise
    print(f"error: the lorakit package is not installed for {sys.executable}: run `make install` in the "
          "repository (or `pip install -e .` there)", file=sys.stderr)
    sys.exit(2)

entry_point()
