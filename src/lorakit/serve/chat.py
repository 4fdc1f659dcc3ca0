"""The chat behind `lorakit chat`: its sampling settings checked against the server's bounds, the
terminal conversation (chat_loop: /clear forgets the history, /quit or end of input leaves; the oldest
exchanges are dropped when the conversation outgrows the context), and batch mode (a file of prompts read and
checked before any model is loaded, answered in batches of similar length, written whole)."""

import json
import logging
import os
from typing import Any, NamedTuple

from lorakit.core.atomic import write_atomically
from lorakit.core.cli import InputError
from lorakit.records.readers import Message, read_records, request_of
from lorakit.serve.chat_config import ChatArguments
from lorakit.serve.inference import (
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
    ChatGenerator,
    Completion,
    PromptTooLong,
    SamplingSettings,
    TextDeltaStreamer,
    trim_history,
)

logger = logging.getLogger(__name__)


def sampling_settings(args: ChatArguments) -> SamplingSettings:
    for name, value, low in (("max_new_tokens", args.max_new_tokens, 1), ("batch_size", args.batch_size, 1),
                             ("top_k", args.top_k, 0)):
        if value < low:
            raise InputError(f"--{name} must be at least {low}, got {value}")
    if args.temperature != 0 and not MIN_TEMPERATURE <= args.temperature <= MAX_TEMPERATURE:
        raise InputError(f"--temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                         f"got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise InputError(f"--top_p must be in (0, 1], got {args.top_p}")
    lowest, highest = REPETITION_PENALTY_RANGE
    if not lowest <= args.repetition_penalty <= highest:
        raise InputError(f"--repetition_penalty must be in [{lowest}, {highest}], got {args.repetition_penalty}")
    # No per-generation seed: --seed seeds the process once (see the command's main, lorakit.commands.chat).
    return SamplingSettings(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.repetition_penalty)


def prompt_budget(generator: ChatGenerator, max_new_tokens: int) -> int:
    budget = generator.context_tokens - max_new_tokens
    if budget < 1:
        raise InputError(f"--max_new_tokens {max_new_tokens} leaves no room for a prompt in a context of "
                         f"{generator.context_tokens} tokens")
    return budget


class PromptRecord(NamedTuple):
    """One request of the batch file: where it is (file:line), the field it came in, that field's value, its
    messages."""

    where: str
    field_name: str
    value: Any
    messages: list[Message]


class EncodedPrompt(NamedTuple):
    """A request's field and value (echoed in its prediction line) and its prompt's token ids."""

    field_name: str
    value: Any
    ids: list[int]


def read_prompt_records(path: str, system_prompt: str | None) -> list[PromptRecord]:
    """Every record's request, refusing the first bad one by file:line:field before any model is loaded."""
    if not os.path.isfile(path):
        raise InputError(f"{path}: --data_file does not exist")
    if not path.endswith((".json", ".jsonl")):
        raise InputError(f"{path}: --data_file must be .jsonl (one record a line) or .json (a list)")
    records = [PromptRecord(f"{path}:{line}", *request_of(f"{path}:{line}", record, system_prompt))
               for line, record in read_records(path)]
    if not records:
        raise InputError(f"{path}: file holds no records (empty)")
    return records


def encode_prompts(records: list[PromptRecord], generator: ChatGenerator, budget: int) -> list[EncodedPrompt]:
    """Each record's prompt ids; a prompt that leaves no room for the answer is refused."""
    prompts = []
    for where, name, value, messages in records:
        ids = generator.encode_chat(messages)
        if len(ids) > budget:
            raise InputError(f"{where}: field '{name}': {PromptTooLong(len(ids), budget)}")
        prompts.append(EncodedPrompt(name, value, ids))
    return prompts


def predict_file(generator: ChatGenerator, prompts: list[EncodedPrompt], settings: SamplingSettings,
                 batch_size: int, predictions_file: str) -> None:
    """Answer every prompt, batching prompts of similar length (less padding), and write the
    answers in input order. The file appears only when complete."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))
    answered: dict[int, Completion] = {}
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        results = generator.generate([prompts[i].ids for i in chunk], settings, stops=generator.chat_stops())
        for index, completion in zip(chunk, results, strict=True):
            answered[index] = completion
        logger.info("answered %d of %d prompts", min(start + batch_size, len(order)), len(order))
    completions = [answered[index] for index in range(len(prompts))]  # order holds every index: each was answered
    lines = [json.dumps({name: value, "response": completion.text, "finish_reason": completion.finish_reason},
                        ensure_ascii=False) + "\n"
             for (name, value, _), completion in zip(prompts, completions, strict=True)]
    write_atomically(predictions_file, "".join(lines), make_parents=True)
    logger.info("wrote %d predictions to %s", len(prompts), predictions_file)


def chat_loop(generator: ChatGenerator, settings: SamplingSettings, system_prompt: str | None,
              show_prompt: bool) -> None:
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    budget = prompt_budget(generator, settings.max_new_tokens)
    history: list[Message] = []
    print("Chat: /clear forgets the history, /quit leaves.", flush=True)
    while True:
        try:
            text = input("\nUser: ").strip()
        except (EOFError, KeyboardInterrupt):
            print(flush=True)
            break
        if text == "/quit":
            break
        if text == "/clear":
            history = []
            print("(history cleared)", flush=True)
            continue
        if not text:
            continue
        try:
            messages, dropped = trim_history(system + history + [{"role": "user", "content": text}],
                                             lambda kept: len(generator.encode_chat(kept)), budget)
        except PromptTooLong as err:
            print(f"(not sent: {err}; shorten it or raise --max_context_tokens)", flush=True)
            continue
        if dropped:
            print(f"(dropped the {dropped} oldest exchange(s) to fit the {budget}-token prompt budget)", flush=True)
        if show_prompt:
            print(f"--- prompt ---\n{generator.render(messages)}\n--- end of prompt ---", flush=True)
        print("Assistant: ", end="", flush=True)
        streamer = TextDeltaStreamer(generator.tokenizer, lambda delta: print(delta, end="", flush=True),
                                     generator.chat_stops())
        completion = generator.generate([generator.encode_chat(messages)], settings, generator.chat_stops(),
                                        streamer)[0]
        print(flush=True)
        history = messages[len(system):] + [{"role": "assistant", "content": completion.text}]
