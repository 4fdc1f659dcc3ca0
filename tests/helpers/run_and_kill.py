"""Test-only wrapper: runs a training script as `python run_and_kill.py [options] SCRIPT ARGS...` (or under
torchrun; SCRIPT may be helpers/run_in_sequence.py with its arguments), with probes patched in from outside the
product code:

--record_steps FILE, --kill_at_step K, --kill_mid_save N, --kill_output NAME
                      helpers/step_probe.py: record every optimizer step this process runs; SIGKILL rank 0 after
                      step K, or in the middle of writing checkpoint-N; only in the run whose output_dir is NAME;
--kill_after_save N   the same as --kill_at_step N for N a save step: right after checkpoint-N is complete;
--record_batches DIR  append a hash of every training batch to DIR/rank<R>.txt, so a test can prove that ranks
                      see different data;
--logits_per_chunk N  chunked_loss.LOGITS_PER_CHUNK: chunks of a few positions on a tiny vocabulary, so that
                      ranks with different token counts run different numbers of chunks.
"""

import argparse
import hashlib
import os
import runpy
import sys

import transformers
from step_probe import Probes, probes_installed

parser = argparse.ArgumentParser()
parser.add_argument("--record_steps", default=None)
parser.add_argument("--kill_at_step", "--kill_after_save", type=int, default=None)
parser.add_argument("--kill_mid_save", type=int, default=None)
parser.add_argument("--kill_output", default=None)
parser.add_argument("--record_batches", default=None)
parser.add_argument("--logits_per_chunk", type=int, default=None)
parser.add_argument("script")
options, script_args = parser.parse_known_args()

if options.record_batches is not None:
    original_training_step = transformers.Trainer.training_step

    def recording_training_step(self, model, inputs, *args, **kwargs):
        os.makedirs(options.record_batches, exist_ok=True)
        with open(os.path.join(options.record_batches, f"rank{self.args.process_index}.txt"), "a") as handle:
            for row in inputs["input_ids"]:
                handle.write(hashlib.sha1(row.numpy().tobytes()).hexdigest() + "\n")
        return original_training_step(self, model, inputs, *args, **kwargs)

    transformers.Trainer.training_step = recording_training_step

probes = Probes(options.record_steps, options.kill_at_step, options.kill_mid_save, options.kill_output)
if options.logits_per_chunk is not None:  # the package's module, whichever script runs it
    from lorakit.models import chunked_loss

    chunked_loss.LOGITS_PER_CHUNK = options.logits_per_chunk
sys.argv = [options.script] + script_args
with probes_installed(probes):
    runpy.run_path(options.script, run_name="__main__")
