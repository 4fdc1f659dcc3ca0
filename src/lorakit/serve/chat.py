#!/usr/bin/env python
"""Chat with a merged model, or a base model + LoRA adapter, in the terminal; or answer a file of
prompts in batches.

    python scripts/inference/chat.py --base_model MERGED_DIR
    python scripts/inference/chat.py --base_model BASE --lora_model outputs/sft/sft_lora_model
    python scripts/inference/chat.py --base_model MERGED_DIR \
        --data_file prompts.jsonl --predictions_file predictions.jsonl --batch_size 8

Prompts are rendered with the chat template saved with the tokenizer at training time. In a
chat, /clear forgets the history and /quit (or end of input) leaves; the oldest exchanges are
dropped when the conversation outgrows the context.
"""

import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from transformers import set_seed

from lorakit.core.atomic import write_atomically
from lorakit.core.cli import InputError, parse_args, run_cli
from lorakit.models.arguments import note_accepted_flags, trust_remote_code_field
from lorakit.records.readers import Message, read_records, request_of
from lorakit.serve.inference import (
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
    ChatGenerator,
    Completion,
    InferenceModelArguments,
    PromptTooLong,
    SamplingSettings,
    TextDeltaStreamer,
    load_generator,
    log_mapped_flags,
    trim_history,
)

logger = logging.getLogger(__name__)


@dataclass
class ChatArguments:
    """Sampling (Chinese-LLaMA-Alpaca-2's defaults), the conversation and batch mode."""

    max_new_tokens: int = field(default=400, metadata={"help": "Most tokens of one answer."})
    temperature: float = field(default=0.2, metadata={"help": "Sampling temperature; 0 = greedy."})
    top_p: float = field(default=0.9, metadata={"help": "Nucleus sampling mass."})
    top_k: int = field(default=40, metadata={"help": "Sample among the k likeliest tokens (0 = all)."})
    repetition_penalty: float = field(default=1.1, metadata={"help": "1.0 = none."})
    seed: int | None = field(default=None, metadata={"help": "Seed for reproducible sampling."})
    system_prompt: str | None = field(default=None, metadata={"help": "System turn before the conversation."})
    show_prompt: bool = field(default=False, metadata={"help": "Print each rendered prompt (to check the template)."})
    data_file: str | None = field(
        default=None,
        metadata={"help": "Batch mode: .jsonl/.json of {\"prompt\": ...} or {\"messages\": [...]} records."},
    )
    predictions_file: str | None = field(default=None, metadata={"help": "Batch mode: where answers go (.jsonl)."})
    batch_size: int = field(default=8, metadata={"help": "Batch mode: prompts generated together."})
    trust_remote_code: bool = trust_remote_code_field()
    with_prompt: bool = field(
        default=False, metadata={"help": "Chinese-LLaMA-Alpaca-2's: accepted; the chat template is always applied."}
    )
    interactive: bool = field(
        default=False, metadata={"help": "Chinese-LLaMA-Alpaca-2's: accepted; without --data_file the chat is "
                                         "interactive."}
    )

    def __post_init__(self) -> None:
        if self.interactive and self.data_file:
            raise InputError("--interactive and --data_file both given: the chat is interactive without --data_file "
                             "and answers the file with it; give only one")
        # Logged by log_mapped_flags once main() has configured logging.
        self.mapped_flags: list[str] = []
        note_accepted_flags(self, ACCEPTED_CHAT_FLAGS, self.mapped_flags)


# Chinese-LLaMA-Alpaca-2's inference_hf.py switches that need nothing here, and why.
ACCEPTED_CHAT_FLAGS = {
    "with_prompt": "every prompt is rendered with the chat template saved with the tokenizer at training time",
    "interactive": "without --data_file the chat is interactive (multi-turn; /clear forgets the history)",
}


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
    low, high = REPETITION_PENALTY_RANGE
    if not low <= args.repetition_penalty <= high:
        raise InputError(f"--repetition_penalty must be in [{low}, {high}], got {args.repetition_penalty}")
    # No per-generation seed: --seed seeds the process once (see main).
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
    completions: list[Completion | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        results = generator.generate([prompts[i].ids for i in chunk], settings, stops=generator.chat_stops())
        for index, completion in zip(chunk, results, strict=True):
            completions[index] = completion
        logger.info("answered %d of %d prompts", min(start + batch_size, len(order)), len(order))
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


# main() parses them; the pipeline launcher reads their flag names.
ARGUMENT_CLASSES = (InferenceModelArguments, ChatArguments)


def main() -> None:
    model_args, chat_args = parse_args(ARGUMENT_CLASSES)
    # Logs go to stderr: stdout carries the conversation (or nothing, in batch mode).
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.INFO, stream=sys.stderr, force=True)
    log_mapped_flags(model_args, chat_args)
    settings = sampling_settings(chat_args)
    batch_mode = chat_args.data_file or chat_args.predictions_file
    records = None
    if batch_mode:
        if not (chat_args.data_file and chat_args.predictions_file):
            raise InputError("batch mode needs both --data_file and --predictions_file")
        if os.path.exists(chat_args.predictions_file):
            raise InputError(f"{chat_args.predictions_file}: --predictions_file already exists; "
                             "choose another name or remove it")
        records = read_prompt_records(chat_args.data_file, chat_args.system_prompt)
    # The data, the tokenizer and its template are checked before the weights are loaded.
    generator = load_generator(model_args, chat_args.trust_remote_code)
    logger.info("sampling: %s", asdict(settings))
    if chat_args.seed is not None:
        set_seed(chat_args.seed)  # once: each turn then continues the same random stream
    if batch_mode:
        prompts = encode_prompts(records, generator, prompt_budget(generator, settings.max_new_tokens))
        predict_file(generator, prompts, settings, chat_args.batch_size, chat_args.predictions_file)
    else:
        chat_loop(generator, settings, chat_args.system_prompt, chat_args.show_prompt)


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    run_cli(main)


if __name__ == "__main__":
    entry_point()
