"""The DPO Trainer and what only it uses: the answers' log-probabilities of the policy and of the reference (the
base with the adapter disabled, or precomputed once and cached with the pairs), the collator that carries the
precomputed ones, and the loss variants' metrics."""

import logging
import os
from contextlib import nullcontext
from typing import Any, NamedTuple

import torch
from datasets import Dataset, concatenate_datasets
from torch import nn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.trainer_utils import EvalLoopOutput

from lorakit.core.cli import InputError
from lorakit.core.pair_segments import PAIR_CHOSEN, PAIR_PREFIX
from lorakit.data.build_dataset import DataCollatorForPreferencePairs
from lorakit.data.cache import FingerprintMemo, build_or_load_cached, cache_key
from lorakit.models.arguments import ModelArguments
from lorakit.models.dpo_losses import (
    REFERENCE_FREE,
    SequenceLogps,
    nll_loss,
    nll_weight,
    preference_loss,
    sequence_log_probs,
)
from lorakit.models.router import router_aux_coef, router_aux_term
from lorakit.trainers.causal_lm import ResumableTrainer
from lorakit.trainers.dpo_config import DPOArguments

logger = logging.getLogger(__name__)


REFERENCE_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
# TRL's names, logged on train and (eval_ prefixed) on eval.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")
# 2: log-probs of a model that changes its logits after the head (Gemma-2) from its own full forward.
REFERENCE_CACHE_VERSION = "dpo-ref-2"


class DataCollatorForAnswerLogps(DataCollatorForPreferencePairs):
    """The reward stage's pair batch plus where each answer token is predicted: answer_index (flat
    position in [rows * width] of the logits that predict the token), answer_targets (the token) and
    answer_owner (its sequence: pair i's chosen answer is i, its rejected answer pairs + i). In a
    shared-prefix row the rejected answer's first token is predicted from the last prefix position
    and its later tokens from its own positions after the chosen answer. Precomputed reference
    log-probs, when the dataset carries them, come along."""

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = super().__call__(features)
        del batch["margin"]
        width, pairs = batch["input_ids"].shape[1], len(features)
        index, targets, owner = [], [], []
        for i, feature in enumerate(features):
            chosen, rejected = feature["chosen_input_ids"], feature["rejected_input_ids"]
            if self.share_prefix:
                segments = batch["pair_segments"][i]
                shared = int((segments == PAIR_PREFIX).sum())
                chosen_end = shared + int((segments == PAIR_CHOSEN).sum())
                chosen_row = rejected_row = i
                rejected_position = [j - 1 if j - 1 < shared else chosen_end + j - 1 - shared
                                     for j in range(len(rejected))]
            else:
                chosen_row, rejected_row = i, pairs + i
                rejected_position = [j - 1 for j in range(len(rejected))]
            for j in range(feature["chosen_answer_start"], len(chosen)):
                index.append(chosen_row * width + j - 1)
                targets.append(chosen[j])
                owner.append(i)
            for j in range(feature["rejected_answer_start"], len(rejected)):
                index.append(rejected_row * width + rejected_position[j])
                targets.append(rejected[j])
                owner.append(pairs + i)
        batch.update(answer_index=torch.tensor(index), answer_targets=torch.tensor(targets),
                     answer_owner=torch.tensor(owner))
        for name in REFERENCE_COLUMNS:
            if name in features[0]:
                batch[name] = torch.tensor([float(f[name]) for f in features], dtype=torch.float32)
        return batch


class PolicyAnswers(NamedTuple):
    """The answers' (summed log-probabilities, token counts), chosen ones then rejected, and the routers'
    load-balancing loss of the pass (None unless asked for, of a mixture of experts)."""

    logps: SequenceLogps
    router_aux: torch.Tensor | None


def policy_answers(model: nn.Module, batch: dict[str, torch.Tensor], routed: bool = False) -> PolicyAnswers:
    """The batch's answers under the model; routed: with its router aux loss (models.heads.answer_logps_forward)."""
    inputs = {name: value for name, value in batch.items() if name not in ("answer_owner",) + REFERENCE_COLUMNS}
    rows = batch["input_ids"].shape[0]
    sequences = 2 * rows if "pair_segments" in batch else rows
    outputs = model(**inputs, **({"output_router_logits": True} if routed else {}))
    return PolicyAnswers(sequence_log_probs(outputs.token_logps, batch["answer_owner"], sequences), outputs.aux_loss)


def answer_logps(model: nn.Module, batch: dict[str, torch.Tensor]) -> SequenceLogps:
    """(summed log-probabilities, token counts) of the batch's answers, chosen ones then rejected."""
    return policy_answers(model, batch).logps


def reference_logps(model: nn.Module, unwrapped_model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The answers' log-probabilities under the reference: the model with its adapter disabled."""
    from peft import PeftModel

    # A fully fine-tuned model (precomputing only) is its own reference before training.
    disabled = unwrapped_model.disable_adapter() if isinstance(unwrapped_model, PeftModel) else nullcontext()
    with torch.no_grad(), disabled:
        return answer_logps(model, batch).sums


class PairLoss(NamedTuple):
    """A batch's DPO loss, and its pairs' rewards ({"chosen": ..., "rejected": ...}: compute_loss's outputs)."""

    loss: torch.Tensor
    rewards: dict[str, torch.Tensor]


class DPOTrainer(ResumableTrainer):
    """compute_loss: policy and reference log-probs of each pair's answers -> the --loss_type loss
    (+ the NLL term of ORPO and --rpo_alpha, + a mixture of experts' router load-balancing term on the policy's
    pass, models.router); the pair metrics are summed per mode and logged,
    averaged over every pair since the last log, with TRL's names."""

    args: DPOArguments  # the stage's own (Trainer types them as TrainingArguments)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.metric_sums = {"train": torch.zeros(len(METRICS) + 1), "eval": torch.zeros(len(METRICS) + 1)}
        self.router_aux_coef = router_aux_coef(self.model)

    def compute_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor | tuple[torch.Tensor, Any]:
        result = self.pair_loss(model, inputs)
        return (result.loss, result.rewards) if return_outputs else result.loss

    def pair_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any]) -> PairLoss:
        """compute_loss's loss and rewards, the loss alone typed as such; the batch's metrics recorded."""
        args = self.args
        ref_chosen = ref_rejected = None
        if args.loss_type not in REFERENCE_FREE:
            if "ref_chosen_logps" in inputs:
                ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
            else:
                ref_chosen, ref_rejected = reference_logps(model, self.accelerator.unwrap_model(model),
                                                           inputs).chunk(2)
        # A mixture of experts' training loss carries its routers' load-balancing term, as its own loss would.
        (sums, counts), router_aux = policy_answers(model, inputs, routed=bool(self.router_aux_coef) and model.training)
        (chosen, rejected), (chosen_tokens, rejected_tokens) = sums.chunk(2), counts.chunk(2)
        losses, chosen_rewards, rejected_rewards = preference_loss(
            args.loss_type, chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens, args.beta,
            args.label_smoothing, args.simpo_gamma)
        loss = losses.mean()
        weight = nll_weight(args.loss_type, args.rpo_alpha)
        if weight:
            loss = loss + weight * nll_loss(chosen, chosen_tokens)
        loss = loss + router_aux_term(self.router_aux_coef, router_aux)
        self.record_metrics("train" if model.training else "eval", chosen_rewards, rejected_rewards,
                            chosen.detach(), rejected.detach())
        return PairLoss(loss, {"chosen": chosen_rewards, "rejected": rejected_rewards})

    def record_metrics(self, mode: str, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                       chosen_logps: torch.Tensor, rejected_logps: torch.Tensor) -> None:
        values = torch.stack([chosen_rewards, rejected_rewards, (chosen_rewards > rejected_rewards).float(),
                              chosen_rewards - rejected_rewards, chosen_logps, rejected_logps]).float().sum(dim=1)
        self.metric_sums[mode] += torch.cat([values.cpu(), torch.tensor([float(len(chosen_rewards))])])

    def pop_metrics(self, mode: str, prefix: str = "") -> dict[str, float]:
        """The mean of each metric over every pair of every rank since the last call (a collective)."""
        totals = self.accelerator.reduce(self.metric_sums[mode].to(self.accelerator.device), "sum").cpu()
        self.metric_sums[mode].zero_()
        pairs = max(totals[-1].item(), 1.0)
        return {f"{prefix}{name}": totals[k].item() / pairs for k, name in enumerate(METRICS)}

    def prediction_step(
        self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.pair_loss(model, inputs).loss
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "loss" in logs:  # a training log: every rank logs at the same step
            logs.update(self.pop_metrics("train"))
        super().log(logs, *args, **kwargs)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> EvalLoopOutput:
        output = super().evaluation_loop(*args, **kwargs)
        assert output.metrics is not None  # the Trainer's evaluation loop always returns its metrics
        output.metrics.update(self.pop_metrics("eval", f"{kwargs.get('metric_key_prefix', 'eval')}_"))
        return output


class FileFingerprint(NamedTuple):
    """A file's name in its model directory and its content fingerprint (a JSON list in the cache key)."""

    name: str
    fingerprint: str


def reference_model_fingerprint(model_args: ModelArguments, memo: FingerprintMemo) -> dict[str, Any]:
    """What the reference log-probs depend on: the weights (and folded adapter) by content (memo: read once per
    node, then stat), the dtype and quantization."""
    def fingerprints(directory: str | None) -> list[FileFingerprint] | None:
        if not directory:
            return None
        return sorted(FileFingerprint(name, memo(os.path.join(directory, name))) for name in os.listdir(directory)
                      if name.endswith((".safetensors", ".bin", ".json")))

    return {"model": fingerprints(model_args.model_name_or_path), "adapter": fingerprints(model_args.peft_path),
            "dtype": model_args.torch_dtype, "kbits": model_args.load_in_kbits,
            "attention": model_args.attn_implementation}


def with_reference_logps(dataset: Dataset, model: nn.Module, collator: DataCollatorForAnswerLogps,
                         training_args: DPOArguments, model_args: ModelArguments, cache_dir: str) -> Dataset:
    """The dataset plus the reference log-probs of each pair's answers (REFERENCE_COLUMNS), computed
    once with the adapter disabled and cached next to the tokenized pairs (the key covers the pairs
    and the reference model); every rank reads the one cached copy."""
    def build(tmp_dir: str) -> None:
        loader = DataLoader(dataset, batch_size=training_args.per_device_eval_batch_size, collate_fn=collator)
        device, columns = training_args.device, []
        model.to(device).eval()
        for batch in tqdm(loader, desc="Reference log-probs", unit="batch"):
            batch = {name: value.to(device) for name, value in batch.items()}
            columns.append(reference_logps(model, model, batch).cpu().view(2, -1))
        model.train()
        table = torch.cat(columns, dim=1)
        Dataset.from_dict(dict(zip(REFERENCE_COLUMNS, table.tolist(), strict=True))).save_to_disk(tmp_dir)

    with training_args.main_process_first(desc="reference log-probs"):
        memo = FingerprintMemo(cache_dir)
        key = cache_key({"version": REFERENCE_CACHE_VERSION, "pairs": dataset._fingerprint,
                         "reference": reference_model_fingerprint(model_args, memo)})
        reference, hit = build_or_load_cached(cache_dir, f"dpo-ref-{key}", build, memo=memo)
    logger.info("reference log-probs: cache %s (%s, %d pairs)", "hit" if hit else "miss, built", key, len(reference))
    return concatenate_datasets([dataset, reference], axis=1)


def check_reference(model_args: ModelArguments, training_args: DPOArguments) -> None:
    needs_reference = training_args.loss_type not in REFERENCE_FREE
    if model_args.full_finetuning and needs_reference and not training_args.precompute_ref_log_probs:
        raise InputError(f"--full_finetuning with --loss_type {training_args.loss_type}: the reference is the model "
                         "with its LoRA disabled; add --precompute_ref_log_probs, or use LoRA")
    if training_args.precompute_ref_log_probs and needs_reference and is_deepspeed_zero3_enabled():
        raise InputError("--precompute_ref_log_probs runs the model before DeepSpeed partitions it: use ZeRO-2, or "
                         "leave it out under ZeRO-3 (the reference is then the model with its LoRA disabled)")
