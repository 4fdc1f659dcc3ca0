"""What every run_* script shares around the Trainer: argument parsing (with the names that
Chinese-LLaMA-Alpaca-2's and DeepSpeed-Chat's shell scripts pass), the bad-input contract (one line, exit 2),
output-directory and resume rules, logging, next-token metrics and the run_clm-style results."""

import logging
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_pt_utils import LengthGroupedSampler

from lorakit.core.cli import InputError, ReportedError, parse_args
from lorakit.core.model_files import checkpoint_problem, checkpoint_states, complete_checkpoints
from lorakit.core.repository import DS_CONFIGS
from lorakit.data.build_dataset import ConversationDataArguments
from lorakit.data.run_record import begin_run
from lorakit.models.chunked_loss import agreed_across_ranks, causal_lm_loss, head_reproduces_logits
from lorakit.models.loader import (
    check_load_plan,
    check_model_inputs,
    load_model_config,
    load_tokenizer,
    map_flags,
    note_accepted_flags,
)
from lorakit.trainers.checkpoints import (
    CheckpointCompletion,
    clear_for_checkpoint,
    rank_zero_decides,
    resumable_checkpoint_data,
    run_identity,
    start_writing,
)

logger = logging.getLogger(__name__)


# Where DeepSpeed-Chat's --zero_stage (with --offload) points: the configs shipped in ds_configs/.
SHIPPED_ZERO_CONFIGS = {(2, False): "ds_zero2_no_offload.json", (3, False): "ds_zero3_no_offload.json",
                        (3, True): "ds_zero3_offload.json"}
# DeepSpeed-Chat's --dtype -> the mixed-precision flag it turns on (fp32: none).
DTYPE_FLAGS = {"fp16": "fp16", "bf16": "bf16", "fp32": None}


def warmup_ratio_flag(ratio: float) -> tuple:
    if not 0 <= ratio < 1:
        raise InputError(f"--warmup_ratio must be in [0, 1), got {ratio}")
    return "warmup_steps", ratio, "a warmup_steps below 1 is a share of the training steps"


# Trainer flags by another name -> (transformers 5's flag, value[, why]): transformers 4's names that
# Chinese-LLaMA-Alpaca-2's run_pt.sh/run_sft.sh pass, and DeepSpeed-Chat's. model_utils.map_flags applies them.
RENAMED_TRAINER_FLAGS = {
    "evaluation_strategy": lambda strategy: ("eval_strategy", strategy),
    "warmup_ratio": warmup_ratio_flag,
    "num_warmup_steps": lambda steps: ("warmup_steps", steps),
    "gradient_checkpointing": lambda on: ("activation_checkpointing", on),
    "group_by_length": lambda on: ("train_sampling_strategy", "group_by_length"),
}
# Flags of those scripts that need nothing here, and why (noted when given).
ACCEPTED_TRAINER_FLAGS = {
    "save_safetensors": "weights are always written as safetensors",
    "only_optimize_lora": "LoRA trains only the adapter (and --modules_to_save)",
    "num_padding_at_beginning": "a sequence's score is read at its last attended token, found from the attention "
                                "mask, so no count of leading pad tokens is needed",
    "enable_hybrid_engine": "the actor generates with its training weights (its own generate(), no separate "
                            "inference engine to switch to)",
}


@dataclass
class ToolkitTrainingArguments(TrainingArguments):
    """TrainingArguments plus the flags users' existing shell scripts pass that transformers 5 does
    not know: Chinese-LLaMA-Alpaca-2's run_pt.sh/run_sft.sh (transformers 4 names) and DeepSpeed-Chat's
    step scripts. Each is mapped to what it means here, or accepted with the reason it needs nothing,
    and reported as a 'flag mapped' log line."""

    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train into an output_dir that is not empty, ignoring its checkpoints."},
    )
    evaluation_strategy: Optional[str] = field(
        default=None, metadata={"help": "Old name of --eval_strategy (transformers 4)."}
    )
    warmup_ratio: Optional[float] = field(
        default=None, metadata={"help": "Old form of a fractional --warmup_steps (transformers 4)."}
    )
    save_safetensors: Optional[bool] = field(
        default=None, metadata={"help": "Accepted for old scripts; weights are always safetensors."}
    )
    group_by_length: bool = field(
        default=False,
        metadata={"help": "Old form of --train_sampling_strategy group_by_length (transformers 4)."},
    )
    zero_stage: Optional[int] = field(
        default=None,
        metadata={"help": "DeepSpeed-Chat: ZeRO stage 0, 2 or 3 (with --offload: 3), mapped to the --deepspeed "
                          "config of ds_configs/ (0: no DeepSpeed)."},
    )
    offload: bool = field(
        default=False, metadata={"help": "DeepSpeed-Chat: with --zero_stage 3, ZeRO-3 with CPU offload."}
    )
    dtype: Optional[str] = field(
        default=None,
        metadata={"help": "DeepSpeed-Chat: fp16 or bf16 mixed precision (--fp16 / --bf16), or fp32.",
                  "choices": list(DTYPE_FLAGS)},
    )
    num_warmup_steps: Optional[int] = field(default=None, metadata={"help": "DeepSpeed-Chat's --warmup_steps."})
    only_optimize_lora: bool = field(default=False, metadata={"help": "DeepSpeed-Chat: accepted, LoRA trains only "
                                                                      "the adapter."})
    num_padding_at_beginning: Optional[int] = field(
        default=None, metadata={"help": "DeepSpeed-Chat: accepted, scores are read from the attention mask."}
    )
    max_nonfinite_steps: int = field(
        default=3,
        metadata={"help": "Stop the run (exit status 3) when the logged loss or gradient norm is NaN or infinite "
                          "this many logged steps in a row; no checkpoint is saved while they are (0: never stop)."},
    )
    # A NaN or infinite step must show in the log: the Trainer's default filter replaces its loss with the average.
    logging_nan_inf_filter: bool = field(
        default=False, metadata={"help": "Replace a non-finite step's logged loss by the average (hides it)."}
    )
    # Our datasets hold only what the collators read (model inputs, 'length' for the length-grouped
    # sampler, a pair's margin): nothing is for the Trainer to drop by the model's signature.
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Kept False: every column of our datasets is read by a collator."}
    )

    def __post_init__(self):
        # Logging is not configured yet; setup_logging() reports these notes on rank 0. All of them
        # act before TrainingArguments fills the DeepSpeed config's "auto" precision from --fp16/--bf16.
        self.mapped_flags = []
        map_flags(self, RENAMED_TRAINER_FLAGS, self.mapped_flags)
        map_dtype_flag(self)
        map_zero_stage(self)
        map_fp16_on_cpu(self)
        note_accepted_flags(self, ACCEPTED_TRAINER_FLAGS, self.mapped_flags)
        super().__post_init__()


def map_dtype_flag(args: ToolkitTrainingArguments) -> None:
    """DeepSpeed-Chat's --dtype as the Trainer's mixed-precision flag."""
    if args.dtype is None:
        return
    wanted = DTYPE_FLAGS[args.dtype]
    for flag in ("fp16", "bf16"):
        if getattr(args, flag) and flag != wanted:
            raise InputError(f"--dtype {args.dtype} and --{flag} both given: give only one")
    if wanted:
        setattr(args, wanted, True)
    args.mapped_flags.append(f"--dtype {args.dtype} -> " + (f"--{wanted}" if wanted else "no --fp16/--bf16 (float32)"))
    args.dtype = None


def map_zero_stage(args: ToolkitTrainingArguments) -> None:
    """DeepSpeed-Chat's --zero_stage (and --offload) as the --deepspeed config shipped for it."""
    if args.deepspeed == "":  # DeepSpeed-Chat's bare switch (cli.bare_switch_as_empty)
        args.deepspeed = None
        args.mapped_flags.append("--deepspeed (DeepSpeed-Chat's switch) accepted: --zero_stage picks the config, "
                                 "none or 0 meaning no DeepSpeed")
    if args.zero_stage is None:
        if args.offload:
            raise InputError("--offload goes with --zero_stage 3 (ds_configs/ds_zero3_offload.json); with --deepspeed, "
                             "the config file's offload_optimizer/offload_param decide")
        return
    given = f"--zero_stage {args.zero_stage}" + (" --offload" if args.offload else "")
    if args.zero_stage == 0 and not args.offload:
        if args.deepspeed:
            raise InputError(f"{given} and --deepspeed {args.deepspeed} both given: ZeRO stage 0 means no DeepSpeed")
        args.mapped_flags.append(f"{given} -> no --deepspeed (plain data parallelism)")
    else:
        name = SHIPPED_ZERO_CONFIGS.get((args.zero_stage, args.offload))
        if name is None:
            raise InputError(f"{given}: ds_configs/ ships no DeepSpeed config for it (ZeRO-2 without offload, ZeRO-3 "
                             "with or without); write one and pass it with --deepspeed")
        config = os.path.join(DS_CONFIGS, name)
        if args.deepspeed and os.path.abspath(args.deepspeed) != config:
            raise InputError(f"{given} and --deepspeed {args.deepspeed} both given: {given} means --deepspeed "
                             f"{config}; give only one")
        args.deepspeed = config
        args.mapped_flags.append(f"{given} -> --deepspeed {config}")
    args.zero_stage, args.offload = None, False


def map_fp16_on_cpu(args: ToolkitTrainingArguments) -> None:
    """--fp16 where there is no GPU: neither torch's autocast (accelerate skips it on a CPU) nor
    DeepSpeed ("Type fp16 is not supported") computes in float16 there, so the run computes in
    float32, as it would have on a CPU anyway. On a GPU --fp16 stays what it is."""
    if args.fp16 and (args.use_cpu or not torch.accelerator.is_available()):
        args.fp16 = False
        args.mapped_flags.append("--fp16 -> float32 compute (no GPU here: float16 mixed precision needs one; "
                                 "--bf16 runs on a CPU)")


def map_half_weights_on_cpu(model_args, training_args) -> None:
    """--torch_dtype float16 for a run on a CPU: its trainable copies (--modules_to_save) would train
    in float16 without loss scaling, and DeepSpeed mixes them with float32 there; load float32."""
    if model_args.torch_dtype == "float16" and training_args.device.type == "cpu":
        model_args.torch_dtype = "float32"
        training_args.mapped_flags.append("--torch_dtype float16 -> --torch_dtype float32 (training on a CPU, "
                                          "where float16 has no mixed precision)")


@dataclass
class CausalLMTrainingArguments(ToolkitTrainingArguments):
    """The toolkit's training arguments plus the option of the stages that train a language-model head
    (pretraining, SFT, PPO's actor, DPO's policy)."""

    # On by default: where it is used (the first batch checks the head alone reproduces the model's logits) its
    # loss and gradients equal transformers' to float32 rounding, and lie at least as close to a float64 loss.
    chunked_loss: bool = field(
        default=True,
        metadata={"help": "Compute the loss and log-probabilities from the hidden states over chunks of positions, "
                          "never holding float32 logits of the whole batch and vocabulary (PPO: also each sampled "
                          "token's log-prob and entropy as it is generated; DPO: the answers' log-probabilities). "
                          "Used where it equals the model's own loss (checked on the first batch); off: the full "
                          "logits, as transformers computes them."},
    )


@dataclass
class DeepSpeedChatDataArguments(ConversationDataArguments):
    """The conversation data arguments plus DeepSpeed-Chat's name of --max_seq_length (steps 1 and 2)."""

    max_seq_len: Optional[int] = field(default=None, metadata={"help": "DeepSpeed-Chat's --max_seq_length."})

    def __post_init__(self):
        super().__post_init__()
        self.mapped_flags = []
        map_flags(self, {"max_seq_len": lambda length: ("max_seq_length", length)}, self.mapped_flags)


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


def choose_resume_checkpoint(training_args: ToolkitTrainingArguments) -> Optional[str]:
    """Where training starts, read from this process's disk: an explicit --resume_from_checkpoint wins;
    otherwise the last complete checkpoint in output_dir (incomplete ones are skipped, each named in the log);
    a non-empty output_dir without one is refused unless --overwrite_output_dir."""
    output_dir = training_args.output_dir
    requested = training_args.resume_from_checkpoint
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


def resolve_resume_checkpoint(training_args: ToolkitTrainingArguments, model_args, data_args) -> Optional[str]:
    """Decide, before anything is written, where training starts: rank 0 chooses (choose_resume_checkpoint) for
    every rank; a checkpoint some rank cannot read, or written by a run whose identity (checkpoint_state: models,
    seed, shape-changing settings, processes) differs from this one, is refused on every rank. Begins this
    process's run record, against which the data read next is checked when resuming."""
    checkpoint = rank_zero_decides(lambda: choose_resume_checkpoint(training_args))
    identity = run_identity(model_args, data_args, training_args)
    checkpoint_data = resumable_checkpoint_data(checkpoint, identity) if checkpoint else None
    begin_run(identity, checkpoint, checkpoint_data)
    return checkpoint


def start_run(argument_classes: tuple, task: str = "causal_lm", fold_adapter: bool = False):
    """The common start of every run_* script but PPO's: parse the arguments, set up logging, and
    check everything that can be refused (evaluation data, resume point, tokenizer, model config,
    adapter, vocabulary, and what loading the model would refuse: model_utils.check_load_plan with
    load_model's task and fold_adapter) before anything is written, the data cache included.
    Returns (model_args, data_args, training_args, resume checkpoint, tokenizer, model config); the
    config goes on to load_model, so a run reads it once."""
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
    return model_args, data_args, training_args, resume_checkpoint, tokenizer, config


def check_held_out_data(data_args, training_args: TrainingArguments, what: str = "data") -> None:
    """An evaluating run (--eval_strategy) needs held-out data: refused from the arguments, before the
    data is read, rather than by the Trainer once the data is cached and the model loaded."""
    strategy = getattr(training_args.eval_strategy, "value", training_args.eval_strategy)
    if strategy == "no" or getattr(data_args, "validation_file", None) or data_args.validation_split_percentage > 0:
        return
    sources = [f"--{name}" for name in ("validation_file", "validation_split_percentage") if hasattr(data_args, name)]
    raise InputError(f"--eval_strategy {strategy} needs held-out {what}: give {' or '.join(sources)}")


def resolve_sequence_length(flag: str, requested: Optional[int], config) -> int:
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


def argmax_logits_for_metrics(logits, labels):
    """Keep only the predicted ids: accumulating full logits over an eval set costs vocab x more memory."""
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def next_token_accuracy(eval_prediction) -> dict:
    """Accuracy of next-token prediction over positions that have a label."""
    predictions, labels = eval_prediction.predictions, eval_prediction.label_ids
    predictions = np.asarray(predictions)[:, :-1]
    labels = np.asarray(labels)[:, 1:]
    mask = labels != -100
    correct = (predictions == labels) & mask
    return {"accuracy": float(correct.sum() / max(mask.sum(), 1))}


def add_perplexity(metrics: dict, prefix: str = "eval") -> dict:
    loss = metrics.get(f"{prefix}_loss")
    if loss is not None:
        metrics[f"{prefix}_perplexity"] = math.exp(loss) if loss < 50 else float("inf")
    return metrics


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """LengthGroupedSampler whose shuffle is a function of (seed, epoch). transformers builds it
    without a generator, so it draws from the global RNG mid-run, which resuming restores to the
    checkpoint's state: a resumed run would see other batches than an uninterrupted one."""

    def __init__(self, batch_size: int, lengths: list, seed: int):
        super().__init__(batch_size, lengths=lengths)
        self.seed = seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.generator = torch.Generator().manual_seed(self.seed + epoch)


class TrainingDiverged(ReportedError):
    """The loss or gradient norm stayed non-finite: the weights are lost, the last checkpoint is not."""

    exit_status = 3


class StopOnNonFinite(TrainerCallback):
    """Stops a run whose logged loss or gradient norm is NaN or infinite max_nonfinite_steps logged steps in a
    row (one fp16 overflow step, skipped by the loss scaler, is not a reason), or whose last step is. While the
    last logged step is non-finite nothing is saved, so the last checkpoint on disk holds finite weights and
    resumes; every save step and the last step are made logged steps so that no save goes unchecked. The logged
    loss is the mean over every process, so each rank stops at the same step."""

    def __init__(self, max_nonfinite_steps: int):
        self.max_nonfinite_steps = max_nonfinite_steps
        self.nonfinite_steps = []

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save or control.should_training_stop:
            control.should_log = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        values = {name: logs[name] for name in ("loss", "grad_norm") if name in (logs or {})}
        if not values:
            return control  # an eval or end-of-training log
        bad = {name: value for name, value in values.items() if not math.isfinite(value)}
        if not bad:
            self.nonfinite_steps = []
            return control
        self.nonfinite_steps.append(state.global_step)
        control.should_save = False
        # The last step too: ending the run would save its weights as the final adapter.
        if len(self.nonfinite_steps) >= self.max_nonfinite_steps or state.global_step >= state.max_steps:
            raise TrainingDiverged(self.stop_message(args.output_dir, bad))
        return control

    def stop_message(self, output_dir: str, bad: dict) -> str:
        checkpoints = complete_checkpoints(output_dir)
        last = (f"the last checkpoint {checkpoints[-1]} holds finite weights and resumes"
                if checkpoints else "no checkpoint was saved")
        what = " and ".join(f"{name} {value}" for name, value in bad.items())
        steps = ", ".join(map(str, self.nonfinite_steps))
        return (f"training stopped: {what} at {len(self.nonfinite_steps)} logged step(s) in a row (steps {steps}; "
                f"--max_nonfinite_steps {self.max_nonfinite_steps}); nothing was saved from them, {last}; "
                "lower --learning_rate or check the data before resuming")


class ResumableTrainer(Trainer):
    """Trainer whose length-grouped sampling is reproducible across a resume, which stops a run whose loss
    diverged (StopOnNonFinite) before it saves non-finite weights, and whose checkpoints are complete only once
    their completion marker is written, after everything else (checkpoint_state.CheckpointCompletion)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        max_nonfinite_steps = getattr(self.args, "max_nonfinite_steps", 0)
        if max_nonfinite_steps > 0:
            self.add_callback(StopOnNonFinite(max_nonfinite_steps))
        if not any(isinstance(callback, CheckpointCompletion) for callback in self.callback_handler.callbacks):
            self.add_callback(CheckpointCompletion())  # a full fine-tuning run has no SavePeftModelCallback

    def train(self, *args, **kwargs):
        # The marker's writer last (a stable sort, after any callback added since __init__): after every on_save.
        self.callback_handler.callbacks.sort(key=lambda callback: isinstance(callback, CheckpointCompletion))
        try:
            return super().train(*args, **kwargs)
        except TrainingDiverged:
            # The progress bar is still open mid-line: closed, so the error starts a line of its own.
            for callback in self.callback_handler.callbacks:
                if getattr(callback, "training_bar", None) is not None:
                    callback.training_bar.close()
            raise

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        # transformers 5.23 trains a step before its callbacks check max_steps: a rerun resuming the final
        # checkpoint (a kill during the last save or eval) would train step max_steps + 1. Nothing is left.
        if 0 < self.state.max_steps <= self.state.global_step:
            self.control.should_training_stop = True
            return [], None
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _save_checkpoint(self, model, trial):
        clear_for_checkpoint(self.args, self.state.global_step)
        # The Trainer rotates checkpoints (--save_total_limit) inside this call, before the adapter copy and the
        # completion marker are written: it could remove the last complete checkpoint for one a crash leaves
        # incomplete. CheckpointCompletion rotates once the new one is complete.
        save_total_limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = save_total_limit

    def _get_train_sampler(self, train_dataset=None):
        sampler = super()._get_train_sampler(train_dataset)
        if isinstance(sampler, LengthGroupedSampler):
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
            return EpochSeededLengthGroupedSampler(sampler.batch_size, sampler.lengths, seed)
        return sampler


def without_labels(batch: dict) -> dict:
    """A causal-LM batch's model inputs: all but its (shifted) labels."""
    return {name: value for name, value in batch.items() if name not in ("labels", "shift_labels")}


class CausalLMTrainer(ResumableTrainer):
    """Trainer whose eval logs carry perplexity next to the loss, during training and at the end, and whose
    loss is chunked_loss.causal_lm_loss (--chunked_loss) where that equals the model's own: no float32 logits
    of the whole batch and vocabulary. The model runs with logits_to_keep=1 and returns its hidden states."""

    chunked_loss_exact = None  # decided on the first batch (head_reproduces_logits)

    def log(self, logs, *args, **kwargs):
        add_perplexity(logs)
        super().log(logs, *args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs or not self.uses_chunked_loss(model, inputs):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        outputs = model(**without_labels(inputs), output_hidden_states=True, logits_to_keep=1)
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        with self.accelerator.autocast():  # the mixed precision the model's forward ran its head in
            loss = causal_lm_loss(outputs.hidden_states[-1], head, inputs.get("labels"), num_items_in_batch,
                                  inputs.get("shift_labels"))
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # As Trainer.compute_loss: the count spans every process, whose gradients are averaged.
            loss = loss * self.accelerator.num_processes
        return loss

    def uses_chunked_loss(self, model, inputs) -> bool:
        """--chunked_loss, a batch with labels, plain data parallelism (no tensor, sequence or context
        parallelism, no DataParallel), and a model whose head reproduces its logits."""
        if not (getattr(self.args, "chunked_loss", False) and "labels" in inputs and self.args.n_gpu <= 1
                and getattr(self.accelerator, "parallelism_config", None) is None):
            return False
        if self.chunked_loss_exact is None:
            unwrapped = self.accelerator.unwrap_model(model)
            with self.accelerator.autocast():
                exact = head_reproduces_logits(unwrapped, without_labels(inputs))
            self.chunked_loss_exact = agreed_across_ranks(exact, unwrapped.get_output_embeddings(),
                                                          inputs["input_ids"].device)
            if not self.chunked_loss_exact:
                logger.info("chunked loss off: this model's forward does not take logits_to_keep or changes the "
                            "logits after its output embeddings; transformers' loss over the full logits is used")
        return self.chunked_loss_exact


def build_trainer(model, training_args, tokenizer, train_dataset, eval_dataset, data_collator, callbacks):
    """The CausalLMTrainer every causal-LM stage uses, with token accuracy on its eval set."""
    has_eval = eval_dataset is not None
    return CausalLMTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=next_token_accuracy if has_eval else None,
        preprocess_logits_for_metrics=argmax_logits_for_metrics if has_eval else None,
        callbacks=callbacks,
    )


def train_and_finish(trainer, resume_checkpoint, full_finetuning: bool, eval_dataset, num_train_samples: int) -> None:
    """Train (resuming if asked), save a fully fine-tuned model (adapters are saved by their
    callback), and write run_clm's result files."""
    start_writing(trainer.args, resume_checkpoint)
    train_result = trainer.train(resume_from_checkpoint=resume_checkpoint)
    if full_finetuning:
        trainer.save_model()
    finish_run(trainer, train_result, eval_dataset, num_train_samples)


def finish_run(trainer, train_result, eval_dataset, num_train_samples: int) -> None:
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

