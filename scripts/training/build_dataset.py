"""Data for every stage: readers that validate each record (file:line:field on bad input),
tokenization, grouping into blocks, a cache keyed on everything that shapes the result, the
collators, and SavePeftModelCallback."""

import hashlib
from bisect import bisect_left, bisect_right
import json
import logging
import os
import shutil
import tempfile
from glob import glob
from itertools import chain
from multiprocessing import get_context
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import torch
from datasets import Dataset, load_from_disk
from datasets.table import InMemoryTable
from jinja2 import TemplateError
from tqdm.auto import tqdm
from transformers import TrainerCallback

from model_utils import PAIR_CHOSEN, PAIR_PADDING, PAIR_PREFIX, PAIR_REJECTED, gathered_trainable
from chat_templates import first_special_token, save_template_kwargs, special_token_texts, turn_end_text
from training_utils import InputError

logger = logging.getLogger(__name__)

# Part of every cache key: bump it whenever a change here changes the blocks produced.
PRETRAINING_CACHE_VERSION = "pt-blocks-1"
TOKENIZE_BATCH_LINES = 1000
PRETRAINING_SUFFIXES = (".txt", ".jsonl")


# ----------------------------------------------------------------------------- readers


def find_pretraining_files(dataset_dir: Optional[str]) -> list:
    """Every *.txt (one document a line) and *.jsonl (field "text") directly in dataset_dir."""
    if not dataset_dir:
        raise InputError("--dataset_dir is required")
    if not os.path.isdir(dataset_dir):
        raise InputError(f"{dataset_dir}: --dataset_dir does not exist or is not a directory")
    files = sorted(path for suffix in PRETRAINING_SUFFIXES for path in glob(os.path.join(dataset_dir, f"*{suffix}")))
    if not files:
        raise InputError(f"{dataset_dir}: no .txt or .jsonl files in --dataset_dir")
    return files


def read_documents(path: str) -> Iterator[str]:
    """Yield the documents of one file, refusing the first bad record with file:line:field."""
    is_jsonl = path.endswith(".jsonl")
    count = 0
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise InputError(
                    f"{path}:{line_number}: not valid UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1})"
                ) from None
            if not line.strip():
                continue
            if is_jsonl:
                text = text_field_of(path, line_number, line)
            else:
                text = line.rstrip("\r\n")
            if text.strip():
                count += 1
                yield text
    if count == 0:
        raise InputError(f"{path}: file holds no documents (empty)")


def text_field_of(path: str, line_number: int, line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise InputError(f"{path}:{line_number}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict) or "text" not in record:
        raise InputError(f"{path}:{line_number}: field 'text' is missing")
    if not isinstance(record["text"], str):
        raise InputError(f"{path}:{line_number}: field 'text' must be a string, not {type(record['text']).__name__}")
    return record["text"]


# ----------------------------------------------------------------------------- cache keys


def file_fingerprint(path: str) -> str:
    """Content hash: a file edited in place (same size, even same mtime) still changes the key."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_fingerprint(tokenizer) -> str:
    """Everything about the tokenizer that changes ids: its full serialized model, added and
    special tokens (the anchor's cache ignored the tokenizer entirely)."""
    digest = hashlib.blake2b(digest_size=16)
    if getattr(tokenizer, "is_fast", False):
        digest.update(tokenizer.backend_tokenizer.to_str().encode("utf-8"))
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode("utf-8"))
    extra = [type(tokenizer).__name__, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id]
    digest.update(json.dumps(extra).encode("utf-8"))
    return digest.hexdigest()


def cache_key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()[:20]


def build_or_load_cached(cache_root: str, name: str, build) -> tuple:
    """Return (dataset, hit). `build(tmp_dir)` writes a dataset into tmp_dir; it is renamed into
    place only when complete, so a reader never sees a half-written cache, and when two
    processes build the same entry at once the loser drops its copy and reads the winner's."""
    final_dir = os.path.join(cache_root, name)
    if os.path.isdir(final_dir):
        return load_from_disk(final_dir), True
    os.makedirs(cache_root, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=cache_root)
    try:
        build(tmp_dir)
        try:
            os.rename(tmp_dir, final_dir)
        except OSError:
            if not os.path.isdir(final_dir):
                raise
            logger.info("another process finished the same cache first; using its copy")
    finally:
        if os.path.isdir(tmp_dir):
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return load_from_disk(final_dir), False


# ----------------------------------------------------------------------------- pretraining


def document_affixes(tokenizer) -> tuple:
    """Ids around each document: the tokenizer's own BOS convention, then EOS between documents."""
    special = tokenizer("", add_special_tokens=True)["input_ids"]
    prefix = [i for i in special if i != tokenizer.eos_token_id]
    if tokenizer.eos_token_id is None:
        raise InputError("the tokenizer has no eos_token: documents could not be separated")
    return prefix, [tokenizer.eos_token_id]


def encode_lines(tokenizer, lines: list) -> list:
    if getattr(tokenizer, "is_fast", False):
        # The Rust tokenizer directly: skips building offsets and BatchEncoding objects we never use.
        return [encoding.ids for encoding in tokenizer.backend_tokenizer.encode_batch_fast(lines, add_special_tokens=False)]
    return tokenizer(lines, add_special_tokens=False)["input_ids"]


def tokenize_documents(tokenizer, documents: list, prefix: list, suffix: list) -> np.ndarray:
    """One flat int32 array: prefix + ids + suffix for each document, in order."""
    parts = []
    for start in range(0, len(documents), TOKENIZE_BATCH_LINES):
        for ids in encode_lines(tokenizer, documents[start : start + TOKENIZE_BATCH_LINES]):
            parts.extend((prefix, ids, suffix))
    # chain.from_iterable runs in C: no per-document list copies before the one array.
    return np.fromiter(chain.from_iterable(parts), dtype=np.int32, count=sum(map(len, parts)))


_WORKER_TOKENIZER = None


def _worker_tokenize(task):
    documents, prefix, suffix = task
    return tokenize_documents(_WORKER_TOKENIZER, documents, prefix, suffix)


def tokenize_all(tokenizer, documents: list, num_proc: int) -> np.ndarray:
    prefix, suffix = document_affixes(tokenizer)
    shard_size = max(TOKENIZE_BATCH_LINES, -(-len(documents) // max(num_proc, 1) // 4))
    shards = [documents[i : i + shard_size] for i in range(0, len(documents), shard_size)]
    progress = tqdm(total=len(documents), desc="Tokenizing", unit="doc", unit_scale=True)
    arrays = []
    if num_proc > 1 and len(shards) > 1:
        global _WORKER_TOKENIZER
        _WORKER_TOKENIZER = tokenizer  # inherited by the forked workers, never pickled
        with get_context("fork").Pool(num_proc) as pool:
            for shard, array in zip(shards, pool.imap(_worker_tokenize, [(s, prefix, suffix) for s in shards])):
                arrays.append(array)
                progress.update(len(shard))
        _WORKER_TOKENIZER = None
    else:
        for shard in shards:
            arrays.append(tokenize_documents(tokenizer, shard, prefix, suffix))
            progress.update(len(shard))
    progress.close()
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32)


def group_into_blocks(flat_ids: np.ndarray, block_size: int, fingerprint: Optional[str] = None) -> Dataset:
    """Cut the token stream into block_size rows (the tail shorter than a block is dropped, as in
    run_clm) with one reshape: no per-example Python lists, no O(n^2) concatenation.

    fingerprint: the cache key, which already identifies the content; without one, datasets
    hashes the whole table with dill (~0.05-0.2 s for 4.5 M tokens, serial)."""
    num_blocks = len(flat_ids) // block_size
    values = pa.array(flat_ids[: num_blocks * block_size], type=pa.int32())
    column = pa.FixedSizeListArray.from_arrays(values, block_size)
    return Dataset(InMemoryTable(pa.table({"input_ids": column})), fingerprint=fingerprint)


def build_pretraining_blocks(
    dataset_dir: str,
    tokenizer,
    block_size: int,
    cache_dir: str,
    num_proc: int = 1,
) -> Dataset:
    """Documents of every file in dataset_dir -> token blocks of block_size, cached.

    The cache key covers each file's content, the tokenizer, the block size and
    PRETRAINING_CACHE_VERSION, so a changed file or tokenizer never reuses stale blocks."""
    files = find_pretraining_files(dataset_dir)
    key = cache_key(
        {
            "version": PRETRAINING_CACHE_VERSION,
            "files": [(os.path.basename(path), file_fingerprint(path)) for path in files],
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "block_size": block_size,
        }
    )

    def build(tmp_dir):
        documents = []
        for path in files:
            documents.extend(read_documents(path))
        flat_ids = tokenize_all(tokenizer, documents, num_proc)
        blocks = group_into_blocks(flat_ids, block_size, fingerprint=key)
        if len(blocks) == 0:
            raise InputError(
                f"{dataset_dir}: {len(flat_ids)} tokens in all is less than one block of --block_size {block_size}"
            )
        logger.info("%d documents, %d tokens -> %d blocks of %d", len(documents), len(flat_ids), len(blocks), block_size)
        blocks.save_to_disk(tmp_dir)

    blocks, hit = build_or_load_cached(cache_dir, f"pt-{key}", build)
    logger.info("pretraining blocks: cache %s (%s, %d blocks)", "hit" if hit else "miss, built", key, len(blocks))
    return blocks


def split_validation(blocks: Dataset, validation_split_percentage: float, seed: int) -> tuple:
    """(train, eval) by a seeded shuffle; a value >= 1 is a percentage, below 1 a fraction (the
    anchor's scripts pass 0.05 under this name)."""
    if validation_split_percentage <= 0:
        return blocks, None
    fraction = validation_split_percentage / 100 if validation_split_percentage >= 1 else validation_split_percentage
    num_eval = max(1, int(round(len(blocks) * fraction)))  # a tiny share of a small set still holds out one block
    if num_eval < 1 or num_eval >= len(blocks):
        raise InputError(
            f"--validation_split_percentage {validation_split_percentage} of {len(blocks)} blocks leaves "
            "no training or no validation block; add data, lower --block_size, or change the percentage"
        )
    # A seeded permutation + select keeps the split's indices in memory: nothing is written next
    # to a cache that other processes may be reading.
    order = np.random.default_rng(seed).permutation(len(blocks))
    return blocks.select(np.sort(order[num_eval:])), blocks.select(np.sort(order[:num_eval]))


def data_cache_dir(requested: Optional[str]) -> str:
    import datasets

    return requested or os.path.join(datasets.config.HF_DATASETS_CACHE, "llama_lora_toolkit")


def first_samples(dataset: Optional[Dataset], limit: Optional[int]) -> Optional[Dataset]:
    """--max_train_samples / --max_eval_samples."""
    if dataset is None or limit is None:
        return dataset
    return dataset.select(range(min(limit, len(dataset))))


class DataCollatorForPretraining:
    """Stack equal-length blocks; labels are the inputs (the model shifts them)."""

    def __call__(self, features: list) -> dict:
        input_ids = torch.tensor([feature["input_ids"] for feature in features], dtype=torch.long)
        return {"input_ids": input_ids, "labels": input_ids.clone()}


# ----------------------------------------------------------------------------- saving


def save_adapter(model, tokenizer, path: str, is_main_process: bool) -> None:
    """Adapter + tokenizer in `path`. Under ZeRO-3 the adapter weights are gathered first
    (every rank must call this), the frozen base is not."""
    with gathered_trainable(model):
        if is_main_process:
            model.save_pretrained(path)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
                save_template_kwargs(tokenizer, path)


class SavePeftModelCallback(TrainerCallback):
    """Write the adapter and tokenizer to checkpoint-N/<name> at every save and to
    output_dir/<name> at the end, as Chinese-LLaMA-Alpaca-2's scripts lay them out."""

    def __init__(self, adapter_dir_name: str):
        self.adapter_dir_name = adapter_dir_name

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        checkpoint_dir = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        save_adapter(model, processing_class, os.path.join(checkpoint_dir, self.adapter_dir_name), args.should_save)

    def on_train_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        save_adapter(model, processing_class, os.path.join(args.output_dir, self.adapter_dir_name), args.should_save)


# ----------------------------------------------------------------------------- supervised data

SFT_CACHE_VERSION = "sft-2"


@dataclass
class ConversationDataArguments:
    """Data arguments of the stages that read conversations (SFT, reward, PPO prompts)."""

    dataset_dir: Optional[str] = field(
        default=None, metadata={"help": "Directory of *.json / *.jsonl files."}
    )
    data_path: Optional[list[str]] = field(
        default=None, metadata={"help": "Data files, each its own dataset (DeepSpeed-Chat style), split by --data_split.", "nargs": "+"}
    )
    data_split: Optional[str] = field(
        default=None, metadata={"help": "Weights of the SFT,reward,PPO parts of each dataset, e.g. 6,2,2."}
    )
    data_phase: int = field(default=1, metadata={"help": "Which part of --data_split this stage takes (1 SFT, 2 reward, 3 PPO)."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Held-out data for eval."})
    validation_split_percentage: float = field(
        default=0.0, metadata={"help": "Without --validation_file: held-out share of samples (fraction if < 1)."}
    )
    template: Optional[str] = field(
        default=None,
        metadata={"help": "llama2, alpaca, chatml or human_assistant; default: the tokenizer's own chat_template."},
    )
    template_kwargs: Optional[str] = field(
        default=None, metadata={"help": "Keyword arguments the chat template is rendered with, as a JSON object "
                                "(e.g. '{\"enable_thinking\": false}'); saved with the adapter for inference."})
    enable_thinking: Optional[bool] = field(
        default=None, metadata={"help": "Passed to templates that take it (Qwen3): false renders the empty "
                                "<think></think> of non-thinking mode in the prompt."})
    max_seq_length: Optional[int] = field(default=None, metadata={"help": "Tokens per sequence (prompt + answer)."})
    data_cache_dir: Optional[str] = field(default=None, metadata={"help": "Where tokenized data is cached."})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Keep at most this many train samples."})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Keep at most this many eval samples."})
SFT_SUFFIXES = (".json", ".jsonl")
# sharegpt's function_call / observation turns are an assistant's tool calls and a tool's result.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "function_call": "assistant",
                  "observation": "tool"}
MESSAGE_ROLES = ("system", "user", "assistant", "tool")


def find_sft_files(dataset_dir: Optional[str], data_paths: Optional[list]) -> list:
    """Every *.json / *.jsonl in dataset_dir, then each --data_path file, each its own dataset."""
    files = []
    if dataset_dir:
        if not os.path.isdir(dataset_dir):
            raise InputError(f"{dataset_dir}: --dataset_dir does not exist or is not a directory")
        found = sorted(p for suffix in SFT_SUFFIXES for p in glob(os.path.join(dataset_dir, f"*{suffix}")))
        if not found:
            raise InputError(f"{dataset_dir}: no .json or .jsonl files in --dataset_dir")
        files += found
    for path in data_paths or []:
        if not os.path.isfile(path):
            raise InputError(f"{path}: data file does not exist")
        if not path.endswith(SFT_SUFFIXES):
            raise InputError(f"{path}: data files must be .json (a list) or .jsonl (one record a line)")
        files.append(path)
    return files


def read_records(path: str) -> Iterator[tuple]:
    """(line number, record) for each record of a .jsonl file or of a .json list."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise InputError(f"{path}:{line}: not valid UTF-8") from None
    if path.endswith(".jsonl"):
        for line_number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    yield line_number, json.loads(line)
                except json.JSONDecodeError as err:
                    raise InputError(f"{path}:{line_number}: not valid JSON ({err.msg} at column {err.colno})") from None
        return
    yield from read_json_list(path, text)


def read_json_list(path: str, text: str) -> Iterator[tuple]:
    """Decode a JSON list element by element, so each record's error names its own line."""
    decoder = json.JSONDecoder()
    position = len(text) - len(text.lstrip())
    if not text.startswith("[", position):
        raise InputError(f"{path}:1: a .json data file must hold a list of records")
    position += 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text):
            raise InputError(f"{path}:{text.count(chr(10)) + 1}: not valid JSON (the list is not closed)")
        if text[position] == "]":
            return
        line_number = text.count("\n", 0, position) + 1
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as err:
            raise InputError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
        yield line_number, record


def string_field(where: str, record: dict, name: str, required: bool = True) -> str:
    if name not in record or record[name] is None:
        if required:
            raise InputError(f"{where}: field '{name}' is missing")
        return ""
    value = record[name]
    if not isinstance(value, str):
        raise InputError(f"{where}: field '{name}' must be a string, not {type(value).__name__}")
    return value


def alpaca_messages(where: str, record: dict) -> list:
    instruction = string_field(where, record, "instruction")
    extra_input = string_field(where, record, "input", required=False)
    output = string_field(where, record, "output")
    messages = []
    system = string_field(where, record, "system", required=False)
    if system:
        messages.append({"role": "system", "content": system})
    history = record.get("history") or []
    if not isinstance(history, list):
        raise InputError(f"{where}: field 'history' must be a list of [question, answer] pairs")
    for index, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise InputError(f"{where}: field 'history[{index}]' must be a [question, answer] pair of strings")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    user = f"{instruction}\n{extra_input}" if extra_input else instruction
    return messages + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]


def turn_list(where: str, record: dict, name: str, role_key: str, content_key: str, roles) -> list:
    turns = record[name]
    if not isinstance(turns, list) or not turns:
        raise InputError(f"{where}: field '{name}' must be a non-empty list of turns")
    messages = []
    for index, turn in enumerate(turns):
        field_name = f"{name}[{index}]"
        if not isinstance(turn, dict):
            raise InputError(f"{where}: field '{field_name}' must be an object")
        role = string_field(where, turn, role_key) if role_key in turn else None
        if role is None:
            raise InputError(f"{where}: field '{field_name}.{role_key}' is missing")
        if role not in roles:
            raise InputError(f"{where}: field '{field_name}.{role_key}' has unknown role '{role}' "
                             f"(expected one of {', '.join(roles)})")
        content = turn.get(content_key)
        if role == "function_call":  # sharegpt: the value is the call as JSON
            message = {"role": "assistant", "content": "",
                       "tool_calls": [tool_call(where, f"{field_name}.{content_key}", parse_json_field(
                           where, f"{field_name}.{content_key}", content))]}
        elif content is None and turn.get("tool_calls"):
            message = {"role": "assistant", "content": ""}
        elif not isinstance(content, str):
            raise InputError(f"{where}: field '{field_name}.{content_key}' is missing or not a string")
        else:
            message = {"role": roles[role] if isinstance(roles, dict) else role, "content": content}
        messages.append(message | message_extras(where, field_name, turn, message["role"]))
    return messages


def parse_json_field(where: str, field_name: str, value):
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise InputError(f"{where}: field '{field_name}': not valid JSON ({err.msg})") from None


def tool_call(where: str, field_name: str, call) -> dict:
    """One tool call as chat templates expect it: {"type": "function", "function": {"name",
    "arguments"}} (also accepted flat: {"name", "arguments"}); "id" kept where given."""
    if not isinstance(call, dict):
        raise InputError(f"{where}: field '{field_name}' must be an object with 'name' and 'arguments'")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise InputError(f"{where}: field '{field_name}': a tool call needs a 'name' string")
    arguments = parse_json_field(where, f"{field_name}.arguments", function.get("arguments", {}))
    normal = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        normal["id"] = call["id"]
    return normal


def message_extras(where: str, field_name: str, turn: dict, role: str) -> dict:
    """The optional keys of a message that templates render: an assistant's reasoning_content and
    tool_calls, a tool result's tool_call_id and name."""
    extras = {}
    if role == "assistant":
        if turn.get("reasoning_content") is not None:
            extras["reasoning_content"] = string_field(where, turn, "reasoning_content")
        if turn.get("tool_calls"):
            calls = turn["tool_calls"]
            if not isinstance(calls, list):
                raise InputError(f"{where}: field '{field_name}.tool_calls' must be a list")
            extras["tool_calls"] = [tool_call(where, f"{field_name}.tool_calls[{i}]", call)
                                    for i, call in enumerate(calls)]
    elif role == "tool":
        for key in ("tool_call_id", "name"):
            if turn.get(key) is not None:
                extras[key] = string_field(where, turn, key)
    return extras


def tools_of(where: str, record) -> Optional[list]:
    """A record's "tools" (function schemas the template lists for the model), as a list."""
    tools = parse_json_field(where, "tools", record.get("tools")) if isinstance(record, dict) else None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InputError(f"{where}: field 'tools' must be a list of function schemas")
    return tools or None


def conversation_of(where: str, record) -> list:
    """Normalise one record of any supported format to chat messages, validated."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: a record must be a JSON object")
    if "conversations" in record:
        messages = turn_list(where, record, "conversations", "from", "value", SHAREGPT_ROLES)
        name = "conversations"
    elif "messages" in record:
        messages = turn_list(where, record, "messages", "role", "content", MESSAGE_ROLES)
        name = "messages"
    elif "instruction" in record or "output" in record:
        return validate_conversation(where, alpaca_messages(where, record), None)
    else:
        raise InputError(f"{where}: no 'instruction'/'output', 'conversations' or 'messages' field")
    return validate_conversation(where, messages, name)


# Which roles may follow each role (None: the first turn after an optional system prompt).
FOLLOWS = {None: ("user",), "user": ("assistant",), "assistant": ("user", "tool"), "tool": ("tool", "assistant")}


def validate_conversation(where: str, messages: list, field_name: Optional[str]) -> list:
    """System first (optional), then user and assistant alternating (an assistant's tool calls
    followed by tool results, then the assistant again), ending with a non-empty answer."""

    def at(index):
        return f"field '{field_name}[{index}]'" if field_name else "the conversation"

    start = 1 if messages and messages[0]["role"] == "system" else 0
    previous = None
    for index in range(start, len(messages)):
        message, role = messages[index], messages[index]["role"]
        if role == "system":
            raise InputError(f"{where}: {at(index)}: a system turn may only come first")
        allowed = FOLLOWS[previous]
        if role == "tool" and previous == "assistant" and not messages[index - 1].get("tool_calls"):
            allowed = ("user",)
        if role not in allowed:
            after = f"a {previous} turn" if previous else "the start (after an optional system turn)"
            what = f"two consecutive {role} turns" if role == previous else f"the {role} turn cannot follow {after}"
            raise InputError(f"{where}: {at(index)}: {what}")
        if role == "assistant" and not message["content"].strip() and not message.get("tool_calls"):
            raise InputError(f"{where}: {at(index)}: empty answer")
        previous = role
    if len(messages) == start:
        raise InputError(f"{where}: the conversation has no user turn")
    if messages[-1]["role"] != "assistant":
        raise InputError(f"{where}: {at(len(messages) - 1)}: the conversation ends on a {messages[-1]['role']} "
                         "turn (no answer to train on)")
    return messages


def read_conversations(path: str) -> list:
    """[(where, messages, tools)] of every record of a file, where = "path:line"."""
    conversations = []
    for line, record in read_records(path):
        where = f"{path}:{line}"
        conversations.append((where, conversation_of(where, record), tools_of(where, record)))
    if not conversations:
        raise InputError(f"{path}: file holds no records (empty)")
    return conversations


def parse_data_split(data_split: str) -> list:
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


class ConversationTokenizer:
    """Token ids and labels of a conversation rendered by a chat template, for any template.

    The whole conversation is rendered once with the model's own template (as transformers would
    render it); each assistant message is then found in that text by character offsets and its
    span is trained: from where the model starts writing (after the template's generation
    prompt) through the content, reasoning and tool calls the template renders, up to and
    including the turn-end token (`turn_end_text`). System, user and tool text is never
    trained. Where the render starts with `apply_chat_template(messages[:k],
    add_generation_prompt=True)`, the answer's prompt is exactly the inference prompt; templates
    that render earlier turns differently (Qwen3 drops reasoning before the last user turn,
    Mistral moves the system prompt into the last user turn) are handled by finding the
    template's generation header before the answer instead of requiring growing prefixes.

    keep_turn_end keeps what the template renders after the last answer's turn end (ChatML's
    "\n"): a reward model reads its score at the last token, at the end of the whole turn, as
    transformers' and TRL's reward models read it. turn_end_ids() is what that adds, and what PPO
    appends to a generated answer before scoring it."""

    def __init__(self, tokenizer, template: str, max_length: int, train_on_last_turn_only: bool = False,
                 keep_turn_end: bool = False, template_kwargs: Optional[dict] = None):
        self.tokenizer = tokenizer
        self.template = template
        self.max_length = max_length
        self.last_turn_only = train_on_last_turn_only
        self.keep_turn_end = keep_turn_end
        self.template_kwargs = dict(template_kwargs or {})
        if tokenizer.eos_token is None:
            raise InputError("the tokenizer has no eos_token: answers could not end")
        self.turn_end, self.turn_end_is_special = turn_end_text(tokenizer, template, self.template_kwargs)
        self.notes = {}  # what the template does differently from inference, counted once per build

    def render(self, messages: list, add_generation_prompt: bool, tools: Optional[list] = None,
               where: str = "a conversation") -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, tokenize=False, add_generation_prompt=add_generation_prompt,
                tools=tools, **self.template_kwargs,
            )
        except TemplateError as err:  # the template's own raise_exception (roles it does not support, ...)
            raise InputError(f"{where}: the chat template refuses this conversation ({err})") from None

    def segments(self, where: str, messages: list, tools: Optional[list] = None) -> list:
        """[(text, trained, add_eos)] covering the conversation up to its last answer's turn end
        (with keep_turn_end, up to the end of the render)."""
        whole = self.render(messages, add_generation_prompt=False, tools=tools, where=where)
        answers = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        spans = self.answer_spans(where, whole, messages, answers, tools)
        prompt = self.render(messages[:answers[-1]], add_generation_prompt=True, tools=tools, where=where)
        text = whole
        if not whole.startswith(prompt):
            text, spans = self.on_inference_prompt(where, whole, prompt, spans, messages, answers, tools)
        start, end, add_eos = spans[-1]
        if self.keep_turn_end and not add_eos:  # an appended EOS ends the row itself: nothing follows it
            spans[-1] = (start, len(text), add_eos)
        segments, position = [], 0
        for turn, (start, end, add_eos) in enumerate(spans):
            trained = not self.last_turn_only or turn == len(spans) - 1
            segments += [(text[position:start], False, False), (text[start:end], trained, add_eos)]
            position = end
        return segments

    def answer_spans(self, where: str, text: str, messages: list, answers: list, tools) -> list:
        spans, position = [], 0
        for index in answers:
            spans.append(self.answer_span(where, text, position, messages, index, tools))
            position = spans[-1][1]
        return spans

    def on_inference_prompt(self, where, whole, prompt, spans, messages, answers, tools) -> tuple:
        """The template renders the last answer's prompt differently in a finished conversation than
        as the inference prompt (Mistral-Nemo drops the system prompt unless the last turn is the
        user's; the DeepSeek-R1 distills' generation prompt opens a think block): train on the
        inference prompt itself, followed by the last answer as the conversation renders it, so
        the model learns to answer the prompt it will be given. (text, spans)."""
        last = answers[-1]
        if messages[last].get("reasoning_content"):
            raise InputError(f"{where}: turn {last} (assistant): field 'reasoning_content': the template's "
                             "generation prompt leaves no reasoning for the model to write (is enable_thinking false?)")
        self.note("prompt", f"the chat template renders a finished conversation's last prompt as "
                            f"{whole[max(0, spans[-1][0] - 40):spans[-1][0]]!r} but the inference prompt as "
                            f"{prompt[-40:]!r}: answers are trained after the inference prompt")
        start, end, add_eos = spans[-1]
        tail = whole[end:] if self.keep_turn_end and not add_eos else ""
        text = prompt + whole[start:end] + tail
        earlier = self.answer_spans(where, prompt, messages[:last], answers[:-1], tools)
        return text, earlier + [(len(prompt), len(prompt) + end - start, add_eos)]

    def answer_span(self, where: str, text: str, position: int, messages: list, index: int, tools) -> tuple:
        """(start, end, add_eos) of assistant message `index` in the rendered text, at or after
        `position` (the end of the previous answer)."""
        message = messages[index]
        prompt = self.render(messages[:index], add_generation_prompt=True, tools=tools)
        if len(prompt) >= position and text.startswith(prompt):
            start = len(prompt)
        else:
            start = self.header_end(text, position, messages, index, tools)
        where_turn = f"{where}: turn {index} (assistant)"
        anchor = self.find_body(where_turn, text, start, message, last=index == len(messages) - 1)
        end = text.find(self.turn_end, anchor)
        if end < 0:
            raise InputError(f"{where_turn}: the chat template does not close this answer with {self.turn_end!r}")
        # A plain-text turn end gets EOS appended, so the model still learns to stop.
        return start, end + len(self.turn_end), not self.turn_end_is_special

    def header_end(self, text: str, position: int, messages: list, index: int, tools) -> int:
        """Where the assistant starts writing when the render is not a growing prefix: after the
        longest head of the template's generation header (what add_generation_prompt adds) found
        between the turns before the answer and the answer's own first text; at that text if the
        header is not there (a template whose generation prompt adds nothing, like Mistral's)."""
        with_header = self.render(messages[:index], add_generation_prompt=True, tools=tools)
        without = self.render(messages[:index], add_generation_prompt=False, tools=tools)
        header = with_header[len(os.path.commonprefix([with_header, without])):]
        cursor = position
        for previous in messages[index - 1::-1]:
            if previous["role"] in ("assistant", "system"):
                break
            found = text.find(previous["content"], cursor) if previous["content"] else -1
            cursor = found + len(previous["content"]) if found >= 0 else cursor
        message = messages[index]
        pieces = [message.get("reasoning_content") or "", message["content"], message["content"].strip()]
        pieces += [call["function"]["name"] for call in message.get("tool_calls") or []]
        found = [text.find(piece.strip(), cursor) for piece in pieces if piece.strip()]
        body = min((at for at in found if at >= 0), default=len(text))
        for size in range(len(header), 0, -1):
            at = text.rfind(header[:size], cursor, body)
            if at >= 0:
                return at + size
        return body

    def find_body(self, where_turn: str, text: str, start: int, message: dict, last: bool) -> int:
        """The end of what the answer itself renders (reasoning, content, tool calls) after start."""
        anchor = start
        reasoning = (message.get("reasoning_content") or "").strip()
        content = message["content"]
        content_at = -1
        for candidate in (content, content.strip()):
            if candidate and content_at < 0:
                content_at, found = text.find(candidate, start), candidate
        if content.strip() and content_at < 0:
            raise InputError(f"{where_turn}: the chat template does not render this answer's content verbatim; "
                             "choose a --template")
        if content_at >= 0:
            anchor = content_at + len(found)
        if reasoning:
            reasoning_at = text.find(reasoning, start)
            if not 0 <= reasoning_at < (content_at if content_at >= 0 else len(text)):
                if last:
                    raise InputError(f"{where_turn}: field 'reasoning_content': the chat template does not render "
                                     "reasoning; put it in the content or choose a template that renders it")
                self.note("reasoning", "the chat template drops reasoning_content of answers before the last user "
                                       "turn (as Qwen3's does): those answers are trained without it")
        for call in message.get("tool_calls") or []:
            name = call["function"]["name"]
            found_at = text.find(name, anchor)
            if found_at < 0:
                raise InputError(f"{where_turn}: field 'tool_calls': the chat template does not render tool call "
                                 f"'{name}'; choose a template that supports tools")
            anchor = found_at + len(name)
        return anchor

    def note(self, kind: str, message: str) -> None:
        """Count a by-design difference between training and inference renders; logged once."""
        if kind not in self.notes:
            logger.warning("%s", message)
        self.notes[kind] = self.notes.get(kind, 0) + 1

    def __call__(self, where: str, messages: list, tools: Optional[list] = None) -> Optional[dict]:
        segments = self.segments(where, messages, tools)
        if getattr(self.tokenizer, "is_fast", False):
            input_ids, labels = self.tokenize_whole(segments)
        else:
            input_ids, labels = self.tokenize_by_segment(segments)
        # Keep the prompt's head and cut the answer; a sample left without an answer token is dropped.
        input_ids, labels = input_ids[: self.max_length], labels[: self.max_length]
        if all(label == -100 for label in labels):
            return None
        return {"input_ids": input_ids, "labels": labels}

    def answer_end_id(self) -> int:
        """The id of the token that ends an answer: the template's turn-end token, else EOS."""
        token = first_special_token(self.turn_end, special_token_texts(self.tokenizer)) if self.turn_end_is_special \
            else None
        return self.tokenizer.convert_tokens_to_ids(token) if token else self.tokenizer.eos_token_id

    def turn_end_ids(self) -> list:
        """The ids the template puts after an answer's EOS to close its turn (empty for templates
        that end a turn at EOS): what a row of keep_turn_end adds to one without it."""
        probe = [{"role": "user", "content": "1 + 1 ="}, {"role": "assistant", "content": "2"}]
        with_end = ConversationTokenizer(self.tokenizer, self.template, 1 << 30, keep_turn_end=True,
                                         template_kwargs=self.template_kwargs)
        at_eos = ConversationTokenizer(self.tokenizer, self.template, 1 << 30, template_kwargs=self.template_kwargs)
        whole, short = with_end("turn end probe", probe)["input_ids"], at_eos("turn end probe", probe)["input_ids"]
        if whole[: len(short)] != short:
            raise InputError("the chat template's turn end changes how the answer before it is tokenized; "
                             "choose a --template")
        return whole[len(short):]

    def tokenize_whole(self, segments: list) -> tuple:
        """Tokenize the rendered conversation as one string (as inference encodes a prompt: no
        tokenizer-added prefix in front of each segment) and label tokens by character offsets."""
        text = "".join(segment[0] for segment in segments)
        starts, position = [], 0
        for segment in segments:
            starts.append(position)
            position += len(segment[0])
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        input_ids, labels = [], []
        pending_eos = None  # a segment needing an extra EOS, emitted before the first token past it
        for token, (start, _) in zip(encoding["input_ids"], encoding["offset_mapping"]):
            index = bisect_right(starts, start) - 1
            if pending_eos is not None and pending_eos != index:
                self.append_eos(input_ids, labels, segments[pending_eos][1])
                pending_eos = None
            input_ids.append(token)
            labels.append(token if segments[index][1] else -100)
            if segments[index][2]:
                pending_eos = index
        if pending_eos is not None:
            self.append_eos(input_ids, labels, segments[pending_eos][1])
        return input_ids, labels

    def append_eos(self, input_ids: list, labels: list, trained: bool) -> None:
        input_ids.append(self.tokenizer.eos_token_id)
        labels.append(self.tokenizer.eos_token_id if trained else -100)

    def tokenize_by_segment(self, segments: list) -> tuple:
        """Slow tokenizers have no offsets: tokenize segment by segment."""
        input_ids, labels = [], []
        for text, trained, add_eos in segments:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            ids += [self.tokenizer.eos_token_id] if add_eos else []
            input_ids += ids
            labels += ids if trained else [-100] * len(ids)
        return input_ids, labels


def tokenize_conversations(conversation_tokenizer, sources: list, desc: str) -> tuple:
    """sources: [(where, messages, tools)] -> (rows, dropped)."""
    rows, dropped = {"input_ids": [], "labels": [], "length": []}, 0
    for where, messages, tools in tqdm(sources, desc=desc, unit="sample"):
        sample = conversation_tokenizer(where, messages, tools)
        if sample is None:
            dropped += 1
            continue
        rows["input_ids"].append(sample["input_ids"])
        rows["labels"].append(sample["labels"])
        rows["length"].append(len(sample["input_ids"]))
    return rows, dropped


def build_sft_dataset(
    files: list,
    tokenizer,
    template: str,
    max_length: int,
    cache_dir: str,
    train_on_last_turn_only: bool = False,
    data_split: Optional[str] = None,
    data_phase: int = 1,
    seed: int = 42,
    unsplit_files: tuple = (),
    template_kwargs: Optional[dict] = None,
) -> Dataset:
    """Conversations of every file -> tokenized, masked samples, cached. With data_split, each
    file except those in unsplit_files (--sft_only_data_path) contributes only its data_phase part."""
    key = cache_key(
        {
            "version": SFT_CACHE_VERSION,
            "files": [(os.path.abspath(p), file_fingerprint(p), p in unsplit_files) for p in files],
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "template": template,
            "template_kwargs": template_kwargs or {},
            "max_length": max_length,
            "last_turn_only": train_on_last_turn_only,
            "split": [data_split, data_phase, seed],
        }
    )
    conversation_tokenizer = ConversationTokenizer(tokenizer, template, max_length, train_on_last_turn_only,
                                                   template_kwargs=template_kwargs)

    def build(tmp_dir):
        sources = []
        for path in files:
            conversations = read_conversations(path)
            indices = range(len(conversations))
            if data_split and path not in unsplit_files:
                indices = phase_indices(len(conversations), data_split, data_phase, seed)
            sources += [conversations[i] for i in indices]
        rows, dropped = tokenize_conversations(conversation_tokenizer, sources, "Tokenizing conversations")
        if dropped:
            logger.warning("dropped %d of %d samples: no answer token fits in --max_seq_length %d",
                           dropped, len(sources), max_length)
        if not rows["input_ids"]:
            raise InputError(f"no trainable sample left in {', '.join(files)} (all dropped by --max_seq_length {max_length})")
        Dataset.from_dict(rows).save_to_disk(tmp_dir)

    dataset, hit = build_or_load_cached(cache_dir, f"sft-{key}", build)
    logger.info("supervised samples: cache %s (%s, %d samples)", "hit" if hit else "miss, built", key, len(dataset))
    return dataset


def pack_samples(dataset: Dataset, max_length: int) -> Dataset:
    """Pack samples into rows of at most max_length tokens (first fit, longest first), each
    sample keeping its own position_ids from 0 so attention never crosses samples. Rows stay
    bounded by max_length: one row per batch would make sdpa attention cost O(row^2)."""
    lengths = np.asarray(dataset["length"])
    bins = []
    # Best fit, longest first: rooms[k] is the free space of bin room_bins[k], kept sorted.
    rooms, room_bins = [], []
    for index in np.argsort(-lengths, kind="stable"):
        size = int(lengths[index])
        k = bisect_left(rooms, size)
        if k == len(rooms):
            bins.append([])
            slot, room = len(bins) - 1, max_length
        else:
            slot, room = room_bins.pop(k), rooms.pop(k)
        bins[slot].append(int(index))
        k = bisect_left(rooms, room - size)
        rooms.insert(k, room - size)
        room_bins.insert(k, slot)
    input_ids, labels = dataset["input_ids"], dataset["labels"]
    rows = {"input_ids": [], "labels": [], "position_ids": [], "length": []}
    for members in bins:
        rows["input_ids"].append([t for i in members for t in input_ids[i]])
        rows["labels"].append([t for i in members for t in labels[i]])
        rows["position_ids"].append([p for i in members for p in range(len(input_ids[i]))])
        rows["length"].append(len(rows["input_ids"][-1]))
    logger.info("packed %d samples into %d rows of at most %d tokens (%.1f%% of row capacity used)",
                len(dataset), len(bins), max_length, 100.0 * lengths.sum() / max(len(bins) * max_length, 1))
    return Dataset.from_dict(rows)


class DataCollatorForSupervisedDataset:
    """Right-pad to the longest row (rounded up to pad_to_multiple_of: 8 on a GPU): labels -100 on padding. Masks come from
    the lengths, never from comparing ids with the pad id (the pad id may be EOS, which answers
    end with). Packed rows carry position_ids and no attention mask: padding becomes one more
    segment with positions from 0, which attends only to itself and has no labels."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 8):
        self.pad_token_id = pad_token_id
        self.multiple = pad_to_multiple_of

    def __call__(self, features: list) -> dict:
        longest = max(len(f["input_ids"]) for f in features)
        width = -(-longest // self.multiple) * self.multiple
        packed = "position_ids" in features[0]
        batch = {"input_ids": [], "labels": [], ("position_ids" if packed else "attention_mask"): []}
        for feature in features:
            pad = width - len(feature["input_ids"])
            batch["input_ids"].append(list(feature["input_ids"]) + [self.pad_token_id] * pad)
            batch["labels"].append(list(feature["labels"]) + [-100] * pad)
            if packed:
                batch["position_ids"].append(list(feature["position_ids"]) + list(range(pad)))
            else:
                batch["attention_mask"].append([1] * len(feature["input_ids"]) + [0] * pad)
        return {name: torch.tensor(values, dtype=torch.long) for name, values in batch.items()}


# ----------------------------------------------------------------------------- preference pairs

PREFERENCE_CACHE_VERSION = "pairs-3"


def preference_of(where: str, record) -> tuple:
    """(context messages ending on a user turn, chosen answer, rejected answer, margin) from
    {"prompt", "chosen", "rejected", "system"?, "history"?, "margin"?} or
    {"chosen": [messages], "rejected": [messages]} sharing every turn but the last answer."""
    if not isinstance(record, dict):
        raise InputError(f"{where}: a record must be a JSON object")
    for name in ("chosen", "rejected"):
        if name not in record:
            raise InputError(f"{where}: field '{name}' is missing")
    margin = record.get("margin", 0.0)
    if not isinstance(margin, (int, float)) or isinstance(margin, bool):
        raise InputError(f"{where}: field 'margin' must be a number")
    if isinstance(record["chosen"], list):
        return conversation_pair(where, record) + (float(margin),)
    prompt = string_field(where, record, "prompt")
    chosen, rejected = string_field(where, record, "chosen"), string_field(where, record, "rejected")
    template_record = {"instruction": prompt, "output": chosen or "-", "system": record.get("system"),
                       "history": record.get("history")}
    context = alpaca_messages(where, template_record)[:-1]
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if not answer.strip():
            raise InputError(f"{where}: field '{name}': empty answer")
    return context, chosen, rejected, float(margin)


def conversation_pair(where: str, record: dict) -> tuple:
    chosen = validate_conversation(where, turn_list(where, record, "chosen", "role", "content", MESSAGE_ROLES), "chosen")
    rejected = validate_conversation(where, turn_list(where, record, "rejected", "role", "content", MESSAGE_ROLES), "rejected")
    if len(chosen) != len(rejected) or chosen[:-1] != rejected[:-1]:
        raise InputError(f"{where}: fields 'chosen' and 'rejected' must share every turn but the last answer")
    return chosen[:-1], chosen[-1]["content"], rejected[-1]["content"]


def build_preference_dataset(
    files: list,
    tokenizer,
    template: str,
    max_length: int,
    cache_dir: str,
    data_split: Optional[str] = None,
    data_phase: int = 2,
    seed: int = 42,
    template_kwargs: Optional[dict] = None,
) -> Dataset:
    """Pairs of every file -> chosen/rejected token ids (each the whole conversation up to the
    end of its answer's turn: the score is read there), cached. A pair whose prompt alone fills max_length is refused: it cannot be
    scored on its answers."""
    key = cache_key(
        {
            "version": PREFERENCE_CACHE_VERSION,
            "files": [(os.path.abspath(p), file_fingerprint(p)) for p in files],
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "template": template,
            "template_kwargs": template_kwargs or {},
            "max_length": max_length,
            "split": [data_split, data_phase, seed],
        }
    )
    conversation_tokenizer = ConversationTokenizer(tokenizer, template, max_length, keep_turn_end=True,
                                                   template_kwargs=template_kwargs)

    def build(tmp_dir):
        rows, identical = {"chosen_input_ids": [], "rejected_input_ids": [], "margin": [], "length": []}, 0
        for path in files:
            records = list(read_records(path))
            if not records:
                raise InputError(f"{path}: file holds no records (empty)")
            indices = phase_indices(len(records), data_split, data_phase, seed) if data_split else range(len(records))
            for index in tqdm(indices, desc=f"Tokenizing pairs of {os.path.basename(path)}", unit="pair"):
                line, record = records[index]
                where = f"{path}:{line}"
                context, chosen, rejected, margin = preference_of(where, record)
                if chosen.strip() == rejected.strip():
                    identical += 1
                    continue
                pair = []
                for answer in (chosen, rejected):
                    sample = conversation_tokenizer(where, context + [{"role": "assistant", "content": answer}])
                    if sample is None:
                        raise InputError(f"{where}: the prompt alone fills --max_seq_length {max_length}; "
                                         "raise it or shorten the prompt")
                    pair.append(sample["input_ids"])
                rows["chosen_input_ids"].append(pair[0])
                rows["rejected_input_ids"].append(pair[1])
                rows["margin"].append(margin)
                rows["length"].append(max(len(pair[0]), len(pair[1])))
        if identical:
            logger.warning("dropped %d pairs whose chosen and rejected answers are identical", identical)
        if not rows["margin"]:
            raise InputError(f"no preference pair left in {', '.join(files)}")
        Dataset.from_dict(rows).save_to_disk(tmp_dir)

    dataset, hit = build_or_load_cached(cache_dir, f"pairs-{key}", build)
    logger.info("preference pairs: cache %s (%s, %d pairs)", "hit" if hit else "miss, built", key, len(dataset))
    return dataset


class DataCollatorForPreferencePairs:
    """The chosen and the rejected sequence of each pair padded together into one batch of 2B
    (chosen first, then rejected), so one forward scores both. Right padding with an attention
    mask from the lengths; the score is read at each row's last attended token.

    share_prefix: one row per pair instead, the tokens both sequences share (the system prompt,
    the question, the template) once, then the chosen answer, then the rejected answer, with
    their own position ids and pair_segments, from which the model builds the mask that keeps
    the rejected answer from seeing the chosen one (model_utils.pair_attention_mask). The same
    scores from a fifth to a half fewer tokens, the longer the shared prompt the more."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 8, share_prefix: bool = False):
        self.pad_token_id = pad_token_id
        self.multiple = pad_to_multiple_of
        self.share_prefix = share_prefix

    def padded_width(self, longest: int) -> int:
        return -(-longest // self.multiple) * self.multiple

    def __call__(self, features: list) -> dict:
        margin = torch.tensor([float(f.get("margin", 0.0)) for f in features], dtype=torch.float32)
        if self.share_prefix:
            return {**self.shared_prefix_rows(features), "margin": margin}
        sequences = [f["chosen_input_ids"] for f in features] + [f["rejected_input_ids"] for f in features]
        width = self.padded_width(max(len(s) for s in sequences))
        input_ids = [list(s) + [self.pad_token_id] * (width - len(s)) for s in sequences]
        attention_mask = [[1] * len(s) + [0] * (width - len(s)) for s in sequences]
        return {
            "input_ids": torch.tensor(input_ids, dtype=torch.long),
            "attention_mask": torch.tensor(attention_mask, dtype=torch.long),
            "margin": margin,
        }

    def shared_prefix_rows(self, features: list) -> dict:
        rows = []
        for feature in features:
            chosen, rejected = list(feature["chosen_input_ids"]), list(feature["rejected_input_ids"])
            shared = 0
            # Each answer keeps at least its last token: that is where its score is read.
            while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
                shared += 1
            ids = chosen + rejected[shared:]
            positions = list(range(len(chosen))) + list(range(shared, len(rejected)))
            segments = [PAIR_PREFIX] * shared + [PAIR_CHOSEN] * (len(chosen) - shared) + [PAIR_REJECTED] * (len(rejected) - shared)
            rows.append((ids, positions, segments))
        width = self.padded_width(max(len(ids) for ids, _, _ in rows))
        batch = {"input_ids": [], "position_ids": [], "pair_segments": []}
        for ids, positions, segments in rows:
            pad = width - len(ids)
            batch["input_ids"].append(ids + [self.pad_token_id] * pad)
            batch["position_ids"].append(positions + [0] * pad)
            batch["pair_segments"].append(segments + [PAIR_PADDING] * pad)
        return {name: torch.tensor(values, dtype=torch.long) for name, values in batch.items()}
