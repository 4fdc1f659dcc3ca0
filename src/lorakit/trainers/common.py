"""A run's start and finish, shared by every stage: parsing its arguments (the bad-input contract: one line, exit
2), logging, the output-directory and resume rules, the checks made before any data is tokenized, and the
run_clm-style results at the end. The flags are trainers.arguments', the Trainers trainers.causal_lm's."""

import logging
import os
import sys
from collections.abc import Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import transformers
from transformers import PreTrainedConfig, PreTrainedTokenizerBase, TrainingArguments
from transformers.trainer_utils import TrainOutput

from lorakit.core.cli import InputError, parse_args
from lorakit.core.model_files import checkpoint_problem, checkpoint_states
from lorakit.data.run_record import begin_run
from lorakit.models.arguments import ModelArguments
from lorakit.models.loader import check_load_plan, check_model_inputs, load_model_config, load_tokenizer
from lorakit.trainers.arguments import ToolkitTrainingArguments, map_half_weights_on_cpu
from lorakit.trainers.checkpoints import (
    identify_run,
    output_dir_of,
    rank_zero_decides,
    resumable_checkpoint_data,
    start_writing,
)

if TYPE_CHECKING:
    from transformers import Trainer  # annotations only: this module needs no transformers.trainer loaded

logger = logging.getLogger(__name__)


def setup_logging(training_args: TrainingArguments) -> None:
    """Our messages at INFO on the main process only; libraries at the Trainer's log level."""
    is_main = training_args.should_log
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        level=logging.INFO if is_main else logging.WARNING,
        stream=sys.stdout,
        force=True,
    )
    level = training_args.get_process_log_level()
    transformers.utils.logging.set_verbosity(level)
    import datasets

    datasets.utils.logging.set_verbosity(max(level, logging.WARNING))
    if not is_main:
        datasets.disable_progress_bars()
    for note in getattr(training_args, "mapped_flags", []):
        logger.info("flag mapped: %s", note)
    logger.info(
        "process %d of %d, device %s, distributed: %s",
        training_args.process_index,
        training_args.world_size,
        training_args.device,
        training_args.parallel_mode.value,
    )


def choose_resume_checkpoint(training_args: ToolkitTrainingArguments) -> str | None:
    """Where training starts, read from this process's disk: an explicit --resume_from_checkpoint wins;
    otherwise the last complete checkpoint in output_dir (incomplete ones are skipped, each named in the log);
    a non-empty output_dir without one is refused unless --overwrite_output_dir. --resume_from_checkpoint false
    never resumes: an output_dir that is not empty is refused unless --overwrite_output_dir."""
    output_dir = output_dir_of(training_args)
    requested = training_args.resume_from_checkpoint
    if requested and requested.lower() == "false":
        start_without_resuming(training_args)
        return None
    if requested and requested.lower() not in ("true", "false"):
        if not os.path.isfile(os.path.join(requested, "trainer_state.json")):
            raise InputError(f"{requested}: --resume_from_checkpoint is not a complete checkpoint "
                             "(no trainer_state.json)")
        problem = checkpoint_problem(requested)
        if problem:
            raise InputError(f"{requested}: --resume_from_checkpoint is not a complete checkpoint ({problem})")
        return requested
    if not os.path.isdir(output_dir) or not os.listdir(output_dir):
        if requested and requested.lower() == "true":
            raise InputError(f"{output_dir}: --resume_from_checkpoint true but output_dir holds no checkpoint")
        return None
    states = checkpoint_states(output_dir)
    if training_args.overwrite_output_dir:
        logger.info("%s is not empty: --overwrite_output_dir given, training from scratch%s", output_dir,
                    " (its checkpoints are removed when training starts)" if states else "")
        return None
    for _, path, problem in states:
        if problem:
            logger.warning("skipping %s: %s", path, problem)
    checkpoints = [path for _, path, problem in states if problem is None]
    if checkpoints:
        logger.info("resuming from %s (last complete checkpoint in output_dir)", checkpoints[-1])
        return checkpoints[-1]
    raise InputError(
        f"{output_dir}: --output_dir is not empty and holds no complete checkpoint to resume; "
        "pass --overwrite_output_dir to train into it anyway, or choose another directory"
    )


def start_without_resuming(training_args: ToolkitTrainingArguments) -> None:
    """--resume_from_checkpoint false: a fresh start, into an empty output_dir or with --overwrite_output_dir."""
    output_dir = output_dir_of(training_args)
    if not os.path.isdir(output_dir) or not os.listdir(output_dir) or training_args.overwrite_output_dir:
        if training_args.overwrite_output_dir and checkpoint_states(output_dir):
            logger.info("--resume_from_checkpoint false --overwrite_output_dir: training from scratch (the checkpoints "
                        "in %s are removed when training starts)", output_dir)
        return
    held = [os.path.basename(path) for _, path, _ in checkpoint_states(output_dir)]
    raise InputError(f"{output_dir}: --resume_from_checkpoint false, but --output_dir is not empty"
                     + (f" (it holds {', '.join(held)})" if held else "")
                     + "; pass --overwrite_output_dir to train afresh into it, or choose another directory")


def resolve_resume_checkpoint(training_args: ToolkitTrainingArguments, model_args: ModelArguments,
                              data_args: Any) -> str | None:
    """Decide, before anything is written, where training starts: rank 0 chooses (choose_resume_checkpoint) for
    every rank; a checkpoint some rank cannot read, or written by a run whose identity (trainers.checkpoints: models,
    seed, shape-changing settings, processes) differs from this one, is refused on every rank. Begins this
    process's run record, against which the data read next is checked when resuming."""
    checkpoint = rank_zero_decides(lambda: choose_resume_checkpoint(training_args))
    identity = identify_run(model_args, data_args, training_args)
    checkpoint_data = resumable_checkpoint_data(checkpoint, identity) if checkpoint else None
    begin_run(identity, checkpoint, checkpoint_data)
    return checkpoint


# The stage's own training arguments class, the last of the classes start_run parses.
TrainingArgs = TypeVar("TrainingArgs", bound=ToolkitTrainingArguments)


# A dataclass, not a NamedTuple: one cannot be generic before Python 3.11.
@dataclass(frozen=True)
class RunStart(Generic[TrainingArgs]):
    """What start_run parsed and checked before anything is written. data_args is the stage's own data class
    (pt's DataArguments or a ConversationDataArguments), training_args its own training arguments class; the config
    goes on to load_model, so a run reads it once."""

    model_args: ModelArguments
    data_args: Any
    training_args: TrainingArgs
    resume_checkpoint: str | None
    tokenizer: PreTrainedTokenizerBase
    config: PreTrainedConfig


def start_run(argument_classes: tuple[type[ModelArguments], type, type[TrainingArgs]], task: str = "causal_lm",
              fold_adapter: bool = False) -> RunStart[TrainingArgs]:
    """The common start of every run_* script but PPO's: parse the arguments, set up logging, and
    check everything that can be refused (evaluation data, resume point, tokenizer, model config,
    adapter, vocabulary, and what loading the model would refuse: models.loader.check_load_plan with
    load_model's task and fold_adapter) before anything is written, the data cache included."""
    model_args, data_args, training_args = parse_args(argument_classes)
    training_args.mapped_flags += model_args.mapped_flags + getattr(data_args, "mapped_flags", [])
    map_half_weights_on_cpu(model_args, training_args)
    setup_logging(training_args)
    check_held_out_data(data_args, training_args)
    # --prepare_data_only trains nothing: no resume point to decide (a checkpoint's process count would differ).
    resume_checkpoint = None if data_args.prepare_data_only else resolve_resume_checkpoint(training_args, model_args,
                                                                                         data_args)
    tokenizer = load_tokenizer(model_args)
    config = load_model_config(model_args)
    check_model_inputs(model_args, config, tokenizer)
    check_load_plan(model_args, training_args, config, tokenizer, task, fold_adapter=fold_adapter)
    return RunStart(model_args, data_args, training_args, resume_checkpoint, tokenizer, config)


def check_held_out_data(data_args: Any, training_args: TrainingArguments, what: str = "data") -> None:
    """An evaluating run (--eval_strategy) needs held-out data: refused from the arguments, before the
    data is read, rather than by the Trainer once the data is cached and the model loaded."""
    strategy = getattr(training_args.eval_strategy, "value", training_args.eval_strategy)
    if strategy == "no" or getattr(data_args, "validation_file", None) or data_args.validation_split_percentage > 0:
        return
    sources = [f"--{name}" for name in ("validation_file", "validation_split_percentage") if hasattr(data_args, name)]
    raise InputError(f"--eval_strategy {strategy} needs held-out {what}: give {' or '.join(sources)}")


def resolve_sequence_length(flag: str, requested: int | None, config: PreTrainedConfig) -> int:
    """A sequence length within the model's positions (default: min(1024, max positions))."""
    max_positions = getattr(config, "max_position_embeddings", None) or 1024
    if requested is None:
        return min(1024, max_positions)
    if requested < 2:
        raise InputError(f"{flag} must be at least 2, got {requested}")
    if requested > max_positions:
        raise InputError(f"{flag} {requested} exceeds the model's max_position_embeddings {max_positions} "
                         "(config.json)")
    return requested


def padding_multiple(training_args: TrainingArguments) -> int:
    """What the collators pad a batch's width up to: 8 on a GPU, whose tensor cores work in
    tiles of 8; 1 elsewhere, where every padded position is computed for nothing."""
    return 8 if training_args.device.type == "cuda" else 1


def train_and_finish(trainer: "Trainer", resume_checkpoint: str | None, full_finetuning: bool,
                     eval_dataset: Sized | None, num_train_samples: int) -> None:
    """Train (resuming if asked), save a fully fine-tuned model (adapters are saved by their
    callback), and write run_clm's result files."""
    if not isinstance(trainer.args, ToolkitTrainingArguments):  # every stage's are (trainers.arguments)
        raise TypeError(f"{type(trainer.args).__name__}: a stage trains with the toolkit's training arguments")
    start_writing(trainer.args, resume_checkpoint)
    train_result = trainer.train(resume_from_checkpoint=resume_checkpoint)
    if full_finetuning:
        trainer.save_model()
    finish_run(trainer, train_result, eval_dataset, num_train_samples)


def finish_run(trainer: "Trainer", train_result: TrainOutput, eval_dataset: Sized | None,
               num_train_samples: int) -> None:
    """run_clm's closing convention, kept by every stage: train/eval/all_results.json and
    trainer_state.json (with the loss history) in output_dir."""
    metrics = dict(train_result.metrics)
    metrics["train_samples"] = num_train_samples
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    if eval_dataset is not None:
        eval_metrics = trainer.evaluate()  # a CausalLMTrainer's log() has added perplexity
        eval_metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)

