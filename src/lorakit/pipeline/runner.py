"""Running a planned stage as its markers decided (lorakit.pipeline.markers): in OUTPUT/<stage>/, or for a rerun
beside a complete output in OUTPUT/.pipeline/build/<stage>/, which replaces the output once the script exits 0.
Every stage after one that ran runs afresh: it starts from new weights.

A stage that fails leaves its exit status and the reason in its marker: the pipeline then exits with the same
status (the conventions' 1 to 4; a crash's signal as 1), and a later run resumes it only after status 1.

With several nodes, every node runs the pipeline with its deployment.node_rank; training stages join one torchrun
job, the one-process stages (vocabulary, merge, chat) run on node 0 while the others wait for their markers. Node 0
alone writes markers and moves directories; the others poll its marker every POLL_SECONDS until the stage is
complete or node 0 recorded its failure (they then exit with that status and reason), and give up once node 0's
run has been gone (no lock) for NODE_ZERO_GRACE_SECONDS. OUTPUT must be a filesystem all nodes share."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import time
import uuid
from typing import Any, NamedTuple

from lorakit.core.atomic import replace_directory
from lorakit.core.cli import ReportedError
from lorakit.pipeline.lock import lock_path
from lorakit.pipeline.markers import (
    MARKER_VERSION,
    Decision,
    Marker,
    attempt_of,
    completed,
    is_complete,
    product_files,
    read_marker,
    write_stage_marker,
)
from lorakit.pipeline.process import FORWARDING, Stopped, stream
from lorakit.pipeline.stages import PlannedStage

LOG_DIR = "logs"
POLL_SECONDS = 2
NODE_ZERO_GRACE_SECONDS = 60
# The alarm file an RL stage writes into its output (lorakit.rl.alarms.ALARM_FILE; the pipeline imports no stage's
# code): how its run ended, read when the stage published no adapter.
ALARM_FILE = "rl_alarms.json"


class StageFailed(ReportedError):
    """A stage's script failed: the launcher exits with its status (1 to 4; anything else, a signal's, as 1)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status
        self.exit_status = status if status in (1, 2, 3, 4) else 1


def failure_message(name: str, status: int, output: str, log: str, resumable: bool) -> str:
    """What failed, with the script's own last `error:` line (its one-line refusal) when it printed one."""
    errors = [line.strip() for line in output.splitlines() if line.startswith("error: ")]
    said = f" ({errors[-1]})" if errors else ""
    then = "; a rerun resumes it from its last checkpoint" if resumable else ""
    return f"stage '{name}' exited with status {status}{said}; its log: {log}{then}"


class RunContext(NamedTuple):
    """What every stage of one launcher run shares."""

    output_dir: str
    node_rank: int
    session: str  # this run's id (its lock's token), in the markers it writes


def command_in(stage: PlannedStage, build_dir: str) -> list[str]:
    """The stage's command writing into build_dir instead of its output directory."""
    command = list(stage.command)
    if build_dir != stage.out_dir and "--output_dir" in command:
        command[command.index("--output_dir") + 1] = build_dir
    return command


def run_stage(stage: PlannedStage, decision: Decision, inputs: dict[str, str | None], run: RunContext) -> float:
    """Run one stage (its output streamed to the console and OUTPUT/logs/<stage>.log); seconds taken."""
    name = stage.config.name
    if run.node_rank > 0:
        seen = Seen.of(read_marker(run.output_dir, name))
        seconds = run_on_this_node(stage, decision, run) if stage.distributed else 0.0
        return seconds + wait_for_node_zero(stage, inputs, seen, run.output_dir)
    command = shlex.join(command_in(stage, decision.build_dir))
    attempt = {"version": MARKER_VERSION, "config_hash": stage.config_hash, "flags_hash": stage.flags_hash,
               "inputs": inputs, "complete": False, "run_id": uuid.uuid4().hex, "command": command,
               "build_dir": os.path.relpath(decision.build_dir, run.output_dir), "session": run.session}
    marker = read_marker(run.output_dir, name)
    if decision.action == "run":
        shutil.rmtree(decision.build_dir, ignore_errors=True)  # never a link: the launcher refused those
    else:  # a resume continues the run it was
        resumed = attempt_of(marker)
        assert resumed is not None  # decide() resumes only the attempt it found in this marker
        attempt["run_id"] = resumed["run_id"]
    old = completed(marker) if decision.build_dir != stage.out_dir else None
    write_stage_marker(run.output_dir, name, {**old, "attempt": attempt} if old else attempt)
    try:
        seconds = run_on_this_node(stage, decision, run)
        check_products(stage, decision.build_dir)
        if decision.build_dir != stage.out_dir:
            replace_directory(decision.build_dir, stage.out_dir)
    except (StageFailed, Stopped) as failure:
        record_failure(run.output_dir, name, failure, run.session)
        raise
    finished = {key: value for key, value in attempt.items() if key != "build_dir"}
    write_stage_marker(run.output_dir, name, {**finished, "complete": True, "seconds": seconds,
                                              "products": product_files(stage, run.output_dir)})
    return seconds


def run_on_this_node(stage: PlannedStage, decision: Decision, run: RunContext) -> float:
    """The stage's script on this node, into decision.build_dir; raises StageFailed or Stopped when it fails."""
    name, command = stage.config.name, command_in(stage, decision.build_dir)
    log_path = os.path.join(run.output_dir, LOG_DIR, f"{name}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    started = time.time()
    with open(log_path, "ab") as log:
        log.write(f"$ {shlex.join(command)}\n".encode())
        status, output = stream(command, stage.stdin, log)
    if FORWARDING.signum is not None:
        raise Stopped(FORWARDING.signum, name)
    if status != 0:
        resumable = stage.distributed and status not in (2, 3, 4)
        raise StageFailed(failure_message(name, status, output, log_path, resumable), status)
    if stage.config.kind == "chat":
        write_transcript(stage, output, decision.build_dir)
    return time.time() - started


def check_products(stage: PlannedStage, build_dir: str) -> None:
    """A stage that exited 0 wrote what the next stages read, or it failed: an RL stage that ended with a health
    alarm active and no checkpoint saved before it publishes no adapter (lorakit.rl.alarms), exit status 4 as if
    the alarm had stopped it (a rerun would train into the same alarm); anything else missing, 1."""
    missing = [os.path.relpath(product, stage.out_dir) for product in stage.product_dirs
               if not os.path.isdir(os.path.join(build_dir, os.path.relpath(product, stage.out_dir)))]
    if not missing:
        return
    name, alarms = stage.config.name, os.path.join(build_dir, ALARM_FILE)
    try:
        with open(alarms, encoding="utf-8") as handle:
            ending = json.load(handle).get("ending") or {}
    except (OSError, ValueError, AttributeError):
        ending = {}
    if ending.get("alarm_active"):
        raise StageFailed(f"stage '{name}' ended with a health alarm active and no checkpoint saved before it, so "
                          f"it published no {missing[0]} for the next stages (its alarms: {alarms})", 4)
    raise StageFailed(f"stage '{name}' exited 0 but wrote no {missing[0]} for the next stages", 1)


def record_failure(output_dir: str, name: str, failure: StageFailed | Stopped, session: str) -> None:
    """Node 0's word on a failed stage, in its attempt's record: what the other nodes wait for, and what decides
    whether a later run may resume it (markers.refuse_after_final_status)."""
    marker = read_marker(output_dir, name) or {}
    status = failure.status if isinstance(failure, StageFailed) else failure.exit_status
    failed = {"status": status, "reason": str(failure), "at": time.time(), "id": uuid.uuid4().hex, "session": session}
    if marker.get("complete") and marker.get("attempt"):
        marker = {**marker, "attempt": {**marker["attempt"], "failed": failed}}
    elif not marker.get("complete"):
        marker = {**marker, "failed": failed}
    write_stage_marker(output_dir, name, marker)


def write_transcript(stage: PlannedStage, output: str, directory: str) -> None:
    """The chat check: chat.py answered every scripted turn (an "Assistant:" reply each); the
    transcript is kept. An empty reply is the model's, not a failure of the path: it is said."""
    replies = [reply.strip() for reply in output.split("User: ")[1:]]
    turns = stage.config.turns
    if len(replies) < len(turns) or not all(reply.startswith("Assistant:") for reply in replies[:len(turns)]):
        raise StageFailed(f"stage '{stage.config.name}': the chat did not answer every turn:\n" + output[-2000:], 1)
    # strict=False: a reply beyond the turns is chat's last prompt at the end of its input, not an answer.
    for turn, reply in zip(turns, replies, strict=False):
        if reply == "Assistant:":
            print(f"pipeline: the chat check's model gave an empty answer to {turn!r}", flush=True)
    os.makedirs(directory, exist_ok=True)
    transcript = "\n".join(f"User: {turn}\n{reply}" for turn, reply in zip(turns, replies, strict=False))
    with open(os.path.join(directory, "transcript.txt"), "w", encoding="utf-8") as handle:
        handle.write(transcript + "\n")


# ----------------------------------------------------------------------------- the other nodes


class Seen(NamedTuple):
    """A stage's marker as another node found it before node 0 ran the stage: what is not news."""

    complete_run: str | None  # the run id of the complete output then
    failure: str | None  # the id of the failure recorded then

    @classmethod
    def of(cls, marker: Marker | None) -> Seen:
        failed = (attempt_of(marker) or {}).get("failed") or {}
        return cls((completed(marker) or {}).get("run_id"), failed.get("id"))


def node_zero_finished(marker: Marker | None, stage: PlannedStage, inputs: dict[str, str | None], seen: Seen,
                       output_dir: str) -> bool:
    """Complete with this config, inputs and products, and by a run other than the one already there (a stage
    that runs again with the same hashes, --from_stage, finishes with a new run id)."""
    return (is_complete(marker, stage, output_dir) and marker.get("inputs") == inputs
            and marker.get("run_id") != seen.complete_run)


def new_failure(marker: Marker | None, stage: PlannedStage, seen: Seen) -> dict[str, Any] | None:
    attempt = attempt_of(marker) or {}
    failed = attempt.get("failed")
    if failed and failed.get("id") != seen.failure and attempt.get("config_hash") == stage.config_hash:
        return failed
    return None


def wait_for_node_zero(stage: PlannedStage, inputs: dict[str, str | None], seen: Seen, output_dir: str) -> float:
    """Until node 0 completes the stage (seconds waited), or recorded its failure, or is gone (StageFailed)."""
    name, started, gone_since = stage.config.name, time.time(), None
    print(f"pipeline: node 0 runs stage '{name}'; waiting for its marker", flush=True)
    while True:
        marker = read_marker(output_dir, name)
        if node_zero_finished(marker, stage, inputs, seen, output_dir):
            return time.time() - started
        failed = new_failure(marker, stage, seen)
        if failed:
            raise StageFailed(f"node 0: {failed.get('reason', 'stage ' + repr(name) + ' failed')}", failed["status"])
        if os.path.exists(lock_path(output_dir, 0)):
            gone_since = None
        elif gone_since is None:
            gone_since = time.time()
        elif time.time() - gone_since > NODE_ZERO_GRACE_SECONDS:
            last = ((attempt_of(marker) or {}).get("failed") or {}).get("reason")
            raise StageFailed(f"stage '{name}' is not complete and node 0's pipeline is not running (no "
                              f"{lock_path(output_dir, 0)})" + (f"; its last run failed: {last}" if last else ""), 1)
        time.sleep(POLL_SECONDS)
