"""Running planned stages: which to skip, resume or run afresh, and the markers that decide it.

OUTPUT/.pipeline/<stage>.json records the stage's config hash when it starts and is marked
complete only after its script exited 0, so a crash anywhere leaves it incomplete:
- complete with the same hash: skipped;
- started with the same hash and a training stage with a complete checkpoint-N: rerun with the
  same command, which resumes from the checkpoint (the scripts resume by themselves);
- otherwise (new, changed config, nothing to resume): its output directory is cleared and it runs.
Once a stage has run, every later stage runs afresh: it starts from new weights.

With several nodes, every node runs the pipeline with its deployment.node_rank; training stages
join one torchrun job, the one-process stages (vocabulary, merge, chat) run on node 0 while the
others wait for their markers. OUTPUT must be a filesystem all nodes share."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, BinaryIO, NamedTuple

from lorakit.core.atomic import write_json_atomically
from lorakit.core.cli import InputError
from lorakit.core.model_files import complete_checkpoints
from lorakit.pipeline.stages import PlannedStage

MARKER_DIR = ".pipeline"
LOG_DIR = "logs"
WAIT_SECONDS = 10


class StageFailed(Exception):
    def __init__(self, name: str, status: int, log: str, resumable: bool = False) -> None:
        then = "; a rerun resumes it from its last checkpoint" if resumable else ""
        super().__init__(f"stage '{name}' exited with status {status}; its log: {log}{then}")
        self.status = status


@dataclass
class Decision:
    action: str  # skip | resume | run
    reason: str


def marker_path(output_dir: str, name: str) -> str:
    return os.path.join(output_dir, MARKER_DIR, f"{name}.json")


def read_marker(output_dir: str, name: str) -> dict[str, Any] | None:
    try:
        with open(marker_path(output_dir, name), encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError):
        return None  # no marker, or one cut short: the stage did not complete


def write_stage_marker(output_dir: str, name: str, record: dict[str, Any]) -> None:
    write_json_atomically(marker_path(output_dir, name), record, make_parents=True)  # whole or absent


def inputs_of(planned: list[PlannedStage], stage: PlannedStage, output_dir: str) -> dict[str, str | None]:
    """{earlier stage: the run id of its completed run}: what this stage starts from."""
    earlier = planned[:planned.index(stage)]
    return {other.config.name: (read_marker(output_dir, other.config.name) or {}).get("run_id") for other in earlier}


def decide(stage: PlannedStage, output_dir: str, inputs: dict[str, str | None], rerun_reason: str | None) -> Decision:
    """rerun_reason: why this stage must run afresh whatever its marker says, or None."""
    marker = read_marker(output_dir, stage.config.name)
    if rerun_reason:
        return Decision("run", rerun_reason)
    if marker is None:
        return Decision("run", "not run yet")
    if marker.get("config_hash") != stage.config_hash:
        return Decision("run", "its config or an earlier stage's changed")
    if marker.get("inputs") != inputs:
        return Decision("run", "an earlier stage ran again since")
    if marker.get("complete") and os.path.isdir(stage.out_dir):
        return Decision("skip", "complete")
    if stage.distributed and complete_checkpoints(stage.out_dir):
        return Decision("resume", "interrupted; resumes from its last checkpoint")
    return Decision("run", "interrupted before its first checkpoint")


def run_stage(stage: PlannedStage, output_dir: str, decision: Decision, inputs: dict[str, str | None],
              node_rank: int) -> float:
    """Run one stage (its output streamed to the console and OUTPUT/logs/<stage>.log); seconds taken."""
    name = stage.config.name
    if node_rank > 0 and not stage.distributed:
        return wait_for_node_zero(stage, output_dir)
    marker = {"config_hash": stage.config_hash, "inputs": inputs, "complete": False, "run_id": uuid.uuid4().hex,
              "command": shlex.join(stage.command)}
    if node_rank == 0:
        if decision.action == "run":
            shutil.rmtree(stage.out_dir, ignore_errors=True)
        else:  # a resume continues the run it was
            marker["run_id"] = read_marker(output_dir, name)["run_id"]
        write_stage_marker(output_dir, name, marker)
    log_path = os.path.join(output_dir, LOG_DIR, f"{name}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    started = time.time()
    with open(log_path, "ab") as log:
        log.write(f"$ {shlex.join(stage.command)}\n".encode())
        status, output = stream(stage.command, stage.stdin, log)
    if status != 0:
        raise StageFailed(name, status, log_path, resumable=stage.distributed and status != 2)
    if stage.config.kind == "chat":
        write_transcript(stage, output)
    if node_rank == 0:
        write_stage_marker(output_dir, name, {**marker, "complete": True, "seconds": time.time() - started})
    return time.time() - started


class StageOutput(NamedTuple):
    """How a stage's process ended, and everything it wrote to stdout and stderr."""

    status: int
    output: str


def stream(command: list[str], stdin: str | None, log: BinaryIO) -> StageOutput:
    """Run command, copying its output as it comes (progress bars included) to stdout and log."""
    process = subprocess.Popen(command, stdin=subprocess.PIPE if stdin is not None else None,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if stdin is not None:
        process.stdin.write(stdin.encode())
        process.stdin.close()
    output = bytearray()
    while True:
        chunk = os.read(process.stdout.fileno(), 65536)
        if not chunk:
            break
        output += chunk
        log.write(chunk)
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
    return StageOutput(process.wait(), output.decode(errors="replace"))


def write_transcript(stage: PlannedStage, output: str) -> None:
    """The chat check: chat.py answered every scripted turn (an "Assistant:" reply each); the
    transcript is kept. An empty reply is the model's, not a failure of the path: it is said."""
    replies = [reply.strip() for reply in output.split("User: ")[1:]]
    turns = stage.config.turns
    if len(replies) < len(turns) or not all(reply.startswith("Assistant:") for reply in replies[:len(turns)]):
        raise StageFailed(stage.config.name, 1, "the chat did not answer every turn:\n" + output[-2000:])
    # strict=False: a reply beyond the turns is chat's last prompt at the end of its input, not an answer.
    for turn, reply in zip(turns, replies, strict=False):
        if reply == "Assistant:":
            print(f"pipeline: the chat check's model gave an empty answer to {turn!r}", flush=True)
    os.makedirs(stage.out_dir, exist_ok=True)
    transcript = "\n".join(f"User: {turn}\n{reply}" for turn, reply in zip(turns, replies, strict=False))
    with open(os.path.join(stage.out_dir, "transcript.txt"), "w", encoding="utf-8") as handle:
        handle.write(transcript + "\n")


def wait_for_node_zero(stage: PlannedStage, output_dir: str) -> float:
    started = time.time()
    print(f"pipeline: node 0 runs stage '{stage.config.name}'; waiting for its marker", flush=True)
    while True:
        marker = read_marker(output_dir, stage.config.name)
        if marker and marker.get("complete") and marker.get("config_hash") == stage.config_hash:
            return time.time() - started
        time.sleep(WAIT_SECONDS)


def check_selection_inputs(planned: list[PlannedStage], selected: list[PlannedStage], output_dir: str) -> None:
    """A selected stage starts from what the stages before it wrote: those left out must be complete."""
    last = max(planned.index(stage) for stage in selected)
    for stage in planned[:last]:
        if stage in selected:
            continue
        marker = read_marker(output_dir, stage.config.name)
        if not (marker and marker.get("complete") and marker.get("config_hash") == stage.config_hash):
            raise InputError(f"stage '{stage.config.name}' has not completed with this config, and a selected "
                             "stage starts from its output: select it too")
