"""Data for every stage: readers that validate each record (file:line:field on bad input),
tokenization, grouping into blocks, a cache keyed on everything that shapes the result, the
collators, and SavePeftModelCallback."""

import hashlib
import json
import logging
import os
import shutil
import tempfile
from glob import glob
from itertools import chain
from multiprocessing import get_context
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import torch
from datasets import Dataset, load_from_disk
from datasets.table import InMemoryTable
from tqdm.auto import tqdm
from transformers import TrainerCallback

from model_utils import gathered_trainable
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


def group_into_blocks(flat_ids: np.ndarray, block_size: int) -> Dataset:
    """Cut the token stream into block_size rows (the tail shorter than a block is dropped, as in
    run_clm) with one reshape: no per-example Python lists, no O(n^2) concatenation."""
    num_blocks = len(flat_ids) // block_size
    values = pa.array(flat_ids[: num_blocks * block_size], type=pa.int32())
    column = pa.FixedSizeListArray.from_arrays(values, block_size)
    return Dataset(InMemoryTable(pa.table({"input_ids": column})))


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
        blocks = group_into_blocks(flat_ids, block_size)
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
