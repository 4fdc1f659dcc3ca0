"""Test-only probes patched into the transformers Trainer from outside the product code, to prove that a resume is
a resume: every optimizer step a process runs is recorded, and a process can be SIGKILLed at a chosen point.
helpers/run_and_kill.py installs them in a subprocess (a command users would type, under torchrun too);
helpers/forked_runs.py in a process it forks.

    record_steps FILE  append one JSON line per optimizer step: {"output": the run's output_dir name, "rank",
                       "step": the global step} (+ "iteration": PPO's iterations made so far)
    kill_at_step K     SIGKILL rank 0 once everything the Trainer does for optimizer step K is done (its log, and
                       its checkpoint where K is a save step), as the next step begins, or as training ends where
                       K is the last step (the adapter callback's on_train_end done, the run's result files not)
    kill_mid_save N    SIGKILL rank 0 while checkpoint-N is being written: right after the Trainer wrote its files
                       (weights, optimizer, RNG states, trainer_state.json), before the adapter copy and anything
                       written after them (the completion marker)
    kill_output NAME   kill only in the run whose output_dir is named NAME (several runs in one process)
"""

import contextlib
import json
import os
import signal
from dataclasses import dataclass

import transformers
from transformers.trainer_callback import TrainerCallback, TrainerState


@dataclass(frozen=True)
class Probes:
    record_steps: str | None = None
    kill_at_step: int | None = None
    kill_mid_save: int | None = None
    kill_output: str | None = None

    def as_argv(self) -> list:
        """These probes as helpers/run_and_kill.py's options."""
        return [f"--{name}={value}" for name, value in vars(self).items() if value is not None]


def run_name(output_dir: str) -> str:
    return os.path.basename(os.path.normpath(output_dir))


def kill_if_targeted(probes: Probes, output_dir: str) -> None:
    if probes.kill_output is None or run_name(output_dir) == probes.kill_output:
        os.kill(os.getpid(), signal.SIGKILL)


class StepProbe(TrainerCallback):
    """Records each optimizer step and kills at kill_at_step; added to every Trainer built while installed."""

    def __init__(self, trainer, probes: Probes):
        self.trainer, self.probes = trainer, probes

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.probes.kill_at_step and args.process_index == 0:
            kill_if_targeted(self.probes, args.output_dir)

    on_train_end = on_step_begin

    def on_step_end(self, args, state, control, **kwargs):
        if self.probes.record_steps is None:
            return
        entry = {"output": run_name(args.output_dir), "rank": args.process_index, "step": state.global_step}
        stream = getattr(self.trainer, "stream", None)  # PPO's experience stream counts the iterations
        if stream is not None:
            entry["iteration"] = stream.iteration
        with open(self.probes.record_steps, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")


@contextlib.contextmanager
def probes_installed(probes: Probes):
    original_init, original_save_to_json = transformers.Trainer.__init__, TrainerState.save_to_json

    def init_with_probe(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.add_callback(StepProbe(self, probes))

    def save_to_json_then_kill(self, json_path):
        original_save_to_json(self, json_path)
        checkpoint_dir = os.path.dirname(os.path.abspath(json_path))
        if os.path.basename(checkpoint_dir) == f"checkpoint-{probes.kill_mid_save}":
            kill_if_targeted(probes, os.path.dirname(checkpoint_dir))

    transformers.Trainer.__init__ = init_with_probe
    TrainerState.save_to_json = save_to_json_then_kill
    try:
        yield
    finally:
        transformers.Trainer.__init__, TrainerState.save_to_json = original_init, original_save_to_json


def recorded_steps(path, output: str) -> list:
    """The entries a process recorded for the run named output, in order (none if it ran no step)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as handle:
        entries = [json.loads(line) for line in handle]
    return [entry for entry in entries if entry.pop("output") == output]
