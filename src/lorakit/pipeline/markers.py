"""The stage markers, OUTPUT/.pipeline/<stage>.json, and what they decide: skip a stage, resume it, or run it.

A marker's top level describes what OUTPUT/<stage>/ holds: its hashes (config_hash: the stage's flags, the
contents of its data files and input models, and those of every stage before it; flags_hash: the flags alone),
the run ids of the earlier stages' outputs it started from (inputs), and, once its script exited 0, complete:
true with the files the next stages read (products, relative to OUTPUT). A stage with no complete output runs in
OUTPUT/<stage>/ itself, the marker then describing that attempt. A stage that has a complete output and must run
again builds in OUTPUT/.pipeline/build/<stage>/ instead, recorded under the marker's "attempt", and replaces the
output only when its script exits 0: a rerun refused for bad input leaves the last good output in place.

- complete, same hashes and inputs, its products all there: skipped;
- its attempt has the same hashes and inputs and a complete checkpoint-N: resumed where it was built (the scripts
  resume by themselves), unless it ended with exit status 2, 3 or 4 (bad input, a non-finite loss, a health
  alarm): then the pipeline refuses until the config or data change, or --from_stage says to run it afresh;
- otherwise (new, changed, its output gone, nothing to resume): run afresh.

Markers written before the hashes of file contents existed (no flags_hash, no products) are accepted when their
hash equals today's flags hash: the stage's data and models cannot be checked against them, which the decision's
line says each time, with how to rerun it."""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple, TypeGuard

from lorakit.core.atomic import write_json_atomically
from lorakit.core.cli import InputError
from lorakit.core.model_files import complete_checkpoints
from lorakit.pipeline.stages import PlannedStage

MARKER_DIR = ".pipeline"
BUILD_DIR = os.path.join(MARKER_DIR, "build")
MARKER_VERSION = 2
# Exit statuses after which a stage is not run again with the same config and data (the conventions' list).
FINAL_STATUSES = {2: "bad input or a refusal", 3: "a non-finite loss", 4: "a health alarm"}
LEGACY_NOTE = ("its marker, from an earlier version, holds no hash of file contents: its data and models are "
               "taken as unchanged; --from_stage {name} reruns it")

Marker = dict[str, Any]


class Decision(NamedTuple):
    action: str  # skip | resume | run
    reason: str
    build_dir: str  # where the stage's script writes: OUTPUT/<stage> or OUTPUT/.pipeline/build/<stage>


def marker_path(output_dir: str, name: str) -> str:
    return os.path.join(output_dir, MARKER_DIR, f"{name}.json")


def build_dir_of(output_dir: str, name: str) -> str:
    return os.path.join(output_dir, BUILD_DIR, name)


def read_marker(output_dir: str, name: str) -> Marker | None:
    try:
        with open(marker_path(output_dir, name), encoding="utf-8") as handle:
            marker = json.load(handle)
    except (OSError, json.JSONDecodeError):
        return None  # no marker, or one cut short: the stage did not complete
    return marker if isinstance(marker, dict) else None


def write_stage_marker(output_dir: str, name: str, record: Marker) -> None:
    write_json_atomically(marker_path(output_dir, name), record, make_parents=True)  # whole or absent


def completed(marker: Marker | None) -> Marker | None:
    """The record of the stage's complete output, or None."""
    return marker if marker and marker.get("complete") else None


def attempt_of(marker: Marker | None) -> Marker | None:
    """The record of the stage's unfinished run (in place, or building beside a complete output), or None."""
    if not marker:
        return None
    return marker.get("attempt") if marker.get("complete") else marker


def is_legacy(record: Marker) -> bool:
    return "flags_hash" not in record


def same_config(record: Marker | None, stage: PlannedStage) -> TypeGuard[Marker]:
    """The record's hash is the stage's: config_hash, or for an earlier version's marker the flags hash it had (so
    never for no record)."""
    if record is None:
        return False
    if is_legacy(record):
        return record.get("config_hash") == stage.flags_hash
    return record.get("config_hash") == stage.config_hash


def product_files(stage: PlannedStage, output_dir: str) -> list[str]:
    """The files in the stage's product directories, relative to output_dir: what the next stages read."""
    files = []
    for product in stage.product_dirs:
        if os.path.isdir(product):
            files += [os.path.relpath(os.path.join(product, name), output_dir) for name in sorted(os.listdir(product))
                      if os.path.isfile(os.path.join(product, name))]
    return files


def holds_files(directory: str) -> bool:
    return os.path.isdir(directory) and any(os.path.isfile(os.path.join(directory, name))
                                            for name in os.listdir(directory))


def missing_product(record: Marker, stage: PlannedStage, output_dir: str) -> str | None:
    """A product of the complete record that is gone (None when all are there). An earlier version's marker lists
    none: its product directories must hold files."""
    listed = record.get("products")
    if listed is None:
        gone = [path for path in stage.product_dirs if not holds_files(path)]
    else:
        gone = [path for path in stage.product_dirs if not os.path.isdir(path)]
        gone += [file for file in (os.path.join(output_dir, path) for path in listed) if not os.path.isfile(file)]
    return gone[0] if gone else None


def is_complete(marker: Marker | None, stage: PlannedStage, output_dir: str) -> TypeGuard[Marker]:
    """Complete with this config and contents, its products there (the earlier stages' run ids not compared)."""
    record = completed(marker)
    return same_config(record, stage) and missing_product(record, stage, output_dir) is None


def decide(stage: PlannedStage, output_dir: str, inputs: dict[str, str | None], rerun_reason: str | None) -> Decision:
    """rerun_reason: why this stage must run afresh whatever its marker says, or None."""
    name = stage.config.name
    marker = read_marker(output_dir, name)
    complete = completed(marker)
    gone = missing_product(complete, stage, output_dir) if complete else None
    # A complete output is kept until the rerun that replaces it succeeds.
    where = build_dir_of(output_dir, name) if complete and gone is None else stage.out_dir
    if rerun_reason:
        return Decision("run", rerun_reason, where)
    legacy = f" ({LEGACY_NOTE.format(name=name)})"
    if same_config(complete, stage) and complete.get("inputs") == inputs and gone is None:
        return Decision("skip", "complete" + (legacy if is_legacy(complete) else ""), stage.out_dir)
    attempt = attempt_of(marker)
    if same_config(attempt, stage) and attempt.get("inputs") == inputs:
        refuse_after_final_status(attempt, name)
        attempt_dir = os.path.join(output_dir, attempt["build_dir"]) if attempt.get("build_dir") else stage.out_dir
        if stage.distributed and complete_checkpoints(attempt_dir):
            return Decision("resume", "interrupted; resumes from its last checkpoint"
                            + (legacy if is_legacy(attempt) else ""), attempt_dir)
        return Decision("run", "interrupted before its first checkpoint", where)
    return Decision("run", why_it_runs(complete or attempt, stage, inputs, gone), where)


def why_it_runs(record: Marker | None, stage: PlannedStage, inputs: dict[str, str | None], gone: str | None) -> str:
    if record is None:
        return "not run yet"
    if not same_config(record, stage):
        if record.get("flags_hash") == stage.flags_hash:
            return "the contents of its data files or models changed, or an earlier stage's"
        return "its config or an earlier stage's changed"
    if record.get("inputs") != inputs:
        return "an earlier stage ran again since"
    return f"its output {gone} is gone" if gone else "not complete"


def refuse_after_final_status(attempt: Marker, name: str) -> None:
    """The conventions: a stage is resumed after exit status 1 (a crash), never after 2, 3 or 4 unless told."""
    failed = attempt.get("failed") or {}
    if failed.get("status") in FINAL_STATUSES:
        raise InputError(f"stage '{name}' stopped with exit status {failed['status']} "
                         f"({FINAL_STATUSES[failed['status']]}) on its last run with this config and data: "
                         f"{failed.get('reason', 'see its log')}; change its config or data, "
                         f"or run it afresh with --from_stage {name}")


def inputs_of(planned: list[PlannedStage], stage: PlannedStage, output_dir: str) -> dict[str, str | None]:
    """{earlier stage: the run id of its output}: what this stage starts from."""
    earlier = planned[:planned.index(stage)]
    return {other.config.name: (read_marker(output_dir, other.config.name) or {}).get("run_id") for other in earlier}


def check_selection_inputs(planned: list[PlannedStage], selected: list[PlannedStage], output_dir: str) -> None:
    """A selected stage starts from what the stages before it wrote: those left out must be complete."""
    last = max(planned.index(stage) for stage in selected)
    for stage in planned[:last]:
        if stage not in selected and not is_complete(read_marker(output_dir, stage.config.name), stage, output_dir):
            raise InputError(f"stage '{stage.config.name}' has not completed with this config and data, and a "
                             "selected stage starts from its output: select it too")
