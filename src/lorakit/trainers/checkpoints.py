"""What makes a checkpoint resumable, for every stage: a completion marker (core.model_files.COMPLETION_MARKER) written
last into checkpoint-N, once every rank's files and the adapter copy are on disk and synced and its trainable weights
are found finite, holding the identity of the run that wrote it and the size and content hash of each of its files;
the choice of a checkpoint to resume from, made once (rank 0) for every rank, its files' hashes verified once per
node; and the refusal of a checkpoint that another run wrote (models, data, seed, a shape-, order-, optimizer-,
precision- or objective-defining setting differ) or that some rank cannot read.

A run's identity is its models (path, config file fingerprint and weights fingerprint, the weights read once per node
and then only stat-ed: core.fingerprints), the settings in RUN_DEFINING_FLAGS and OBJECTIVE_FLAGS, the DeepSpeed
config's stage, offload and precision, the number of processes, the content of the files of the user's reward
functions (GRPO's --reward_funcs: reward_file_contents), and its data: the names of the data cache entries it
reads (data.cache.build_or_load_cached calls data.run_record.note_data with each, PPO with its prompts' fingerprint).
A resumed run refuses an entry its checkpoint was not trained on before reading or building it, so a refusal leaves
the cache as it was. A marker of an earlier identity_version resumes with one line naming what it could not check.
Every adapter saved records its base's weights fingerprint (core.model_files.BASE_RECORD) for merge and serving."""

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar, cast

import torch
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
from lorakit.core.cli import InputError, ReportedError
from lorakit.core.fingerprints import FingerprintMemo, file_fingerprint, save_weights_memo, weights_fingerprint
from lorakit.core.model_files import (
    BASE_RECORD,
    COMPLETION_MARKER,
    checkpoint_problem,
    checkpoint_states,
    complete_checkpoints,
    link_identical_files,
)
from lorakit.data import run_record
from lorakit.data.cache import data_cache_dir
from lorakit.data.run_record import START_AFRESH, check_all_data_read
from lorakit.models.zero3 import gathered
from lorakit.records.chat_templates import save_template_kwargs

if TYPE_CHECKING:
    from lorakit.models.arguments import ModelArguments
    from lorakit.trainers.arguments import ToolkitTrainingArguments

logger = logging.getLogger(__name__)

Decision = TypeVar("Decision")

# The flags naming a model or adapter the run starts from: each is recorded with its config file's fingerprint and
# its weights' (core.fingerprints.weights_fingerprint: every weight file's content hash, memoized per node).
MODEL_FLAGS = ("model_name_or_path", "peft_path", "actor_model_name_or_path", "actor_lora_model",
               "reward_model_name_or_path", "reward_lora_model", "critic_model_name_or_path")
# Settings a resumed run must share with the run that wrote its checkpoint: they change the trained weights' shapes,
# the batches, which samples are trained on and in what order, the optimizer and the precision, or the objective.
# The learning rate, the number of steps and the logging and saving schedule may change on a resume.
RUN_DEFINING_FLAGS = (
    "seed", "data_seed", "full_finetuning", "lora_rank", "lora_alpha", "trainable", "lora_experts", "modules_to_save",
    "load_in_kbits", "torch_dtype", "per_device_train_batch_size", "gradient_accumulation_steps", "block_size",
    "max_seq_length", "packing", "max_tokens_per_batch", "validation_split_percentage", "max_train_samples",
    "data_split", "data_phase",
    "train_on_last_turn_only", "loss_type", "shared_base", "max_prompt_seq_len", "max_answer_seq_len",
    "per_device_generation_batch_size", "generation_batches", "ppo_epochs", "enable_ema", "num_generations",
    "max_completion_length", "num_iterations",
    # the sample order, the optimizer and the precision (the DeepSpeed config's own fields: deepspeed_identity)
    "train_sampling_strategy", "group_by_length", "dataloader_drop_last", "ignore_data_skip", "optim", "bf16", "fp16",
)
# Each stage's objective beyond the flags above (a flag a stage does not have is not recorded for it): the loss
# (DPO's, the reward model's centring, SFT's label smoothing and NEFTune noise) and PPO's rewards, KL, clipping,
# advantages, sampling, EMA and ptx weight; the group-relative methods' groups, clipping, estimators and rewards.
OBJECTIVE_FLAGS = (
    "beta", "label_smoothing", "simpo_gamma", "rpo_alpha", "precompute_ref_log_probs", "reward_center_coef",
    "label_smoothing_factor", "neftune_noise_alpha", "kl_ctl", "target_kl", "kl_horizon", "clip_reward_value",
    "cliprange", "cliprange_value", "gamma", "lam", "temperature", "top_p", "top_k", "missing_eos_penalty",
    "ema_beta", "unsup_coef", "sampler_correction", "sampler_correction_cap", "epsilon", "epsilon_high",
    "scale_rewards", "advantage_estimator", "kl_estimator", "importance_sampling_level", "dynamic_sampling",
    "mask_truncated_completions", "reward_funcs", "reward_weights", "overlong_buffer",
)
# A marker's identity_version: 2 records the weights, the sample order, optimizer, precision and objective, and each
# file's content hash. A checkpoint of version 1 (no identity_version) resumes with one line naming what its
# identity could not check (ARCHITECTURE.md, "Upgrades").
IDENTITY_VERSION = 2
# Entries that joined the identity after version 2 markers were first written: absent from such a marker, they are
# named in one line, not compared (ARCHITECTURE.md, "Upgrades").
ADDED_SINCE_VERSION_2 = ("--lora_experts", "--max_tokens_per_batch", "--reward_funcs contents")


# ----------------------------------------------------------------------------- the run's identity


def config_fingerprint(path: str) -> str | None:
    """blake2b of the directory's config.json (a model) or adapter_config.json (an adapter); None for neither."""
    for name in ("config.json", "adapter_config.json"):
        config = os.path.join(path, name)
        if os.path.isfile(config):
            with open(config, "rb") as handle:
                return f"{name} {hashlib.blake2b(handle.read(), digest_size=8).hexdigest()}"
    return None


def deepspeed_identity(config: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """The DeepSpeed config's fields that decide the optimizer's state and the precision: the ZeRO stage, where
    the optimizer and the parameters are offloaded, and its bf16/fp16 switches (an "auto" stays "auto": the
    --bf16/--fp16 flags it follows are recorded themselves). None without DeepSpeed. The file's other fields (batch
    sizes, bucket sizes, logging) may change on a resume."""
    if not config:
        return None
    if isinstance(config, str):
        with open(config, encoding="utf-8") as handle:
            values: dict[str, Any] = json.load(handle)
    else:
        values = config
    zero = values.get("zero_optimization") or {}

    def offload(section: str) -> Any:
        value = zero.get(section)
        device = value.get("device") if isinstance(value, dict) else value
        return None if device in (None, "none") else device

    return {"zero_stage": zero.get("stage", 0), "offload_optimizer": offload("offload_optimizer"),
            "offload_param": offload("offload_param"), "bf16": (values.get("bf16") or {}).get("enabled", False),
            "fp16": (values.get("fp16") or {}).get("enabled", False)}


def model_identity(sources: tuple[Any, ...], memo: FingerprintMemo | None) -> dict[str, Any]:
    """Every model flag's directory (or hub name), its config file's fingerprint and its weights' fingerprint."""
    identity, weights = {}, {}
    for flag in MODEL_FLAGS:
        path = next((getattr(s, flag) for s in sources if getattr(s, flag, None)), None)
        if path:
            local = os.path.isdir(path)
            real = os.path.realpath(path) if local else path
            if local and real not in weights:  # PPO's --model_name_or_path is its actor's: read once
                weights[real] = weights_fingerprint(path, memo)
            identity[f"--{flag}"] = real
            identity[f"--{flag} config"] = config_fingerprint(path) if local else None
            identity[f"--{flag} weights"] = weights[real] if local else None
    return identity


def run_identity(model_args: "ModelArguments", data_args: Any, training_args: TrainingArguments,
                 memo: FingerprintMemo | None = None) -> dict[str, Any]:
    """{name: value} of what defines this run but its data: every model flag's directory, config and weights
    fingerprints (memo: the weight files' content hashes, read once per node), RUN_DEFINING_FLAGS and
    OBJECTIVE_FLAGS as given, the DeepSpeed config's optimizer and precision fields, and the number of processes.
    JSON values, as the marker stores them."""
    sources = (model_args, data_args, training_args)
    identity = model_identity(sources, memo)
    for flag in RUN_DEFINING_FLAGS + OBJECTIVE_FLAGS:
        for source in sources:
            if hasattr(source, flag):
                identity[f"--{flag}"] = getattr(source, flag)
    identity["--deepspeed"] = deepspeed_identity(getattr(training_args, "deepspeed", None))
    contents = reward_file_contents(getattr(training_args, "reward_funcs", None) or [])
    if contents:  # only where a user's file is named: a run of built-ins has nothing more to check
        identity["--reward_funcs contents"] = contents
    identity["processes"] = training_args.world_size
    return json.loads(json.dumps(identity, default=str))


def reward_file_contents(reward_funcs: list[str]) -> dict[str, str | None]:
    """{file: content hash} of each user reward function's file: `path/to/file.py:function`'s file, or the source
    file of `module:function`'s module (None where it has none). A reward edited in place, under the same name,
    changes what the run optimizes (a resume's reward_mean jumped from 0.125 to 2.5): a resume must refuse it.
    The built-ins (no ':') have no file. The module's own file only, not what it imports."""
    contents = {}
    for entry in map(str, reward_funcs):
        module = entry.rpartition(":")[0]
        if not module:
            continue
        path = module if module.endswith(".py") else module_file(module)
        contents[module] = file_fingerprint(path) if path and os.path.isfile(path) else None
    return contents


def module_file(module: str) -> str | None:
    """The source file of an importable module (the GRPO command imported it before the identity is taken), or None."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.has_location else None


def identity_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'name old (checkpoint) vs new (now)' for every entry that differs."""
    names = list(current) + [name for name in recorded if name not in current]
    return [f"{name} {json.dumps(recorded.get(name))} (checkpoint) vs {json.dumps(current.get(name))} (now)"
            for name in names if recorded.get(name) != current.get(name)]


class IdentityCheck(NamedTuple):
    """What a checkpoint's marker says about this run: the differences that refuse it, and for a marker of an
    earlier version the one line naming what could not be checked (None otherwise)."""

    differences: list[str]
    upgrade_note: str | None


def check_identity(checkpoint: str, record: dict[str, Any], identity: dict[str, Any]) -> IdentityCheck:
    """Compare a marker with this run's identity. A marker written before IDENTITY_VERSION lacks the entries added
    since: those are not compared, and named in the note (as is its files' content, which it did not hash)."""
    recorded = record.get("identity", {})
    if record.get("identity_version", 1) >= IDENTITY_VERSION:
        # A flag added to the identity since the marker was written is not in it: not compared, and named, as the
        # Upgrades convention asks. Only those: a model flag absent from a marker is one its run did not give.
        added = [name for name in identity if name not in recorded and name in ADDED_SINCE_VERSION_2]
        note = (f"{checkpoint}: written before {', '.join(added)} joined the run identity: resuming without checking "
                "them" if added else None)
        return IdentityCheck(identity_differences(recorded, {k: v for k, v in identity.items() if k not in added}),
                             note)
    unchecked = [name for name in identity if name not in recorded]
    note = (f"{checkpoint}: written by an earlier version of the toolkit: resuming without checking "
            f"{', '.join(unchecked) or 'nothing more'} (not recorded then), nor its files' content (their sizes "
            "only); if a model's weights changed since, pass --overwrite_output_dir to start afresh instead")
    return IdentityCheck(identity_differences(recorded, {k: v for k, v in identity.items() if k in recorded}), note)


def weights_note(differences: list[str]) -> str:
    """What a changed weights fingerprint may also mean, for the refusal."""
    if any(" weights " in difference for difference in differences):
        return (" (the weights differ in content: retrained or rebuilt at the same path; the same weights re-saved "
                "in another layout, shards or dtype, count as different too)")
    return ""


def content_problem(checkpoint: str, record: dict[str, Any]) -> str | None:
    """The first file whose content hash is not the one its marker recorded (damaged on disk, or edited, even at
    the same size), or None."""
    for name, digest in (record.get("hashes") or {}).items():
        if file_fingerprint(os.path.join(checkpoint, name)) != digest:
            return f"{name} is not what was saved (its content hash differs, at the same size: damaged or edited)"
    return None


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
    outcome: list[tuple[Decision, None] | tuple[None, str] | None] = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = (decide(), None)
        except InputError as err:
            outcome[0] = (None, str(err))
    dist.broadcast_object_list(outcome, src=0)
    decided = outcome[0]
    assert decided is not None  # rank 0's, on every rank now (rank 0 raised any other error itself)
    if decided[1] is not None:
        raise InputError(decided[1])
    return decided[0]


def refuse_unless_every_rank_agrees(checkpoint: str, unreadable: str | None, refusal: str | None) -> None:
    """Raise on every rank, so that no rank trains while another stops: first that some rank cannot read the
    checkpoint (why, on the first such rank), else rank 0's refusal of it (its identity differs)."""
    found = [(unreadable, refusal)]
    if process_count() > 1:
        found = [(None, None)] * process_count()  # placeholders, each replaced by a rank's pair
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
    """The data entries of the checkpoint rank 0 chose, once every rank has read its marker (the first process of
    each node also checks its files' content hashes) and rank 0 found this run's identity in it; a refusal (on every
    rank) naming what differs otherwise. A marker of an earlier version resumes with one line naming what could not
    be checked."""
    unreadable, refusal, record, upgrade_note = checkpoint_problem(checkpoint), None, {}, None
    if unreadable is None:
        with open(os.path.join(checkpoint, COMPLETION_MARKER), encoding="utf-8") as handle:
            record = json.load(handle)
        if os.environ.get("LOCAL_RANK", "0") == "0":
            unreadable = content_problem(checkpoint, record)
            if unreadable is not None:
                unreadable += f"; remove {checkpoint} to resume from an earlier checkpoint, or {START_AFRESH}"
        differences, upgrade_note = check_identity(checkpoint, record, identity)
        if differences:
            refusal = (f"{checkpoint}: written by a run that differs from this one: {'; '.join(differences)}"
                       f"{weights_note(differences)}; {START_AFRESH}")
    refuse_unless_every_rank_agrees(checkpoint, unreadable, refusal)
    if upgrade_note is not None and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning(upgrade_note)
    return record.get("data", [])


# ----------------------------------------------------------------------------- writing a checkpoint


def file_sizes(directory: str) -> dict[str, int]:
    sizes = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, directory)] = os.path.getsize(path)
    return dict(sorted(sizes.items()))


def file_hashes(directory: str) -> dict[str, str]:
    """{file: content hash} of every file below directory (what a resume verifies)."""
    return {name: file_fingerprint(os.path.join(directory, name)) for name in file_sizes(directory)}


def write_completion_marker(checkpoint: str, record: dict[str, Any]) -> None:
    """The completion marker, atomically; then the output directory that names checkpoint-N is synced too."""
    write_json_atomically(os.path.join(checkpoint, COMPLETION_MARKER), record, indent=1)
    sync_path(os.path.dirname(checkpoint))


def output_dir_of(args: TrainingArguments) -> str:
    """args.output_dir: transformers types it str | None, and TrainingArguments.__post_init__ sets it
    ("trainer_output") where it was not given."""
    if args.output_dir is None:
        raise ValueError("TrainingArguments.output_dir is None: its __post_init__ has not run on these arguments")
    return args.output_dir


def clear_for_checkpoint(args: TrainingArguments, step: int) -> None:
    """Before the Trainer writes checkpoint-N: a checkpoint-N left by an earlier attempt (a save cut short, or a
    run resumed from an earlier step) is removed, so that no file or marker of it outlives the new save."""
    path = os.path.join(output_dir_of(args), f"checkpoint-{step}")
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


class NonFiniteWeights(ReportedError):
    """A checkpoint's trainable weights hold NaN or infinite values: it is not marked complete."""

    exit_status = 3


def nonfinite_weights(model: nn.Module | None) -> list[str]:
    """The trainable parameters holding a NaN or infinity, on this rank (under ZeRO-3, its partition of each)."""
    if model is None:
        return []
    found = []
    for name, parameter in model.named_parameters():
        local = getattr(parameter, "ds_tensor", parameter)
        if parameter.requires_grad and local.numel() and not torch.isfinite(local.detach()).all():
            found.append(name)
    return found


def check_weights_finite(checkpoint: str, model: nn.Module | None) -> None:
    """Refuse to mark checkpoint complete, on every rank, when any rank's trainable weights are not finite: an
    update can go non-finite after a finite loss (StopOnNonFinite sees only the loss and gradient norm)."""
    found = [nonfinite_weights(model)]
    if process_count() > 1:
        found = [[]] * process_count()  # placeholders, each replaced by a rank's list
        dist.all_gather_object(found, nonfinite_weights(model))
    names = sorted({name for names in found for name in names})
    if names:
        earlier = [path for path in complete_checkpoints(os.path.dirname(checkpoint)) if path != checkpoint]
        last = f"the last complete checkpoint {earlier[-1]} resumes" if earlier else "no complete checkpoint is left"
        raise NonFiniteWeights(f"{checkpoint}: training stopped: trainable weights hold NaN or infinite values "
                               f"({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}) after a finite loss; the "
                               f"checkpoint is not marked complete, {last}; lower --learning_rate before resuming")


def mark_checkpoint_complete(args: TrainingArguments, state: TrainerState, model: nn.Module | None = None) -> None:
    """Every rank calls it after checkpoint-N is saved (on_save): all wait until every rank has written its part,
    each syncs what its node holds, all wait again and check that the trainable weights are finite, then the saving
    process writes the marker (the identity, and each file's size and content hash) and rotates the checkpoints (the
    Trainer's own rotation is held back until now: it would remove the last complete checkpoint before the new one
    is complete)."""
    checkpoint = os.path.join(output_dir_of(args), f"checkpoint-{state.global_step}")
    # The first wait: a rank that walks the checkpoint while the saving rank still writes its adapter (temporary
    # names renamed away, files replaced by links) would find a listed file gone.
    barrier()
    if os.path.isdir(checkpoint):
        sync_tree(checkpoint)  # what this node wrote reaches its disk
    barrier()
    check_weights_finite(checkpoint, model)
    if not args.should_save:
        return
    run = run_record.current_run
    write_completion_marker(checkpoint, {"step": state.global_step, "identity_version": IDENTITY_VERSION,
                                         "identity": run.identity, "data": sorted(run.data),
                                         "files": file_sizes(checkpoint), "hashes": file_hashes(checkpoint)})
    best = state.best_model_checkpoint
    rotate_checkpoints(output_dir_of(args), args.save_total_limit, checkpoint, {best} if best else set())


class CheckpointCompletion(TrainerCallback):
    """Writes checkpoint-N's completion marker. ResumableTrainer keeps it (or SavePeftModelCallback, which
    extends it) last among the callbacks, so that it runs after every other on_save."""

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                model: nn.Module | None = None, **kwargs: Any) -> None:
        mark_checkpoint_complete(args, state, model)


# ----------------------------------------------------------------------------- starting to write

# The weight fingerprints this process (rank 0) read for the run's identity, and the memo root they are kept in: kept
# only once every refusal is past (start_writing), so that a refused run writes nothing.
pending_memos: list[tuple[FingerprintMemo, str]] = []


def identify_run(model_args: "ModelArguments", data_args: Any, training_args: TrainingArguments) -> dict[str, Any]:
    """run_identity, computed on rank 0 (the weights read once, their fingerprints memoized in the run's data cache,
    one per node) and given to every rank."""
    def identify() -> dict[str, Any]:
        root = data_cache_dir(getattr(data_args, "data_cache_dir", None))
        memo = FingerprintMemo(root)
        identity = run_identity(model_args, data_args, training_args, memo)
        pending_memos.append((memo, root))
        return identity

    return rank_zero_decides(identify)


def save_pending_memo() -> None:
    while pending_memos:
        memo, root = pending_memos.pop()
        save_weights_memo(memo, root)


def start_writing(args: "ToolkitTrainingArguments", resume_checkpoint: str | None) -> None:
    """The last refusal (a resumed run reading less data than its checkpoint's), then --overwrite_output_dir's
    removal of the earlier run's checkpoints: only now, after every refusal, as training starts to write."""
    check_all_data_read()
    save_pending_memo()
    if args.overwrite_output_dir and args.should_save:
        resumed = os.path.realpath(resume_checkpoint) if resume_checkpoint else None
        earlier = [path for _, path, _ in checkpoint_states(output_dir_of(args)) if os.path.realpath(path) != resumed]
        if earlier:
            logger.info("--overwrite_output_dir: removing %d checkpoint(s) of an earlier run in %s: %s", len(earlier),
                        args.output_dir, ", ".join(os.path.basename(path) for path in earlier))
        for path in earlier:
            shutil.rmtree(path)
    barrier()


def write_base_record(adapter_dir: str) -> None:
    """core.model_files.BASE_RECORD in a saved adapter: the base this run trains it on, by path and weights
    fingerprint (from the run's identity), which merge and serving compare with the base they are given."""
    identity = run_record.current_run.identity
    flag = next((f for f in ("--actor_model_name_or_path", "--model_name_or_path") if identity.get(f)), None)
    if flag is None or not identity.get(f"{flag} weights"):
        return  # a base from the hub, or no run: nothing to record
    write_json_atomically(os.path.join(adapter_dir, BASE_RECORD),
                          {"base_model_name_or_path": identity[flag], "weights": identity[f"{flag} weights"]})


class AdapterSaver(Protocol):
    """A model whose save_pretrained writes its trained adapter: a PeftModel, or an RL policy (its actor's)."""

    def save_pretrained(self, save_directory: str) -> None: ...


def save_adapter(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, path: str, is_main_process: bool) -> None:
    """Adapter + tokenizer in `path`. Under ZeRO-3 the adapter weights are gathered first
    (every rank must call this), the frozen base is not."""
    with gathered(p for p in model.parameters() if p.requires_grad):
        if is_main_process:
            # nn.Module's __getattr__ would type the method as a Tensor or a Module.
            cast(AdapterSaver, model).save_pretrained(path)
            write_base_record(path)
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
        assert model is not None  # the Trainer hands its model to every callback event
        checkpoint_dir = os.path.join(output_dir_of(args), f"checkpoint-{state.global_step}")
        adapter_dir = os.path.join(checkpoint_dir, self.adapter_dir_name)
        if args.should_save and os.path.isdir(adapter_dir):
            # Rewritten in place, a file hard-linked to the Trainer's copy would change that copy too.
            shutil.rmtree(adapter_dir)
        save_adapter(model, processing_class, adapter_dir, args.should_save)
        if args.should_save:
            link_identical_files(adapter_dir, checkpoint_dir)
        super().on_save(args, state, control, model=model, **kwargs)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     model: nn.Module | None = None, processing_class: PreTrainedTokenizerBase | None = None,
                     **kwargs: Any) -> None:
        assert model is not None  # the Trainer hands its model to every callback event
        save_adapter(model, processing_class, os.path.join(output_dir_of(args), self.adapter_dir_name),
                     args.should_save)
