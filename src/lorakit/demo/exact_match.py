"""Exact-match accuracy of a chat model on alpaca records: greedy answers to prompts rendered
with the tokenizer's chat template, scored with demo.sft_tasks.is_exact_match.

The prompt is what the chat template renders for the conversation so far with
add_generation_prompt=True, encoded without tokenizer-added special tokens: exactly the prompt
tokens run_sft_with_peft.py trains on when it is given the same tokenizer (an adapter's saved
tokenizer carries the template it was trained with). Prompts are batched with LEFT padding, so
every row's answer starts right after its own last prompt token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from lorakit.demo.sft_tasks import is_exact_match
from lorakit.records.readers import PROMPT, conversation_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def render_prompts(tokenizer: PreTrainedTokenizerBase, records: list[dict[str, str]]) -> list[str]:
    if not tokenizer.chat_template:
        raise ValueError("the tokenizer has no chat_template to render prompts with")
    # The conversation up to the answer, read exactly as SFT reads the record (records.readers.conversation_of).
    return [tokenizer.apply_chat_template(conversation_of(f"record {index}", record, PROMPT), tokenize=False,
                                          add_generation_prompt=True)
            for index, record in enumerate(records)]


@torch.inference_mode()
def generate_answers(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str],
                     max_new_tokens: int = 12, batch_size: int = 16, desc: str = "Generating") -> list[str]:
    """Greedy continuations of each prompt, stopped at EOS (or max_new_tokens), decoded without
    special tokens. Prompts are sorted by length so a batch holds little padding."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token: generation could not stop")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    answers: list[str | None] = [None] * len(prompts)
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
            output = model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                eos_token_id=eos, pad_token_id=pad,
            )
            for row, index in enumerate(rows):
                answers[index] = tokenizer.decode(output[row, width:], skip_special_tokens=True)
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
    answers = [{"instruction": record["instruction"], "expected": record["output"], "generated": text,
                "correct": is_exact_match(text, record)} for record, text in zip(records, generated, strict=True)]
    correct = sum(answer["correct"] for answer in answers)
    return {"correct": correct, "total": len(records), "accuracy": correct / len(records), "answers": answers}
