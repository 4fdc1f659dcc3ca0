"""What makes a checkpoint resumable, for every stage: a completion marker (core.model_files.COMPLETION_MARKER) written
last into checkpoint-N, once every rank's files and the adapter copy are on disk and synced, holding the identity
of the run that wrote it and the size of each of its files; the choice of a checkpoint to resume from, made once
(rank 0) for every rank; and the refusal of a checkpoint that another run wrote (model, data, seed or a
shape-changing setting differ) or that some rank cannot read.

A run's identity is its models (path and config file fingerprint), the settings in RUN_DEFINING_FLAGS, the number
of processes, and its data: the names of the data cache entries it reads (data.cache.build_or_load_cached calls
data.run_record.note_data with each, PPO with its prompts' fingerprint). A resumed run refuses an entry its
checkpoint was not trained on before reading or building it, so a refusal leaves the cache as it was."""

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch.distributed as dist
from torch import nn
from transformers import (
    PreTrainedTokenizerBase,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from lorakit.core.atomic import sync_path, sync_tree, write_json_atomically
from lorakit.core.cli import InputError
from lorakit.core.model_files import COMPLETION_MARKER, checkpoint_problem, checkpoint_states, link_identical_files
from lorakit.data import run_record
from lorakit.data.run_record import START_AFRESH, check_all_data_read
from lorakit.models.zero3 import gathered
from lorakit.records.chat_templates import save_template_kwargs

if TYPE_CHECKING:
    from lorakit.models.arguments import ModelArguments
    from lorakit.trainers.arguments import ToolkitTrainingArguments

logger = logging.getLogger(__name__)

Decision = TypeVar("Decision")

# The flags naming a model or adapter the run starts from: each is recorded with its config file's fingerprint.
MODEL_FLAGS = ("model_name_or_path", "peft_path", "actor_model_name_or_path", "actor_lora_model",
               "reward_model_name_or_path", "reward_lora_model", "critic_model_name_or_path")
# Settings a resumed run must share with the run that wrote its checkpoint: they change the trained weights' shapes,
# the batches, or which samples are trained on. The learning rate, the number of steps and the logging and saving
# schedule may change on a resume.
RUN_DEFINING_FLAGS = (
    "seed", "data_seed", "full_finetuning", "lora_rank", "lora_alpha", "trainable", "modules_to_save",
    "load_in_kbits", "torch_dtype", "per_device_train_batch_size", "gradient_accumulation_steps", "block_size",
    "max_seq_length", "packing", "validation_split_percentage", "max_train_samples", "data_split", "data_phase",
    "train_on_last_turn_only", "loss_type", "shared_base", "max_prompt_seq_len", "max_answer_seq_len",
    "per_device_generation_batch_size", "generation_batches", "ppo_epochs", "enable_ema",
)


# ----------------------------------------------------------------------------- the run's identity


def config_fingerprint(path: str) -> str | None:
    """blake2b of the directory's config.json (a model) or adapter_config.json (an adapter); None for neither."""
    for name in ("config.json", "adapter_config.json"):
        config = os.path.join(path, name)
        if os.path.isfile(config):
            with open(config, "rb") as handle:
                return f"{name} {hashlib.blake2b(handle.read(), digest_size=8).hexdigest()}"
    return None


def run_identity(model_args: "ModelArguments", data_args: Any, training_args: TrainingArguments) -> dict[str, Any]:
    """{name: value} of what defines this run but its data: every model flag's directory and config fingerprint,
    RUN_DEFINING_FLAGS as given, and the number of processes. JSON values, as the marker stores them."""
    sources = (model_args, data_args, training_args)
    identity = {}
    for flag in MODEL_FLAGS:
        path = next((getattr(s, flag) for s in sources if getattr(s, flag, None)), None)
        if path:
            local = os.path.isdir(path)
            identity[f"--{flag}"] = os.path.realpath(path) if local else path
            identity[f"--{flag} config"] = config_fingerprint(path) if local else None
    for flag in RUN_DEFINING_FLAGS:
        for source in sources:
            if hasattr(source, flag):
                identity[f"--{flag}"] = getattr(source, flag)
    identity["processes"] = training_args.world_size
    return json.loads(json.dumps(identity))


def identity_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'name old (checkpoint) vs new (now)' for every entry that differs."""
    names = list(current) + [name for name in recorded if name not in current]
    return [f"{name} {json.dumps(recorded.get(name))} (checkpoint) vs {json.dumps(current.get(name))} (now)"
            for name in names if recorded.get(name) != current.get(name)]


# ----------------------------------------------------------------------------- one decision for every rank


def process_count() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    if process_count() > 1:
        dist.barrier()


def rank_zero_decides(decide: Callable[[], Decision]) -> Decision:
    """decide() run on rank 0 alone, its result (or its refusal, raised again) on every rank: a decision read from
    a disk must not differ between nodes."""
    if process_count() == 1:
        return decide()
    outcome = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = (decide(), None)
        except InputError as err:
            outcome[0] = (None, str(err))
    dist.broadcast_object_list(outcome, src=0)
    value, refusal = outcome[0]
    if refusal is not None:
        raise InputError(refusal)
    return value


def refuse_unless_every_rank_agrees(checkpoint: str, unreadable: str | None, refusal: str | None) -> None:
    """Raise on every rank, so that no rank trains while another stops: first that some rank cannot read the
    checkpoint (why, on the first such rank), else rank 0's refusal of it (its identity differs)."""
    found = [(unreadable, refusal)]
    if process_count() > 1:
        found = [None] * process_count()
        dist.all_gather_object(found, (unreadable, refusal))
    failing = [rank for rank, (problem, _) in enumerate(found) if problem is not None]
    if failing and failing[0] == 0:
        raise InputError(f"{checkpoint}: {found[0][0]}")
    if failing:
        raise InputError(f"{checkpoint}: rank 0 resumes from it, but rank(s) {', '.join(map(str, failing))} cannot "
                         f"({checkpoint}: {found[failing[0]][0]}): every node must see the same --output_dir (a "
                         f"shared filesystem); or {START_AFRESH}")
    if found[0][1] is not None:
        raise InputError(found[0][1])


def resumable_checkpoint_data(checkpoint: str, identity: dict[str, Any]) -> list[str]:
    """The data entries of the checkpoint rank 0 chose, once every rank has read its marker and rank 0 found this
    run's identity in it; a refusal (on every rank) naming what differs otherwise."""
    unreadable, refusal, record = checkpoint_problem(checkpoint), None, {}
    if unreadable is None:
        with open(os.path.join(checkpoint, COMPLETION_MARKER), encoding="utf-8") as handle:
            record = json.load(handle)
        differences = identity_differences(record.get("identity", {}), identity)
        if differences:
            refusal = (f"{checkpoint}: written by a run that differs from this one: {'; '.join(differences)}; "
                       f"{START_AFRESH}")
    refuse_unless_every_rank_agrees(checkpoint, unreadable, refusal)
    return record.get("data", [])


# ----------------------------------------------------------------------------- writing a checkpoint


def file_sizes(directory: str) -> dict[str, int]:
    sizes = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, directory)] = os.path.getsize(path)
    return dict(sorted(sizes.items()))


def write_completion_marker(checkpoint: str, record: dict[str, Any]) -> None:
    """The completion marker, atomically; then the output directory that names checkpoint-N is synced too."""
    write_json_atomically(os.path.join(checkpoint, COMPLETION_MARKER), record, indent=1)
    sync_path(os.path.dirname(checkpoint))


def clear_for_checkpoint(args: TrainingArguments, step: int) -> None:
    """Before the Trainer writes checkpoint-N: a checkpoint-N left by an earlier attempt (a save cut short, or a
    run resumed from an earlier step) is removed, so that no file or marker of it outlives the new save."""
    path = os.path.join(args.output_dir, f"checkpoint-{step}")
    if args.should_save and os.path.isdir(path):
        logger.info("%s is left from an earlier attempt (%s): removed before it is saved again", path,
                    checkpoint_problem(path) or "complete")
        shutil.rmtree(path)
    barrier()


def rotate_checkpoints(output_dir: str, limit: int | None, newest: str, protected: set[str]) -> None:
    """--save_total_limit among complete checkpoints: the newest `limit` (and the best one) stay; older ones go, as
    does any incomplete one older than `newest` (a save that never finished and is superseded). Incomplete ones
    beyond it stay, for the run to replace when it gets there."""
    if not limit or limit <= 0:
        return
    states = checkpoint_states(output_dir)  # by step
    keep = set([path for _, path, problem in states if problem is None][-limit:]) | protected
    newest_step = next(step for step, path, _ in states if path == newest)
    for step, path, _ in states:
        if step < newest_step and path not in keep:
            logger.info("removing %s (--save_total_limit %d)", path, limit)
            shutil.rmtree(path, ignore_errors=True)


def mark_checkpoint_complete(args: TrainingArguments, state: TrainerState) -> None:
    """Every rank calls it after checkpoint-N is saved (on_save): each syncs what it wrote, all wait for each other,
    then the saving process writes the marker and rotates the checkpoints (the Trainer's own rotation is held back
    until now: it would remove the last complete checkpoint before the new one is complete)."""
    checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
    if os.path.isdir(checkpoint):
        sync_tree(checkpoint)  # what this node wrote reaches its disk
    barrier()
    if not args.should_save:
        return
    run = run_record.current_run
    write_completion_marker(checkpoint, {"step": state.global_step, "identity": run.identity, "data": sorted(run.data),
                              "files": file_sizes(checkpoint)})
    best = state.best_model_checkpoint
    rotate_checkpoints(args.output_dir, args.save_total_limit, checkpoint, {best} if best else set())


class CheckpointCompletion(TrainerCallback):
    """Writes checkpoint-N's completion marker. ResumableTrainer keeps it (or SavePeftModelCallback, which
    extends it) last among the callbacks, so that it runs after every other on_save."""

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        mark_checkpoint_complete(args, state)


# ----------------------------------------------------------------------------- starting to write


def start_writing(args: "ToolkitTrainingArguments", resume_checkpoint: str | None) -> None:
    """The last refusal (a resumed run reading less data than its checkpoint's), then --overwrite_output_dir's
    removal of the earlier run's checkpoints: only now, after every refusal, as training starts to write."""
    check_all_data_read()
    if args.overwrite_output_dir and args.should_save:
        resumed = os.path.realpath(resume_checkpoint) if resume_checkpoint else None
        earlier = [path for _, path, _ in checkpoint_states(args.output_dir) if os.path.realpath(path) != resumed]
        if earlier:
            logger.info("--overwrite_output_dir: removing %d checkpoint(s) of an earlier run in %s: %s", len(earlier),
                        args.output_dir, ", ".join(os.path.basename(path) for path in earlier))
        for path in earlier:
            shutil.rmtree(path)
    barrier()


def save_adapter(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, path: str, is_main_process: bool) -> None:
    """Adapter + tokenizer in `path`. Under ZeRO-3 the adapter weights are gathered first
    (every rank must call this), the frozen base is not."""
    with gathered(p for p in model.parameters() if p.requires_grad):
        if is_main_process:
            model.save_pretrained(path)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
                save_template_kwargs(tokenizer, path)


class SavePeftModelCallback(CheckpointCompletion):
    """Write the adapter and tokenizer to checkpoint-N/<name> at every save and to
    output_dir/<name> at the end, as Chinese-LLaMA-Alpaca-2's scripts lay them out; then, the
    checkpoint's last file, its completion marker (a crash before it leaves the checkpoint
    incomplete, never resumed from)."""

    def __init__(self, adapter_dir_name: str) -> None:
        self.adapter_dir_name = adapter_dir_name

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                model: nn.Module | None = None, processing_class: PreTrainedTokenizerBase | None = None,
                **kwargs: Any) -> None:
        checkpoint_dir = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        adapter_dir = os.path.join(checkpoint_dir, self.adapter_dir_name)
        if args.should_save and os.path.isdir(adapter_dir):
            # Rewritten in place, a file hard-linked to the Trainer's copy would change that copy too.
            shutil.rmtree(adapter_dir)
        save_adapter(model, processing_class, adapter_dir, args.should_save)
        if args.should_save:
            link_identical_files(adapter_dir, checkpoint_dir)
        super().on_save(args, state, control, **kwargs)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     model: nn.Module | None = None, processing_class: PreTrainedTokenizerBase | None = None,
                     **kwargs: Any) -> None:
        save_adapter(model, processing_class, os.path.join(args.output_dir, self.adapter_dir_name), args.should_save)
