"""The Trainer every stage builds on: ResumableTrainer (a resume provably continues the same run: sample order, data
read, a non-finite loss stops it), the causal-LM Trainer of pretraining and SFT with its chunked loss, the epoch-
seeded length-grouped sampler and the token-budget batches (trainers.token_batches), and next-token metrics."""

import logging
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Sampler
from transformers import (
    EvalPrediction,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_pt_utils import LengthGroupedSampler
from transformers.trainer_utils import TrainOutput, _is_peft_model

from lorakit.core.cli import ReportedError
from lorakit.core.model_files import complete_checkpoints
from lorakit.models.chunked_loss import agreed_across_ranks, causal_lm_loss, head_reproduces_logits
from lorakit.models.kernels import compile_decoder_layers
from lorakit.models.router import router_aux_coef, router_aux_term
from lorakit.trainers.checkpoints import CheckpointCompletion, clear_for_checkpoint, output_dir_of
from lorakit.trainers.common import padding_multiple
from lorakit.trainers.deepspeed_resume import load_deepspeed_checkpoint
from lorakit.trainers.router_monitor import add_router_monitor
from lorakit.trainers.token_batches import TokenBudgetBatchSampler

if TYPE_CHECKING:
    import datasets
    import optuna
    from transformers import PreTrainedModel

    from lorakit.trainers.arguments import CausalLMTrainingArguments, ToolkitTrainingArguments

logger = logging.getLogger(__name__)


def argmax_logits_for_metrics(logits: torch.Tensor | tuple[torch.Tensor, ...], labels: torch.Tensor) -> torch.Tensor:
    """Keep only the predicted ids: accumulating full logits over an eval set costs vocab x more memory."""
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def next_token_accuracy(eval_prediction: EvalPrediction) -> dict[str, float]:
    """Accuracy of next-token prediction over positions that have a label."""
    predictions, labels = eval_prediction.predictions, eval_prediction.label_ids
    predictions = np.asarray(predictions)[:, :-1]
    labels = np.asarray(labels)[:, 1:]
    mask = labels != -100
    correct = (predictions == labels) & mask
    return {"accuracy": float(correct.sum() / max(mask.sum(), 1))}


def add_perplexity(metrics: dict[str, float], prefix: str = "eval") -> dict[str, float]:
    loss = metrics.get(f"{prefix}_loss")
    if loss is not None:
        metrics[f"{prefix}_perplexity"] = math.exp(loss) if loss < 50 else float("inf")
    return metrics


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """LengthGroupedSampler whose shuffle is a function of (seed, epoch). transformers builds it
    without a generator, so it draws from the global RNG mid-run, which resuming restores to the
    checkpoint's state: a resumed run would see other batches than an uninterrupted one."""

    def __init__(self, batch_size: int, lengths: list[int], seed: int) -> None:
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

    def __init__(self, max_nonfinite_steps: int) -> None:
        self.max_nonfinite_steps = max_nonfinite_steps
        self.nonfinite_steps: list[int] = []

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> TrainerControl:
        if control.should_save or control.should_training_stop:
            control.should_log = True
        return control

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> TrainerControl:
        logged = logs or {}
        values = {name: logged[name] for name in ("loss", "grad_norm") if name in logged}
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
            raise TrainingDiverged(self.stop_message(output_dir_of(args), bad))
        return control

    def stop_message(self, output_dir: str, bad: dict[str, float]) -> str:
        checkpoints = complete_checkpoints(output_dir)
        last = (f"the last checkpoint {checkpoints[-1]} holds finite weights and resumes"
                if checkpoints else "no checkpoint was saved")
        what = " and ".join(f"{name} {value}" for name, value in bad.items())
        steps = ", ".join(map(str, self.nonfinite_steps))
        return (f"training stopped: {what} at {len(self.nonfinite_steps)} logged step(s) in a row (steps {steps}; "
                f"--max_nonfinite_steps {self.max_nonfinite_steps}); nothing was saved from them, {last}; "
                "lower --learning_rate or check the data before resuming")


class PreparedForTraining(NamedTuple):
    """Trainer._prepare_for_training's result, which the Trainer unpacks."""

    model: nn.Module
    train_dataloader: Any


class ResumableTrainer(Trainer):
    """Trainer whose length-grouped sampling is reproducible across a resume, which stops a run whose loss
    diverged (StopOnNonFinite) before it saves non-finite weights, and whose checkpoints are complete only once
    their completion marker is written, after everything else (trainers.checkpoints.CheckpointCompletion). Every
    stage's Trainer builds on it, so a mixture-of-experts model's router statistics (trainers.router_monitor) are
    installed here, once for all, and their figures join each training log."""

    # Narrower than the Trainer's own types: Trainer.__init__ sets a model (given, or from model_init) or raises, and
    # every stage's arguments are the toolkit's.
    model: "PreTrainedModel | nn.Module"
    args: "ToolkitTrainingArguments"
    # The sampler ordering the epochs, set where it is built (_get_train_sampler).
    epoch_sampler: "TokenBudgetBatchSampler | EpochSeededLengthGroupedSampler"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        max_nonfinite_steps = getattr(self.args, "max_nonfinite_steps", 0)
        if max_nonfinite_steps > 0:
            self.add_callback(StopOnNonFinite(max_nonfinite_steps))
        if not any(isinstance(callback, CheckpointCompletion) for callback in self.callback_handler.callbacks):
            self.add_callback(CheckpointCompletion())  # a full fine-tuning run has no SavePeftModelCallback
        self.router_monitor = add_router_monitor(self)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs and self.router_monitor is not None:  # a training log: the figures since the last one
            logs.update(self.router_monitor.pop_figures())
        super().log(logs, *args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> TrainOutput:
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

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int,
                          device: torch.device) -> tuple[list, torch.Tensor | int | None]:
        # transformers 5.23 trains a step before its callbacks check max_steps: a rerun resuming the final
        # checkpoint (a kill during the last save or eval) would train step max_steps + 1. Nothing is left.
        if 0 < self.state.max_steps <= self.state.global_step:
            self.control.should_training_stop = True
            return [], None
        return super().get_batch_samples(epoch_iterator, num_batches, device)

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any,
                              resume_from_checkpoint: str | None) -> PreparedForTraining:
        if not (self.is_deepspeed_enabled and resume_from_checkpoint is not None):
            return PreparedForTraining(*super()._prepare_for_training(max_steps, train_dataloader,
                                                                      resume_from_checkpoint))
        # The Trainer's last step here is the resume's load; DeepSpeed's would unpickle the checkpoint's files
        # (weights_only=False), running whatever a checkpoint from elsewhere names. The same three loads (transformers
        # 5.25, Trainer._prepare_for_training), DeepSpeed's made weights-only (trainers.deepspeed_resume).
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, None)
        load_deepspeed_checkpoint(self.model_wrapped, resume_from_checkpoint,
                                  load_module_strict=not _is_peft_model(self.model))
        self._load_optimizer_and_scheduler(resume_from_checkpoint)
        self._load_scaler(resume_from_checkpoint)
        return PreparedForTraining(model, train_dataloader)

    def _save_checkpoint(self, model: nn.Module, trial: "optuna.Trial | dict[str, Any] | None") -> None:
        clear_for_checkpoint(self.args, self.state.global_step)
        # The Trainer rotates checkpoints (--save_total_limit) inside this call, before the adapter copy and the
        # completion marker are written: it could remove the last complete checkpoint for one a crash leaves
        # incomplete. CheckpointCompletion rotates once the new one is complete.
        save_total_limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = save_total_limit

    def _get_train_sampler(self, train_dataset: Dataset | None = None) -> Sampler | None:
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        max_tokens = getattr(self.args, "max_tokens_per_batch", None)
        if max_tokens:
            dataset = train_dataset if train_dataset is not None else self.train_dataset
            if dataset is None:
                raise ValueError("--max_tokens_per_batch: no training dataset to batch")
            # A list: each row access of a datasets Column costs a lookup, and the cut reads every length thrice.
            self.epoch_sampler = TokenBudgetBatchSampler(list(dataset["length"]), max_tokens,
                                                         padding_multiple(self.args), seed, self.args.world_size,
                                                         self.args.process_index)
            return self.epoch_sampler
        sampler = super()._get_train_sampler(train_dataset)
        if isinstance(sampler, LengthGroupedSampler):
            self.epoch_sampler = EpochSeededLengthGroupedSampler(sampler.batch_size, sampler.lengths, seed)
            return self.epoch_sampler
        return sampler

    def _run_epoch(self, model: nn.Module, epoch: int, *args: Any, **kwargs: Any) -> Any:
        # The Trainer sets the epoch through the dataloader's samplers, which a resume on several processes wraps
        # twice (SkipBatchSampler around accelerate's BatchSamplerShard): it would not reach ours, which would
        # then order a resumed epoch as epoch 0.
        sampler = getattr(self, "epoch_sampler", None)
        if sampler is not None:
            sampler.set_epoch(epoch)
        return super()._run_epoch(model, epoch, *args, **kwargs)


def without_labels(batch: dict[str, torch.Tensor | Any]) -> dict[str, torch.Tensor | Any]:
    """A causal-LM batch's model inputs: all but its (shifted) labels."""
    return {name: value for name, value in batch.items() if name not in ("labels", "shift_labels")}


class CausalLMTrainer(ResumableTrainer):
    """Trainer whose eval logs carry perplexity next to the loss, during training and at the end, and whose
    loss is models.chunked_loss.causal_lm_loss (--chunked_loss) where that equals the model's own: no float32 logits
    of the whole batch and vocabulary. The model runs with logits_to_keep=1 and returns its hidden states.

    A mixture-of-experts model's training loss carries its router load-balancing term (models.router), as
    transformers' own loss does with output_router_logits: router_aux_coef * aux_loss. The eval loss does not: its
    perplexity stays the language model's."""

    chunked_loss_exact: bool | None = None  # decided on the first batch (head_reproduces_logits)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.router_aux_coef = router_aux_coef(self.model)
        if self.args.torch_compile:
            compile_decoder_layers(self.model, self.args.torch_compile_backend, self.args.torch_compile_mode)

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        # --torch_compile compiles the decoder layers in place (__init__), not the whole model in accelerate's
        # prepare: a whole-model compile would wrap the model the chunked loss reads the head of, and recompile
        # the head and the loss for every new batch width.
        args = super()._build_accelerator_args(**kwargs)
        if self.args.torch_compile and "dynamo_plugin" in args:
            from accelerate.utils import TorchDynamoPlugin

            args["dynamo_plugin"] = TorchDynamoPlugin(backend="no")
        return args

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        add_perplexity(logs)
        super().log(logs, *args, **kwargs)

    def compute_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor | tuple[torch.Tensor, Any]:
        routed = {"output_router_logits": True} if self.router_aux_coef and model.training else {}
        if return_outputs or not self.uses_chunked_loss(model, inputs):
            # transformers' own loss, without the router term: transformers would add it where the Trainer then
            # multiplies the whole loss by the processes and never divides it by the accumulation steps; the same
            # term as the chunked path's is added here instead.
            if not routed:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            loss, outputs = super().compute_loss(model, {**inputs, "output_router_logits": True}, True,
                                                 num_items_in_batch)
            aux = router_aux_term(self.router_aux_coef, outputs.aux_loss)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                aux = aux * self.accelerator.num_processes  # the share of it the Trainer's scaling put in the loss
            loss = loss - aux + self.router_aux_share(outputs.aux_loss, num_items_in_batch)
            return (loss, outputs) if return_outputs else loss
        outputs = model(**without_labels(inputs), output_hidden_states=True, logits_to_keep=1, **routed)
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        with self.accelerator.autocast():  # the mixed precision the model's forward ran its head in
            loss = causal_lm_loss(outputs.hidden_states[-1], head, inputs.get("labels"), num_items_in_batch,
                                  inputs.get("shift_labels"))
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # As Trainer.compute_loss: the count spans every process, whose gradients are averaged.
            loss = loss * self.accelerator.num_processes
        if routed:
            loss = loss + self.router_aux_share(outputs.aux_loss, num_items_in_batch)
        return loss

    def router_aux_share(self, aux_loss: torch.Tensor | None,
                         num_items_in_batch: torch.Tensor | int | None) -> torch.Tensor | float:
        """This micro-batch's router term: coef * aux_loss, the step's mean over its micro-batches. Not multiplied by
        the processes (the data-parallel mean of the gradients averages it, as it should); divided by the
        accumulation steps where the Trainer leaves the loss undivided because the token loss is already normalised
        over the whole accumulated batch (num_items_in_batch). On one process, without accumulation, the loss is
        transformers' own: mean cross-entropy + coef * aux_loss."""
        term = router_aux_term(self.router_aux_coef, aux_loss)
        scaled_for_accumulation = self.loss_is_scaled_for_ga
        if scaled_for_accumulation is None:  # Trainer.training_step's guess, which decides whether it divides
            scaled_for_accumulation = ((self.model_accepts_loss_kwargs and num_items_in_batch is not None)
                                       or self.compute_loss_func is not None)
        if scaled_for_accumulation:
            term = term / getattr(self, "current_gradient_accumulation_steps", 1)
        return term

    def uses_chunked_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any]) -> bool:
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


def build_trainer(model: nn.Module, training_args: "CausalLMTrainingArguments", tokenizer: PreTrainedTokenizerBase,
                  train_dataset: "datasets.Dataset", eval_dataset: "datasets.Dataset | None",
                  data_collator: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor | Any]],
                  callbacks: list[TrainerCallback]) -> CausalLMTrainer:
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
