"""The DPO stage's batches and Trainer: preference pairs as the reward stage lays them out (one row
per pair with the shared prefix once, or two rows), each answer's log-probability summed over its own
tokens (the model's head runs on answer positions only: model_utils.answer_logps_forward), the loss of
dpo_losses, and TRL's metric names.

Reference: the same model with its LoRA adapter disabled (peft's disable_adapter, under no_grad),
or the log-probabilities computed once before training (precomputed_reference_logps) and carried
in the batches, after which no reference forward runs."""

import logging
import os
from contextlib import nullcontext

import torch
from datasets import Dataset, concatenate_datasets
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from lorakit.core.pair_segments import PAIR_CHOSEN, PAIR_PREFIX
from lorakit.data.build_dataset import DataCollatorForPreferencePairs
from lorakit.data.cache import FingerprintMemo, build_or_load_cached, cache_key
from lorakit.models.dpo_losses import REFERENCE_FREE, nll_loss, nll_weight, preference_loss, sequence_log_probs
from lorakit.trainers.common import ResumableTrainer

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

    def __call__(self, features: list) -> dict:
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
                index.append(chosen_row * width + j - 1), targets.append(chosen[j]), owner.append(i)
            for j in range(feature["rejected_answer_start"], len(rejected)):
                index.append(rejected_row * width + rejected_position[j])
                targets.append(rejected[j]), owner.append(pairs + i)
        batch.update(answer_index=torch.tensor(index), answer_targets=torch.tensor(targets),
                     answer_owner=torch.tensor(owner))
        for name in REFERENCE_COLUMNS:
            if name in features[0]:
                batch[name] = torch.tensor([float(f[name]) for f in features], dtype=torch.float32)
        return batch


def answer_logps(model, batch: dict) -> tuple:
    """(summed log-probabilities, token counts) of the batch's answers, chosen ones then rejected."""
    inputs = {name: value for name, value in batch.items() if name not in ("answer_owner",) + REFERENCE_COLUMNS}
    rows = batch["input_ids"].shape[0]
    sequences = 2 * rows if "pair_segments" in batch else rows
    return sequence_log_probs(model(**inputs).token_logps, batch["answer_owner"], sequences)


def reference_logps(model, unwrapped_model, batch: dict):
    """The answers' log-probabilities under the reference: the model with its adapter disabled."""
    from peft import PeftModel

    # A fully fine-tuned model (precomputing only) is its own reference before training.
    disabled = unwrapped_model.disable_adapter() if isinstance(unwrapped_model, PeftModel) else nullcontext()
    with torch.no_grad(), disabled:
        return answer_logps(model, batch)[0]


class DPOTrainer(ResumableTrainer):
    """compute_loss: policy and reference log-probs of each pair's answers -> the --loss_type loss
    (+ the NLL term of ORPO and --rpo_alpha); the pair metrics are summed per mode and logged,
    averaged over every pair since the last log, with TRL's names."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.metric_sums = {"train": torch.zeros(len(METRICS) + 1), "eval": torch.zeros(len(METRICS) + 1)}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.args
        ref_chosen = ref_rejected = None
        if args.loss_type not in REFERENCE_FREE:
            if "ref_chosen_logps" in inputs:
                ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
            else:
                ref_chosen, ref_rejected = reference_logps(model, self.accelerator.unwrap_model(model),
                                                           inputs).chunk(2)
        sums, counts = answer_logps(model, inputs)
        (chosen, rejected), (chosen_tokens, rejected_tokens) = sums.chunk(2), counts.chunk(2)
        losses, chosen_rewards, rejected_rewards = preference_loss(
            args.loss_type, chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens, args.beta,
            args.label_smoothing, args.simpo_gamma)
        loss = losses.mean()
        weight = nll_weight(args.loss_type, args.rpo_alpha)
        if weight:
            loss = loss + weight * nll_loss(chosen, chosen_tokens)
        self.record_metrics("train" if model.training else "eval", chosen_rewards, rejected_rewards,
                            chosen.detach(), rejected.detach())
        return (loss, {"chosen": chosen_rewards, "rejected": rejected_rewards}) if return_outputs else loss

    def record_metrics(self, mode: str, chosen_rewards, rejected_rewards, chosen_logps, rejected_logps) -> None:
        values = torch.stack([chosen_rewards, rejected_rewards, (chosen_rewards > rejected_rewards).float(),
                              chosen_rewards - rejected_rewards, chosen_logps, rejected_logps]).float().sum(dim=1)
        self.metric_sums[mode] += torch.cat([values.cpu(), torch.tensor([float(len(chosen_rewards))])])

    def pop_metrics(self, mode: str, prefix: str = "") -> dict:
        """The mean of each metric over every pair of every rank since the last call (a collective)."""
        totals = self.accelerator.reduce(self.metric_sums[mode].to(self.accelerator.device), "sum").cpu()
        self.metric_sums[mode].zero_()
        pairs = max(totals[-1].item(), 1.0)
        return {f"{prefix}{name}": totals[k].item() / pairs for k, name in enumerate(METRICS)}

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs, *args, **kwargs):
        if "loss" in logs:  # a training log: every rank logs at the same step
            logs.update(self.pop_metrics("train"))
        super().log(logs, *args, **kwargs)

    def evaluation_loop(self, *args, **kwargs):
        output = super().evaluation_loop(*args, **kwargs)
        output.metrics.update(self.pop_metrics("eval", f"{kwargs.get('metric_key_prefix', 'eval')}_"))
        return output


def reference_model_fingerprint(model_args, memo: FingerprintMemo) -> dict:
    """What the reference log-probs depend on: the weights (and folded adapter) by content (memo: read once per
    node, then stat), the dtype and quantization."""
    def fingerprints(directory):
        if not directory:
            return None
        return sorted((name, memo(os.path.join(directory, name))) for name in os.listdir(directory)
                      if name.endswith((".safetensors", ".bin", ".json")))

    return {"model": fingerprints(model_args.model_name_or_path), "adapter": fingerprints(model_args.peft_path),
            "dtype": model_args.torch_dtype, "kbits": model_args.load_in_kbits,
            "attention": model_args.attn_implementation}


def with_reference_logps(dataset: Dataset, model, collator, training_args, model_args, cache_dir: str) -> Dataset:
    """The dataset plus the reference log-probs of each pair's answers (REFERENCE_COLUMNS), computed
    once with the adapter disabled and cached next to the tokenized pairs (the key covers the pairs
    and the reference model); every rank reads the one cached copy."""
    def build(tmp_dir):
        loader = DataLoader(dataset, batch_size=training_args.per_device_eval_batch_size, collate_fn=collator)
        device, columns = training_args.device, []
        model.to(device).eval()
        for batch in tqdm(loader, desc="Reference log-probs", unit="batch"):
            batch = {name: value.to(device) for name, value in batch.items()}
            columns.append(reference_logps(model, model, batch).cpu().view(2, -1))
        model.train()
        table = torch.cat(columns, dim=1)
        Dataset.from_dict(dict(zip(REFERENCE_COLUMNS, table.tolist()))).save_to_disk(tmp_dir)

    with training_args.main_process_first(desc="reference log-probs"):
        memo = FingerprintMemo(cache_dir)
        key = cache_key({"version": REFERENCE_CACHE_VERSION, "pairs": dataset._fingerprint,
                         "reference": reference_model_fingerprint(model_args, memo)})
        reference, hit = build_or_load_cached(cache_dir, f"dpo-ref-{key}", build, memo=memo)
    logger.info("reference log-probs: cache %s (%s, %d pairs)", "hit" if hit else "miss, built", key, len(reference))
    return concatenate_datasets([dataset, reference], axis=1)
