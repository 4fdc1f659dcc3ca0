"""Resume proofs: a run killed at seeded random steps and in the middle of writing a checkpoint, rerun after each
kill with the same command (it resumes by itself) until it finishes. Every process records the optimizer steps it
ran (helpers/step_probe.py), so a test proves that each resumed process ran only the steps after the last complete
checkpoint, not a silent restart from step 0 that a deterministic run would hide.

    kill_plan(seed, total, save_steps)     random kills, then a kill while a checkpoint is being written
    KillChain(launch, kills, root, name)   the processes of the killed-and-rerun run
    check_steps(chain, ...)                each chosen process ran exactly the steps it had left
    forked_resume_proof(...)               a reference run and a killed run, each process forked (helpers/forked_runs)
    torchrun_resume_proof(...)             the same under torchrun, the reference in the first job
    resume_proof(nproc, ...)               either, by the number of processes
    assert_bit_identical(first, second)    two adapters' weights, torch.equal (ResumeProof.check_bit_identical)
"""

import json
import os
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from helpers.commands import KILL_WRAPPER, REPO, assert_ok, run_script
from helpers.forked_runs import run_forked
from helpers.run_outputs import adapter_weights
from helpers.step_probe import Probes, recorded_steps

SEQUENCE_WRAPPER = os.path.join(REPO, "tests", "helpers", "run_in_sequence.py")
REFERENCE, CRASHED, ENDED = "reference", "crashed", "ended"  # the runs' output_dir names


@dataclass(frozen=True)
class Kill:
    """Where a process dies: once optimizer step `step` is done (its checkpoint complete where it is a save step),
    as the next step begins or, after the last step, as training ends; or, mid_save, while checkpoint-`step` is
    being written (the Trainer's files on disk; the adapter copy and the completion marker not)."""

    step: int
    mid_save: bool = False

    def probes(self, record_steps: str, run_name: str | None) -> Probes:
        if self.mid_save:
            return Probes(record_steps, kill_mid_save=self.step, kill_output=run_name)
        return Probes(record_steps, kill_at_step=self.step, kill_output=run_name)

    def resume_point(self, save_steps: int) -> int:
        """The last complete checkpoint the killed process leaves: where the next process must start."""
        done = self.step - 1 if self.mid_save else self.step
        return done // save_steps * save_steps

    def __str__(self) -> str:
        return f"killed writing checkpoint-{self.step}" if self.mid_save else f"killed after step {self.step}"


def kill_plan(seed: str, total: int, save_steps: int, random_kills: int = 2) -> list:
    """random_kills kills at steps drawn with seed, each after the checkpoint that the one before resumes from (the
    first after the first checkpoint: a rerun with none to resume is refused), then a kill in the middle of writing
    a checkpoint drawn alike, the final one included."""
    assert total % save_steps == 0 and total >= 2 * save_steps
    rng = random.Random(seed)
    kills, start = [], 0
    for left in range(random_kills, 0, -1):
        kills.append(Kill(rng.randint(max(start + 1, save_steps), total - left)))  # room left for the next kills
        start = kills[-1].resume_point(save_steps)
    kills.append(Kill(rng.choice(range(start + save_steps, total + 1, save_steps)), mid_save=True))
    return kills


class KillChain:
    """One run's processes, in root/<run_name>: launch(probes, number) killed at each of kills in turn, then run to
    the end. Each kill must end its process by SIGKILL; the last process must succeed."""

    def __init__(self, launch, kills: list, root: Path, run_name: str):
        self.kills, self.run_name, self.records, self.results = kills, run_name, [], []
        for number, kill in enumerate(kills + [None]):
            record = str(root / f"{run_name}{number}.jsonl")
            result = launch(Probes(record) if kill is None else kill.probes(record, run_name), number)
            if kill is None:
                assert_ok(result)
            else:
                output = result.stdout[-2000:] + result.stderr[-4000:]
                assert was_killed(result), f"process {number} of {run_name} was not {kill}:\n{output}"
            self.records.append(record)
            self.results.append(result)

    def steps_of(self, number: int) -> list:
        return by_rank_and_step(recorded_steps(self.records[number], self.run_name))


def was_killed(result) -> bool:
    """Ended by SIGKILL: the process itself, or a torchrun worker (torchrun then exits 1 and names the signal)."""
    output = result.stdout + result.stderr
    return result.returncode == -signal.SIGKILL or (result.returncode == 1 and "Signal 9 (SIGKILL)" in output)


def by_rank_and_step(entries: list) -> list:
    return sorted(entries, key=lambda entry: (entry["rank"], entry["step"]))


def reference_steps(record_path, run_name: str, total: int, world_size: int = 1) -> list:
    """The uninterrupted run's recorded steps, checked to be 1..total on every rank."""
    entries = by_rank_and_step(recorded_steps(record_path, run_name))
    assert [(e["rank"], e["step"]) for e in entries] == [(rank, step) for rank in range(world_size)
                                                         for step in range(1, total + 1)], entries
    return entries


def check_steps(chain: KillChain, reference: list, save_steps: int, numbers) -> None:
    """Processes `numbers` of the chain each ran exactly the steps after the checkpoint its predecessor's kill left
    (to its own kill, or to the end), on every rank, with the reference's entries at those steps (PPO: the same
    iteration counter)."""
    total, start = reference[-1]["step"], 0
    for number, kill in enumerate(chain.kills + [None]):
        end = total if kill is None else kill.step
        if number in numbers:
            ran = chain.steps_of(number)
            expected = [entry for entry in reference if start < entry["step"] <= end]
            history = ", then ".join(str(k) for k in chain.kills[:number]) or "a fresh start"
            assert ran == expected, (f"process {number} (after: {history}) ran steps "
                                     f"{[e['step'] for e in ran]}, expected {start + 1}..{end}: "
                                     f"{json.dumps(ran)} != {json.dumps(expected)}")
        start = kill.resume_point(save_steps) if kill is not None else total


@dataclass
class ResumeProof:
    """An uninterrupted reference run and the same run killed (kill_plan) and rerun until it finished; with forked
    processes also one killed as it ends, after its last step, and rerun."""

    root: Path
    reference: list  # the reference's recorded steps
    crashed: KillChain
    save_steps: int
    ended: KillChain | None = None

    def check_processes_after_random_kills(self) -> None:
        """Every process that started at the checkpoint a kill at a random step (or nothing) left."""
        after_random = [0] + [number + 1 for number, kill in enumerate(self.crashed.kills) if not kill.mid_save]
        check_steps(self.crashed, self.reference, self.save_steps, after_random)

    def check_process_after_mid_save_kill(self) -> None:
        """The last process started at the last complete checkpoint before the one its predecessor was killed
        writing: a partial checkpoint is not resumed."""
        assert self.crashed.kills[-1].mid_save
        check_steps(self.crashed, self.reference, self.save_steps, [len(self.crashed.kills)])

    def check_process_after_end_kill(self) -> None:
        """The rerun of a run killed after its last step (its last checkpoint complete) trains no step."""
        check_steps(self.ended, self.reference, self.save_steps, [0, 1])

    def check_bit_identical(self, adapter_name: str, run_name: str = CRASHED) -> None:
        assert_bit_identical(self.root / REFERENCE / adapter_name, self.root / run_name / adapter_name)

    def resumed_output(self) -> str:
        return "".join(result.stdout + result.stderr for result in self.crashed.results[1:])


def forked_resume_proof(script: str, args_for: Callable, root: Path, seed: str, total: int,
                        save_steps: int) -> ResumeProof:
    """The reference and each process of the killed runs forked (helpers/forked_runs.py); args_for(output_dir)
    gives the run's arguments."""
    reference_record = root / f"{REFERENCE}.jsonl"
    assert_ok(run_forked(script, args_for(root / REFERENCE), Probes(str(reference_record)), root / "reference.log"))
    reference = reference_steps(reference_record, REFERENCE, total)

    def launcher(run_name: str):
        def launch(probes: Probes, number: int):
            return run_forked(script, args_for(root / run_name), probes, root / f"{run_name}{number}.log")
        return launch

    crashed = KillChain(launcher(CRASHED), kill_plan(seed, total, save_steps), root, CRASHED)
    ended = KillChain(launcher(ENDED), [Kill(total)], root, ENDED)
    return ResumeProof(root, reference, crashed, save_steps, ended)


def torchrun_resume_proof(script: str, args_for: Callable, root: Path, seed: str, total: int, save_steps: int,
                          nproc: int = 2, mid_save: bool = True) -> ResumeProof:
    """Under torchrun, as users run it: one kill at a random step, then (mid_save) one while a checkpoint is
    written. The reference runs in the first job before the run that is killed (helpers/run_in_sequence.py: one
    start-up and rendezvous for both)."""

    def launch(probes: Probes, number: int):
        runs = args_for(root / CRASHED)
        if number == 0:
            runs = args_for(root / REFERENCE) + [":::"] + runs
        return run_script(runs, nproc=nproc, script=script, wrapper=[KILL_WRAPPER, *probes.as_argv(), SEQUENCE_WRAPPER])

    kills = kill_plan(seed, total, save_steps, random_kills=1)
    crashed = KillChain(launch, kills if mid_save else kills[:1], root, CRASHED)
    reference = reference_steps(crashed.records[0], REFERENCE, total, world_size=nproc)
    return ResumeProof(root, reference, crashed, save_steps)


def resume_proof(nproc: int, script: str, args_for: Callable, root: Path, seed: str, total: int, save_steps: int,
                 **torchrun_options) -> ResumeProof:
    """forked_resume_proof for one process, torchrun_resume_proof for more."""
    if nproc == 1:
        return forked_resume_proof(script, args_for, root, seed, total, save_steps)
    return torchrun_resume_proof(script, args_for, root, seed, total, save_steps, nproc, **torchrun_options)


def assert_bit_identical(expected_dir, actual_dir) -> None:
    """Two adapters with the same tensors, bit for bit (torch.equal), and trained (some LoRA B not zero)."""
    expected, actual = adapter_weights(expected_dir), adapter_weights(actual_dir)
    assert expected.keys() == actual.keys()
    differing = {key: (expected[key] - actual[key]).abs().max().item()
                 for key in expected if not torch.equal(expected[key], actual[key])}
    assert not differing, f"{len(differing)} of {len(expected)} tensors differ, by at most {max(differing.values())}"
    assert any(value.abs().max() > 0 for key, value in expected.items() if "lora_B" in key)
