"""The cache of tokenized data: a key that hashes everything shaping the result (the inputs'
fingerprints, the tokenizer, the template, lengths, a code version), built once on the main
process into a temporary directory, then renamed into place (atomic: a crash never leaves a
half-written entry that a later run would load). The inputs' fingerprints are memoized in the
cache root by each file's stat signature (FingerprintMemo), so a warm start stats the corpus
instead of reading it on every rank (the memo itself lives in lorakit.core.fingerprints, which
the pipeline's stage hashes share)."""

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from datasets import Dataset, load_from_disk

from lorakit.core.atomic import sync_path, sync_tree
from lorakit.core.fingerprints import (  # noqa: F401 (offered here too: the data layer's callers and tests use them)
    FINGERPRINT_MEMO_NAME,
    RACY_SECONDS,
    FingerprintMemo,
    file_fingerprint,
    read_fingerprint_memo,
    stat_signature,
)
from lorakit.data.run_record import note_data

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# A cache entry's check (build_or_load_cached): raises on a dataset the run cannot use (too small to hold out a share).
DatasetCheck = Callable[[Dataset], object]


def tokenizer_fingerprint(tokenizer: "PreTrainedTokenizerBase") -> str:
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


def cache_key(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()[:20]


class CacheEntry(NamedTuple):
    """A cache entry this process used: its directory, and whether this process built it (else found it ready)."""

    path: str
    built: bool


# The entries this process built or loaded, in order: what --prepare_data_only reports.
entries_used: list[CacheEntry] = []


class CachedDataset(NamedTuple):
    """A data cache entry's dataset, and whether the entry was there already (a hit) or built now."""

    dataset: Dataset
    hit: bool


def build_or_load_cached(cache_root: str, name: str, build: Callable[[str], object],
                         check: DatasetCheck | None = None, memo: FingerprintMemo | None = None,
                         record: bool = True) -> CachedDataset:
    """The entry's dataset, and whether it was a hit. `build(tmp_dir)` writes a dataset into tmp_dir; it is renamed into
    place only when complete, so a reader never sees a half-written cache, and when two
    processes build the same entry at once the loser drops its copy and reads the winner's. A
    build that fails (bad input found while tokenizing), or a dataset `check(dataset)` refuses
    (too few samples for the run's held-out share), leaves the cache as it was: no entry, and
    not even the directories made for it. The entry's name is the run's record of its data
    (data.run_record.note_data): a resumed run refuses one its checkpoint was not trained on,
    before reading or building it (record=False: an entry derived from recorded ones and the run's identity,
    such as packed rows). memo: the fingerprints of the files in the key, kept in the entry."""
    if record:
        note_data(name)
    final_dir = os.path.join(cache_root, name)
    if os.path.isdir(final_dir):
        dataset = load_from_disk(final_dir)
        if check is not None:
            check(dataset)
        return used_entry(final_dir, dataset, True, memo)
    made = missing_directories(cache_root)
    os.makedirs(cache_root, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=cache_root)
    try:
        build_into_place(build, tmp_dir, final_dir, check, memo)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        remove_if_empty(made)
        raise
    finally:
        if os.path.isdir(tmp_dir):
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return used_entry(final_dir, load_from_disk(final_dir), False, memo)


def build_into_place(build: Callable[[str], object], tmp_dir: str, final_dir: str, check: DatasetCheck | None,
                     memo: FingerprintMemo | None) -> None:
    """Build the entry in tmp_dir, check it, then rename it to final_dir: whole or not at all; a process that loses
    the race to the same entry keeps the winner's."""
    build(tmp_dir)
    if check is not None:
        check(load_from_disk(tmp_dir))
    if memo is not None:
        memo.save_into(tmp_dir)
    sync_tree(tmp_dir)  # a power loss after the rename leaves a whole entry, never torn files under its name
    try:
        os.rename(tmp_dir, final_dir)
    except OSError:
        if not os.path.isdir(final_dir):
            raise
        logger.info("another process finished the same cache first; using its copy")
    sync_path(os.path.dirname(final_dir))


def used_entry(path: str, dataset: Dataset, hit: bool, memo: FingerprintMemo | None) -> CachedDataset:
    if memo is not None:
        memo.save_into(path)  # on a hit, files hashed again (racy when the entry was built) are memoized now
    entries_used.append(CacheEntry(path, not hit))
    return CachedDataset(dataset, hit)


def report_prepared_data() -> None:
    """--prepare_data_only's result, on stdout: each cache entry the training launch will read, and whether it was
    built now or found there; a launch with the same data arguments then reports cache hits."""
    for path, built in entries_used:
        print(f"data cache entry {path}: {'built' if built else 'already there'}", flush=True)
    if not entries_used:
        print("no data cache entry: this stage's data is tokenized at each launch", flush=True)


def missing_directories(path: str) -> list[str]:
    """path and those of its parents that do not exist, deepest first: what os.makedirs(path) creates
    (for "out/run/../cache", out/run too, which the kernel needs to resolve the "..")."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def remove_if_empty(directories: list[str]) -> None:
    """Remove those of directories (deepest first) that are empty; another process building into one
    keeps it."""
    for directory in directories:
        if os.path.basename(directory) in (os.curdir, os.pardir):
            continue  # "x/.." names x's parent, listed under its own name if it was made
        try:
            os.rmdir(directory)
        except OSError:
            pass


def data_cache_dir(requested: str | None) -> str:
    import datasets

    return requested or os.path.join(datasets.config.HF_DATASETS_CACHE, "llama_lora_toolkit")
