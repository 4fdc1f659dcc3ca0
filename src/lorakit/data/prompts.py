"""The RL stages' prompts: the records of each file as conversations ending where the model answers next,
split into train and held-out, rendered with the generation prompt and tokenized, each with its record's reference
answer and other fields."""

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from lorakit.core.cli import InputError
from lorakit.data.conversation_tokenizer import ConversationTokenizer
from lorakit.data.splits import held_out_indices, phase_part
from lorakit.records.chat_templates import ChatTemplate
from lorakit.records.readers import Message, find_record_files, prompt_of, record_fields, records_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class PromptDataArguments(Protocol):
    """What build_prompt_sets reads of PPO's data arguments (rl.ppo_config.PPODataArguments, a layer above)."""

    dataset_dir: str | None
    data_path: list[str] | None
    data_split: str | None
    data_phase: int
    validation_file: str | None
    validation_split_percentage: float
    max_train_samples: int | None
    max_eval_samples: int | None
    max_prompt_seq_len: int


class PromptSets(NamedTuple):
    """The RL stages' tokenized prompts: those trained on, and the held-out ones (None without a held-out share),
    with the Prompt each was read from (index for index: its reference answer and fields, for reward functions)."""

    train: list[list[int]]
    evaluation: list[list[int]] | None
    train_records: list["Prompt"]
    evaluation_records: list["Prompt"] | None


class Prompt(NamedTuple):
    """A prompt's conversation (ending where the model answers), where it was read, and the record's other fields
    with its reference answer (records.readers.record_fields: what reward functions read)."""

    where: str
    messages: list[Message]
    fields: dict[str, Any]
    conversational: bool = False  # read from "messages" / "conversations" turns (TRL passes these as messages)


def read_prompts(files: list[str], data_split: str | None, data_phase: int, seed: int) -> list[Prompt]:
    """Prompt of every record of every file (its --data_phase part with --data_split)."""
    prompts = []
    for path in files:
        prompts += [Prompt(where, prompt_of(where, record), record_fields(where, record),
                           isinstance(record, dict) and ("messages" in record or "conversations" in record))
                    for where, record in phase_part(records_of(path), data_split, data_phase, seed)]
    if not prompts:
        raise InputError(f"no prompt in {', '.join(files)} for --data_phase {data_phase} of --data_split {data_split}")
    return prompts


def tokenize_prompts(prompts: Sequence[Prompt | tuple[str, list[Message]]], tokenizer: "PreTrainedTokenizerBase",
                     template: str, max_prompt_len: int, desc: str,
                     template_kwargs: dict[str, Any] | None = None) -> list[list[int]]:
    """Token ids of each prompt rendered with the generation prompt; a prompt longer than
    max_prompt_len keeps its end (the question nearest the answer), as DeepSpeed-Chat does."""
    renderer = ConversationTokenizer(tokenizer, template, max_prompt_len, template_kwargs=template_kwargs)
    rows, truncated = [], 0
    for where, messages, *_ in prompts:  # a Prompt, or a (where, messages) pair
        ids = renderer.prompt_ids(where, messages)
        if len(ids) > max_prompt_len:
            truncated += 1
            ids = ids[-max_prompt_len:]
        rows.append(ids)
    logger.info("%s: %d prompts, %d truncated from the left to --max_prompt_seq_len %d", desc, len(rows), truncated,
                max_prompt_len)
    return rows


def build_prompt_sets(data_args: PromptDataArguments, tokenizer: "PreTrainedTokenizerBase", chat_template: ChatTemplate,
                      seed: int) -> PromptSets:
    """The train prompts' ids and the held-out ones' (or None) from rl.ppo_config's PPODataArguments, rendered
    with the run's records.chat_templates.ChatTemplate."""
    files = find_record_files(data_args.dataset_dir, data_args.data_path)
    if not files:
        raise InputError("no prompts: give --dataset_dir or --data_path")
    prompts = read_prompts(files, data_args.data_split, data_args.data_phase, seed)
    eval_prompts = None
    if data_args.validation_file:
        eval_prompts = read_prompts(find_record_files(None, [data_args.validation_file]), None, data_args.data_phase,
                                    seed)
    elif data_args.validation_split_percentage > 0:
        train, held_out = held_out_indices(len(prompts), data_args.validation_split_percentage, seed, "prompts")
        prompts, eval_prompts = [prompts[i] for i in train], [prompts[i] for i in held_out]
    if data_args.max_train_samples is not None:
        prompts = prompts[: data_args.max_train_samples]
    if eval_prompts is not None and data_args.max_eval_samples is not None:
        eval_prompts = eval_prompts[: data_args.max_eval_samples]
    train_ids = tokenize_prompts(prompts, tokenizer, chat_template.text, data_args.max_prompt_seq_len,
                                 "train prompts", chat_template.kwargs)
    eval_ids = None if eval_prompts is None else tokenize_prompts(
        eval_prompts, tokenizer, chat_template.text, data_args.max_prompt_seq_len, "eval prompts", chat_template.kwargs)
    return PromptSets(train_ids, eval_ids, prompts, eval_prompts)
