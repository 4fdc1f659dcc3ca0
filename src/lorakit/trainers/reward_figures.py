"""The reward report's figures, computed from scores alone: pure functions of numpy arrays, tested against
hand-computed values (lorakit.trainers.reward_report scores the pairs and writes the report).

A pair's difference is d = score(chosen) - score(rejected): the pair is scored right when d > 0 (as the Trainer's
eval_accuracy counts it, so a tie is scored wrong), and a tie when |d| <= TIE_TOLERANCE."""

import math
from typing import Any, NamedTuple

import numpy as np

# The two-sided 95% quantile of the standard normal distribution.
Z_95 = 1.959963984540054
TIE_TOLERANCE = 1e-6
# An even count: no bin straddles 0.5, where the two orientations of a pair (p and 1 - p, outcomes 1 and 0) would
# share a bin and always look calibrated, whatever the accuracy of the pairs scored near a tie.
CALIBRATION_BINS = 10
MARGIN_QUANTILES = {"q05": 0.05, "q25": 0.25, "median": 0.5, "q75": 0.75, "q95": 0.95}


class Interval(NamedTuple):
    low: float
    high: float


class SetScores(NamedTuple):
    """A set's scored pairs: scores and answer lengths (tokens), one entry per pair, in the set's order."""

    chosen: np.ndarray
    rejected: np.ndarray
    chosen_lengths: np.ndarray
    rejected_lengths: np.ndarray


class VariantScores(NamedTuple):
    """A change compared on a set's pairs: their differences as scored and with the change, how many pairs the
    change altered (the others keep their token ids, hence their scores), how many it could not render (left out)
    and the first reason why; or why it was not compared at all (skipped)."""

    base: np.ndarray
    changed: np.ndarray
    pairs_changed: int
    not_rendered: int = 0
    skipped: str | None = None
    problem: str | None = None


def wilson_interval(successes: int, total: int, z: float = Z_95) -> Interval | None:
    """The Wilson score interval of a proportion: unlike p +- z*sqrt(p(1-p)/n), it stays inside [0, 1] and is not
    empty at 0 or n successes, which small evaluation sets often give. None for no trials."""
    if total == 0:
        return None
    share, z2 = successes / total, z * z
    centre = (share + z2 / (2 * total)) / (1 + z2 / total)
    half = z * math.sqrt(share * (1 - share) / total + z2 / (4 * total * total)) / (1 + z2 / total)
    return Interval(max(0.0, centre - half), min(1.0, centre + half))


def accuracy_figures(differences: np.ndarray) -> dict[str, Any]:
    """Pairs, how many score the chosen answer above the rejected one, their share and its 95% Wilson interval."""
    pairs, correct = len(differences), int((differences > 0).sum())
    interval = wilson_interval(correct, pairs)
    return {"pairs": pairs, "correct": correct, "accuracy": correct / pairs if pairs else None,
            "ci95": list(interval) if interval else None}


def pearson(x: np.ndarray, y: np.ndarray) -> float | None:
    """Pearson's correlation, None where it is undefined (fewer than two values, or one side constant)."""
    if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def length_bias(scores: SetScores) -> dict[str, Any]:
    """Accuracy where the chosen answer is the shorter one, the longer one, or as long as the rejected one (in
    tokens); and the correlation of score with answer length over every scored answer, chosen and rejected."""
    differences = scores.chosen - scores.rejected
    longer = scores.chosen_lengths - scores.rejected_lengths
    lengths = np.concatenate([scores.chosen_lengths, scores.rejected_lengths]).astype(float)
    return {"chosen_shorter": accuracy_figures(differences[longer < 0]),
            "chosen_longer": accuracy_figures(differences[longer > 0]),
            "same_length": accuracy_figures(differences[longer == 0]),
            "score_length_correlation": pearson(lengths, np.concatenate([scores.chosen, scores.rejected]))}


def preference_signs(differences: np.ndarray) -> np.ndarray:
    """+1 (chosen preferred), -1 (rejected preferred) or 0 (a tie, within TIE_TOLERANCE)."""
    return np.where(np.abs(differences) <= TIE_TOLERANCE, 0, np.sign(differences)).astype(int)


def flip_figures(variant: VariantScores) -> dict[str, Any]:
    """Of the pairs compared, how many change preference (the sign of the difference, a tie being its own sign)
    under a change that must not matter, and the accuracy with the change."""
    if variant.skipped:
        return {"skipped": variant.skipped}
    flipped = int((preference_signs(variant.base) != preference_signs(variant.changed)).sum())
    pairs = len(variant.base)
    figures = {"pairs": pairs, "pairs_changed": variant.pairs_changed, "flipped": flipped,
               "flip_share": flipped / pairs if pairs else None,
               "accuracy_with_change": accuracy_figures(variant.changed)["accuracy"],
               "not_rendered": variant.not_rendered}
    return figures | ({"not_rendered_reason": variant.problem} if variant.problem else {})


def calibration(differences: np.ndarray, bins: int = CALIBRATION_BINS) -> dict[str, Any]:
    """sigmoid(d) read as the probability that the chosen answer is preferred, checked against what happened. Each
    pair counts in both orientations, (chosen, rejected) predicting sigmoid(d) with outcome 1 and (rejected, chosen)
    predicting 1 - sigmoid(d) with outcome 0, so that observed frequencies are not all 1. Bins of equal width in
    predicted probability (the last one closed); ECE: the count-weighted mean |mean predicted - observed|."""
    positive = 1 / (1 + np.exp(-differences.astype(np.float64)))
    predicted = np.concatenate([positive, 1 - positive])
    outcome = np.concatenate([np.ones(len(differences)), np.zeros(len(differences))])
    index = np.minimum((predicted * bins).astype(int), bins - 1)
    table, ece = [], 0.0
    for b in range(bins):
        members = index == b
        count = int(members.sum())
        mean_predicted: float | None = None
        observed: float | None = None
        if count:
            mean_predicted, observed = float(predicted[members].mean()), float(outcome[members].mean())
            ece += count / len(predicted) * abs(mean_predicted - observed)
        table.append({"low": b / bins, "high": (b + 1) / bins, "count": count, "mean_predicted": mean_predicted,
                      "observed": observed})
    return {"bins": table, "ece": ece if len(predicted) else None}


def margin_distribution(differences: np.ndarray) -> dict[str, float | None]:
    """Mean, standard deviation (of the population), extremes and quantiles (linear interpolation) of d."""
    if not len(differences):
        return {name: None for name in ("mean", "std", "min", *MARGIN_QUANTILES, "max")}
    figures: dict[str, float | None] = {"mean": float(differences.mean()), "std": float(differences.std()),
                                        "min": float(differences.min())}
    figures |= {name: float(np.quantile(differences, q)) for name, q in MARGIN_QUANTILES.items()}
    return figures | {"max": float(differences.max())}


def tie_figures(differences: np.ndarray) -> dict[str, Any]:
    count = int((np.abs(differences) <= TIE_TOLERANCE).sum())
    return {"count": count, "share": count / len(differences) if len(differences) else None}


def set_figures(scores: SetScores, variants: dict[str, VariantScores]) -> dict[str, Any]:
    """Every figure of one set of pairs (or of all of them, for the overall row)."""
    differences = scores.chosen - scores.rejected
    return {"pairs": len(differences), "accuracy": accuracy_figures(differences), "length_bias": length_bias(scores),
            "robustness": {name: flip_figures(variant) for name, variant in variants.items()},
            "calibration": calibration(differences), "margin": margin_distribution(differences),
            "ties": tie_figures(differences)}
