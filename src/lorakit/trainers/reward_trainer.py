"""The reward model's Trainer: the pairwise loss over batches holding each pair's chosen and rejected answers, and
the evaluation's pair metrics."""

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import EvalPrediction

from lorakit.models.heads import score_pairs
from lorakit.trainers.causal_lm import ResumableTrainer
from lorakit.trainers.reward_config import RewardArguments


class RewardTrainer(ResumableTrainer):
    """Pairwise loss -logsigmoid(r_chosen - r_rejected - margin) over batches holding each
    pair's chosen and rejected sequences together (one forward for both)."""

    args: RewardArguments  # the stage's own (Trainer types them as TrainingArguments)

    def compute_loss(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor | tuple[torch.Tensor, Any]:
        chosen, rejected = score_pairs(model, inputs)
        loss = -F.logsigmoid(chosen - rejected - inputs["margin"]).mean()
        if self.args.reward_center_coef:
            loss = loss + self.args.reward_center_coef * (chosen + rejected).pow(2).mean()
        return (loss, {"chosen": chosen, "rejected": rejected}) if return_outputs else loss

    def prediction_step(
        self, model: nn.Module, inputs: dict[str, torch.Tensor | Any], prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, scores = self.compute_loss(model, inputs, return_outputs=True)
        if prediction_loss_only:
            return loss.detach(), None, None
        pair_scores = torch.stack([scores["chosen"], scores["rejected"]], dim=1)
        # compute_metrics only runs when there are labels: the "label" of a pair is its order.
        return loss.detach(), pair_scores, torch.zeros(pair_scores.shape[0], device=pair_scores.device)


def preference_metrics(eval_prediction: EvalPrediction) -> dict[str, float]:
    scores = np.asarray(eval_prediction.predictions)
    chosen, rejected = scores[:, 0], scores[:, 1]
    return {
        "accuracy": float((chosen > rejected).mean()),
        "chosen_score": float(chosen.mean()),
        "rejected_score": float(rejected.mean()),
        "margin": float((chosen - rejected).mean()),
    }
