"""The data a run reads, recorded as it reads it: one RunRecord per process, which the trainers begin
(lorakit.trainers.checkpoints resolves the resume and calls begin_run) and the data layer adds to
(lorakit.data.cache.build_or_load_cached calls note_data with each cache entry's name). It lives in the data
layer so that the data layer never imports the trainers; a resumed run refuses an entry its checkpoint was
not trained on before reading or building it, so a refusal leaves the cache as it was."""

from dataclasses import dataclass, field
from typing import Any

from lorakit.core.cli import InputError

START_AFRESH = ("to start afresh pass --overwrite_output_dir (the earlier checkpoints are removed when training "
                "starts), or choose another --output_dir")


@dataclass
class RunRecord:
    """This process's run: its identity, the data entries it has read so far, and, when it resumes, the
    checkpoint and the data entries that checkpoint was trained on."""

    identity: dict[str, Any] = field(default_factory=dict)
    data: list[str] = field(default_factory=list)  # cache entry names
    checkpoint: str | None = None
    checkpoint_data: list[str] | None = None


# One run per process (resolve_resume_checkpoint begins it); the data layer adds to it as it reads.
current_run = RunRecord()


def begin_run(identity: dict[str, Any], checkpoint: str | None = None,
              checkpoint_data: list[str] | None = None) -> None:
    global current_run
    current_run = RunRecord(identity, [], checkpoint, checkpoint_data)


def note_data(name: str) -> None:
    """Record that this run reads data entry `name`; a resumed run refuses one its checkpoint was not trained on
    (called before the entry is read or built, so nothing is written)."""
    run = current_run
    if run.checkpoint_data is not None and name not in run.checkpoint_data:
        raise InputError(f"{run.checkpoint}: written by a run on other data: data {', '.join(run.checkpoint_data)} "
                         f"(checkpoint) vs {name} (now: a changed data file, tokenizer, template or length, or a "
                         "toolkit upgrade that tokenizes data differently: see the data cache versions in "
                         "data.build_dataset); "
                         f"{START_AFRESH}")
    if name not in run.data:
        run.data.append(name)


def check_all_data_read() -> None:
    """A resumed run has read every data entry its checkpoint was trained on (not fewer files)."""
    run = current_run
    missing = sorted(set(run.checkpoint_data or ()) - set(run.data))
    if missing:
        raise InputError(f"{run.checkpoint}: written by a run on more data: data {', '.join(missing)} (checkpoint) "
                         f"is not read now; {START_AFRESH}")
