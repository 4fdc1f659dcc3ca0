#!/usr/bin/env python
"""Direct preference optimisation with LoRA (DPO and its variants: IPO, hinge, robust, SimPO, ORPO,
RPO's NLL term): the SFT model learns from preference pairs without a reward model or PPO. The
policy is the SFT model (a merged SFT model, or the base with --peft_path SFT_ADAPTER folded in in
memory) with a new LoRA; the reference is the same model with that LoRA disabled.

The command `lorakit dpo`; its code and full description: lorakit.commands.dpo."""

import sys

try:
    from lorakit.commands.dpo import entry_point
except ModuleNotFoundError as missing:
    if missing.name != "lorakit":
        raise
    print(f"error: the lorakit package is not installed for {sys.executable}: run `make install` in the "
          "repository (or `pip install -e .` there)", file=sys.stderr)
    sys.exit(2)

entry_point()
