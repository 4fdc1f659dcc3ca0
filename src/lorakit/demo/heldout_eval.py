"""Held-out perplexity of a causal LM on plain texts, per token and per character.

Per-token perplexity only compares models that share a tokenizer: a tokenizer that needs fewer
tokens for the same text gets a higher per-token perplexity for the same quality. The NLL of the
whole text divided by its number of characters does not depend on the tokenizer, so it is also
reported, for comparing e.g. a base model with one whose vocabulary was extended.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def token_stream(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[int]:
    """EOS, then each text followed by EOS: the layout pretraining blocks have.

    The leading EOS is context only (never scored), so the first text's first token is
    predicted after a document boundary just like every later text's.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token to separate the texts")
    stream = [eos]
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        stream.append(eos)
    return stream


def windows(stream: list[int], block_size: int) -> list[list[int]]:
    """Blocks of at most block_size that overlap by one token, so that every token after the
    first is the target of exactly one prediction (a block's first token is only context)."""
    if block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {block_size}")
    return [stream[start:start + block_size] for start in range(0, len(stream) - 1, block_size - 1)]


class PaddedBlocks(NamedTuple):
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


def padded_blocks(batch: list[list[int]], device: torch.device) -> PaddedBlocks:
    """Token blocks as one batch. Only the last block can be shorter; its padding is masked out of attention and
    loss."""
    width = max(map(len, batch))
    input_ids = torch.zeros(len(batch), width, dtype=torch.long)
    attention_mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, block in enumerate(batch):
        input_ids[row, :len(block)] = torch.tensor(block)
        attention_mask[row, :len(block)] = 1
    return PaddedBlocks(input_ids.to(device), attention_mask.to(device))


@torch.inference_mode()
def heldout_nll(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str], block_size: int,
                batch_size: int = 4, desc: str = "Held-out NLL") -> dict[str, float]:
    """Mean negative log-likelihood and perplexity of ``texts``, per token and per character.

    Each text is scored together with the EOS that ends it, and counts one character for that
    end (the newline that ends it in a one-document-a-line file), so ``chars`` is the length of
    the texts written one a line.
    """
    if not texts:
        raise ValueError("no texts to evaluate")
    blocks = windows(token_stream(tokenizer, texts), block_size)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_nll, scored = 0.0, 0
    for start in tqdm(range(0, len(blocks), batch_size), desc=desc, unit="batch"):
        input_ids, attention_mask = padded_blocks(blocks[start:start + batch_size], device)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        targets = input_ids[:, 1:].masked_fill(attention_mask[:, 1:] == 0, -100)
        # Summed in float32 whatever the model's dtype, so long texts do not lose precision.
        total_nll += F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(),
                                     ignore_index=-100, reduction="sum").item()
        scored += int((targets != -100).sum())
    model.train(was_training)

    chars = sum(len(text) + 1 for text in texts)
    nll_per_token, nll_per_char = total_nll / scored, total_nll / chars
    return {
        "texts": len(texts),
        "tokens": scored,
        "chars": chars,
        "nll_per_token": nll_per_token,
        "ppl_token": math.exp(nll_per_token),
        "nll_per_char": nll_per_char,
        "ppl_char": math.exp(nll_per_char),
    }
