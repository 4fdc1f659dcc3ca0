"""Test-only crash injection for jobs whose processes a test does not start itself (the pipeline's
stages under torchrun). With this directory on PYTHONPATH, Python imports this file at start in
every process of the job; with KILL_JOB_AFTER_SAVE=N and KILL_JOB_OUTPUT=NAME set, the rank-0
training process whose output_dir is named NAME, right after checkpoint-N (and its adapter copy)
is on disk, SIGKILLs the process groups of its grandparent and parent -- the pipeline and torchrun (the pipeline
starts each stage in a session of its own), as when a node dies -- and then itself (torchrun starts each worker in
a session of its own)."""

import importlib.abc
import os
import signal
import sys

KILL_AFTER_SAVE = os.environ.get("KILL_JOB_AFTER_SAVE")


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
        return int(handle.read().rsplit(")", 1)[1].split()[1])


def kill_the_job() -> None:
    torchrun = os.getppid()
    os.killpg(os.getpgid(parent_of(torchrun)), signal.SIGKILL)
    os.killpg(os.getpgid(torchrun), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def patch(checkpoints) -> None:
    original_on_save = checkpoints.SavePeftModelCallback.on_save

    def on_save_then_kill(self, args, state, control, **kwargs):
        original_on_save(self, args, state, control, **kwargs)
        named = os.path.basename(os.path.normpath(args.output_dir)) == os.environ["KILL_JOB_OUTPUT"]
        if named and state.global_step == int(KILL_AFTER_SAVE) and args.process_index == 0:
            kill_the_job()

    checkpoints.SavePeftModelCallback.on_save = on_save_then_kill


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches lorakit.trainers.checkpoints right after the training script imports it."""

    def find_spec(self, name, path=None, target=None):
        if name != "lorakit.trainers.checkpoints":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_then_patch(module):
            run_module(module)
            patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


if KILL_AFTER_SAVE:
    import importlib.util

    sys.meta_path.insert(0, PatchOnImport())
