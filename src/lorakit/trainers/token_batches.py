"""Token-budget batching (--max_tokens_per_batch): each micro-batch holds as many rows as fit a budget of tokens
(rows x their padded width), instead of a fixed number of rows. Short rows then share a batch, long ones take one
to themselves, and every forward pass carries about the same work, which is what the GPU's time and memory follow.

The micro-batches of an epoch are a function of (seed, epoch) alone, the same on every rank, which then takes its
own share: a resumed run sees the batches an uninterrupted one would, and no rank waits on another for a batch it
never gets. The loss needs nothing more: the Trainer divides by the labelled tokens of the whole accumulated batch
(num_items_in_batch, across ranks), however many rows each micro-batch holds."""

import logging
from collections.abc import Iterator

import torch
from transformers.trainer_pt_utils import BatchRebalanceSampler

from lorakit.core.cli import InputError

logger = logging.getLogger(__name__)

# Rows are sorted by length within windows of about this many budgets' worth of tokens, as transformers'
# LengthGroupedSampler sorts within megabatches of 50 batches: similar lengths share a batch (little padding)
# while each window is still a random draw from the epoch.
WINDOW_BATCHES = 50


def padded_width(length: int, multiple: int) -> int:
    """A row's width once the collator pads it to a multiple of `multiple` tokens."""
    return -(-length // multiple) * multiple


def check_token_budget(max_tokens: int, max_length: int, multiple: int) -> None:
    """Refuse a budget that a row of --max_seq_length tokens (padded as the collator pads it) would not fit in:
    checked before any data is read, so a refusal writes nothing."""
    longest = padded_width(max_length, multiple)
    if max_tokens < longest:
        raise InputError(f"--max_tokens_per_batch {max_tokens} is below --max_seq_length {max_length} ({longest} "
                         f"once padded to a multiple of {multiple}): a row that long would not fit; raise it to at "
                         f"least {longest}, or lower --max_seq_length")


def budget_batches(rows: list[int], lengths: list[int], max_tokens: int, multiple: int) -> list[list[int]]:
    """Cut rows (indices, in the order given) into batches of at most max_tokens padded tokens: sorted longest
    first, each batch takes rows while (its rows + 1) x its first row's padded width fits (a row wider than the
    budget alone would make a batch of its own: check_token_budget keeps there from being one)."""
    batches: list[list[int]] = []
    for index in sorted(rows, key=lambda row: -lengths[row]):
        if batches and (len(batches[-1]) + 1) * padded_width(lengths[batches[-1][0]], multiple) <= max_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


class TokenBudgetBatchSampler(BatchRebalanceSampler):
    """Yields this rank's micro-batches (lists of row indices). A BatchRebalanceSampler, so the Trainer passes it to
    the DataLoader as its batch sampler and keeps accelerate from sharding it again; none of that class's cost
    balancing is used. The batches are cut once, from the seed: the rows in a seeded order, cut into windows of
    about WINDOW_BATCHES budgets, each window cut by budget_batches. So every epoch has the same number of steps,
    which the Trainer counts once and a resume computes its place from. Each epoch shuffles their order (seed +
    epoch) and deals them round-robin to the ranks; the last (fewer than one per rank) sit that epoch out."""

    def __init__(self, lengths: list[int], max_tokens: int, multiple: int, seed: int, dp_size: int = 1,
                 rank: int = 0) -> None:
        self.seed, self.dp_size, self.rank, self.epoch = seed, dp_size, rank, 0
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
        self.batches: list[list[int]] = []
        window, window_tokens = [], 0
        for index in order:
            window.append(index)
            window_tokens += lengths[index]
            if window_tokens >= WINDOW_BATCHES * max_tokens:
                self.batches += budget_batches(window, lengths, max_tokens, multiple)
                window, window_tokens = [], 0
        self.batches += budget_batches(window, lengths, max_tokens, multiple)
        if len(self.batches) < dp_size:
            raise InputError(f"--max_tokens_per_batch {max_tokens} makes {len(self.batches)} batch(es) of the "
                             f"training rows, fewer than the {dp_size} processes: lower it")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(len(self.batches), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        dealt = order[self.rank:len(self) * self.dp_size:self.dp_size]
        yield from (self.batches[i] for i in dealt.tolist())

    def __len__(self) -> int:
        return len(self.batches) // self.dp_size
