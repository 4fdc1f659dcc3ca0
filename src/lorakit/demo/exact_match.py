"""Exact-match accuracy of a chat model on alpaca records: greedy answers to prompts rendered
with the tokenizer's chat template, scored with demo.sft_tasks.is_exact_match.

The prompt is what the chat template renders for the conversation so far with
add_generation_prompt=True, encoded without tokenizer-added special tokens: exactly the prompt
tokens run_sft_with_peft.py trains on when it is given the same tokenizer (an adapter's saved
tokenizer carries the template it was trained with). Prompts are batched with LEFT padding, so
every row's answer starts right after its own last prompt token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np
import torch
from tqdm.auto import tqdm

from lorakit.demo.sft_tasks import is_exact_match
from lorakit.records.chat_templates import render_text
from lorakit.records.readers import PROMPT, conversation_of

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel, PreTrainedTokenizerBase


def render_prompts(tokenizer: PreTrainedTokenizerBase, records: list[dict[str, str]]) -> list[str]:
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat_template to render prompts with")
    # The conversation up to the answer, read exactly as SFT reads the record (records.readers.conversation_of).
    return [render_text(tokenizer, conversation_of(f"record {index}", record, PROMPT), add_generation_prompt=True)
            for index, record in enumerate(records)]


@torch.inference_mode()
def generate_answers(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str],
                     max_new_tokens: int = 12, batch_size: int = 16, desc: str = "Generating",
                     temperature: float | None = None) -> list[str]:
    """Greedy continuations of each prompt (or, at a temperature, sampled from the whole distribution: no top-k or
    top-p), stopped at EOS (or max_new_tokens), decoded without special tokens. Prompts are sorted by length so a
    batch holds little padding."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token: generation could not stop")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    answers = [""] * len(prompts)  # each set below: order holds every index once
    with tqdm(total=len(prompts), desc=desc, unit="prompt") as progress:
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            width = max(len(encoded[i]) for i in rows)
            input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
            attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
            for row, index in enumerate(rows):  # left padding
                ids = encoded[index]
                input_ids[row, width - len(ids):] = torch.tensor(ids)
                attention_mask[row, width - len(ids):] = 1
            # A causal LM's class mixes GenerationMixin into PreTrainedModel, which itself declares no generate().
            output = cast("GenerationMixin", model).generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                max_new_tokens=max_new_tokens, do_sample=temperature is not None, temperature=temperature,
                top_p=None if temperature is None else 1.0, top_k=None if temperature is None else 0,
                eos_token_id=eos, pad_token_id=pad,
            )
            for row, index in enumerate(rows):
                # transformers types decode() for a batch of rows too (list[str]); one row's ids decode to a str.
                answers[index] = cast(str, tokenizer.decode(output[row, width:], skip_special_tokens=True))
            progress.update(len(rows))
    model.train(was_training)
    return answers


def exact_match(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, records: list[dict[str, str]],
                max_new_tokens: int = 12, batch_size: int = 16, desc: str = "Exact match") -> dict[str, Any]:
    """{"correct", "total", "accuracy", "answers": [{"instruction", "expected", "generated", "correct"}]}."""
    if not records:
        raise ValueError("no records to score")
    generated = generate_answers(model, tokenizer, render_prompts(tokenizer, records), max_new_tokens,
                                 batch_size, desc)
    answers: list[dict[str, Any]] = [
        {"instruction": record["instruction"], "expected": record["output"], "generated": text,
         "correct": is_exact_match(text, record)} for record, text in zip(records, generated, strict=True)]
    correct = sum(answer["correct"] for answer in answers)
    return {"correct": correct, "total": len(records), "accuracy": correct / len(records), "answers": answers}


def sampled_exact_match(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, records: list[dict[str, str]],
                        samples: int, temperature: float, seed: int, max_new_tokens: int = 12,
                        desc: str = "Sampled exact match") -> dict[str, Any]:
    """Exact match of the policy's own sampling: each question answered `samples` times at temperature, from seed (the
    caller's random state untouched). {"samples", "temperature", "accuracy" (pass@1 estimated from the samples, as
    RL evaluations report it), "per_question": each question's share of right answers}."""
    prompts = render_prompts(tokenizer, records)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        generated = generate_answers(model, tokenizer, [p for p in prompts for _ in range(samples)], max_new_tokens,
                                     len(prompts) * samples, desc, temperature)
    right = [is_exact_match(text, records[index // samples]) for index, text in enumerate(generated)]
    per_question = [sum(right[i * samples:(i + 1) * samples]) / samples for i in range(len(records))]
    return {"samples": samples, "temperature": temperature, "accuracy": sum(per_question) / len(records),
            "per_question": per_question}


class Interval(NamedTuple):
    low: float
    high: float


def paired_bootstrap_interval(before: Sequence[float], after: Sequence[float], resamples: int = 10_000, seed: int = 0,
                              level: float = 0.95) -> Interval:
    """The level-interval (percentile bootstrap) of the gain in accuracy from before to after, both scored on the same
    questions (each question 0 or 1, or its share of right answers): the questions are resampled with replacement,
    each resample keeping its question's pair, so what the two models share (an easy question) does not widen the
    interval."""
    if len(before) != len(after) or not before:
        raise ValueError(f"paired scores of {len(before)} and {len(after)} questions")
    differences = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    rows = np.random.default_rng(seed).integers(0, len(differences), size=(resamples, len(differences)))
    gains = differences[rows].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(gains, [tail, 1 - tail])
    return Interval(float(low), float(high))
