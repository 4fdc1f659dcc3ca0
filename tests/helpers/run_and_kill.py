"""Test-only wrapper: runs a training script as `python run_and_kill.py [options] SCRIPT ARGS...`
(or under torchrun), with two probes patched in from outside the product code:

--kill_after_save N   SIGKILL rank 0 right after checkpoint-N (and its adapter copy) is on disk,
                      a deterministic crash point for the resume tests;
--record_batches DIR  append a hash of every training batch to DIR/rank<R>.txt, so a test can
                      prove that ranks see different data.
"""

import argparse
import hashlib
import os
import runpy
import signal
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--kill_after_save", type=int, default=None)
parser.add_argument("--record_batches", default=None)
parser.add_argument("script")
options, script_args = parser.parse_known_args()

sys.path.insert(0, os.path.dirname(os.path.abspath(options.script)))
import transformers  # noqa: E402

import build_dataset  # noqa: E402  (the module the script will import: patch it first)

if options.kill_after_save is not None:
    original_on_save = build_dataset.SavePeftModelCallback.on_save

    def on_save_then_kill(self, args, state, control, **kwargs):
        original_on_save(self, args, state, control, **kwargs)
        if state.global_step == options.kill_after_save and args.process_index == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    build_dataset.SavePeftModelCallback.on_save = on_save_then_kill

if options.record_batches is not None:
    original_training_step = transformers.Trainer.training_step

    def recording_training_step(self, model, inputs, *args, **kwargs):
        os.makedirs(options.record_batches, exist_ok=True)
        with open(os.path.join(options.record_batches, f"rank{self.args.process_index}.txt"), "a") as handle:
            for row in inputs["input_ids"]:
                handle.write(hashlib.sha1(row.numpy().tobytes()).hexdigest() + "\n")
        return original_training_step(self, model, inputs, *args, **kwargs)

    transformers.Trainer.training_step = recording_training_step

sys.argv = [options.script] + script_args
runpy.run_path(options.script, run_name="__main__")
