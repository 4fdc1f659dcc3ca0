"""How a stage's records are divided: DeepSpeed-Chat's --data_split across the SFT, reward and
PPO phases, and the held-out share for evaluation."""

import logging
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import numpy as np
from datasets import Dataset

from lorakit.core.cli import InputError

logger = logging.getLogger(__name__)

Item = TypeVar("Item")


def parse_data_split(data_split: str) -> list[float]:
    try:
        weights = [float(part) for part in data_split.split(",")]
    except ValueError:
        weights = []
    if len(weights) != 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise InputError(f"--data_split {data_split}: expected three non-negative weights such as 6,2,2")
    return weights


def phase_indices(num_records: int, data_split: str, phase: int, seed: int) -> np.ndarray:
    """DeepSpeed-Chat's split: the records of one dataset, shuffled by seed, cut into three
    disjoint parts by the weights (SFT, reward, PPO); the part of `phase` (1..3), in order."""
    if phase not in (1, 2, 3):
        raise InputError(f"--data_phase {phase}: expected 1 (SFT), 2 (reward) or 3 (PPO)")
    weights = parse_data_split(data_split)
    bounds = np.round(np.cumsum([0] + weights) / sum(weights) * num_records).astype(int)
    order = np.random.default_rng(seed).permutation(num_records)
    return np.sort(order[bounds[phase - 1] : bounds[phase]])


def phase_part(items: list[Item], data_split: str | None, phase: int, seed: int) -> list[Item]:
    """The items of one file that a stage takes: its --data_phase part under --data_split, else all."""
    if not data_split:
        return list(items)
    return [items[i] for i in phase_indices(len(items), data_split, phase, seed)]


class HeldOutIndices(NamedTuple):
    """Indices of the items trained on and of those held out, each sorted."""

    train: np.ndarray
    held_out: np.ndarray


def held_out_indices(count: int, validation_split_percentage: float, seed: int, what: str) -> HeldOutIndices:
    """The train and held-out indices by a seeded shuffle of `count` items. A value
    >= 1 is a percentage, below 1 a fraction (the anchor's scripts pass 0.05 under this name); a
    tiny share of a small set still holds out one item."""
    share = validation_split_percentage
    fraction = share / 100 if share >= 1 else share
    num_eval = max(1, int(round(count * fraction)))
    if num_eval >= count:
        raise InputError(f"--validation_split_percentage {share} of {count} {what} leaves no training or no "
                         f"validation {what.rstrip('s')}; add data or change the percentage")
    order = np.random.default_rng(seed).permutation(count)
    return HeldOutIndices(np.sort(order[num_eval:]), np.sort(order[:num_eval]))


class ValidationSplit(NamedTuple):
    """A dataset's training part and its held-out part (None without a held-out share)."""

    train: Dataset
    evaluation: Dataset | None


def split_validation(dataset: Dataset, validation_split_percentage: float, seed: int,
                     what: str = "blocks") -> ValidationSplit:
    """The train and eval parts of a dataset; eval is None without a held-out share. The split's indices stay
    in memory (select): nothing is written next to a cache that other processes may be reading."""
    if validation_split_percentage <= 0:
        return ValidationSplit(dataset, None)
    train, held_out = held_out_indices(len(dataset), validation_split_percentage, seed, what)
    return ValidationSplit(dataset.select(train), dataset.select(held_out))


def held_out_check(validation_split_percentage: float, seed: int, what: str) -> Callable[[Dataset], object]:
    """split_validation's refusal of a data set too small for the held-out share, as the cache's
    check (data.cache.build_or_load_cached): refused before the data is cached, not after."""
    return lambda dataset: split_validation(dataset, validation_split_percentage, seed, what)


def first_samples(dataset: Dataset | None, limit: int | None) -> Dataset | None:
    """--max_train_samples / --max_eval_samples."""
    if dataset is None or limit is None:
        return dataset
    return dataset.select(range(min(limit, len(dataset))))
