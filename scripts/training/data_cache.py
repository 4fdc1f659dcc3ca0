"""The cache of tokenized data: a key that hashes everything shaping the result (the inputs'
fingerprints, the tokenizer, the template, lengths, a code version), built once on the main
process into a temporary directory, then renamed into place (atomic: a crash never leaves a
half-written entry that a later run would load)."""

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Optional

from datasets import load_from_disk

from checkpoint_state import note_data

logger = logging.getLogger(__name__)


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


def build_or_load_cached(cache_root: str, name: str, build, check=None) -> tuple:
    """Return (dataset, hit). `build(tmp_dir)` writes a dataset into tmp_dir; it is renamed into
    place only when complete, so a reader never sees a half-written cache, and when two
    processes build the same entry at once the loser drops its copy and reads the winner's. A
    build that fails (bad input found while tokenizing), or a dataset `check(dataset)` refuses
    (too few samples for the run's held-out share), leaves the cache as it was: no entry, and
    not even the directories made for it. The entry's name is the run's record of its data
    (checkpoint_state.note_data): a resumed run refuses one its checkpoint was not trained on,
    before reading or building it."""
    note_data(name)
    final_dir = os.path.join(cache_root, name)
    if os.path.isdir(final_dir):
        dataset = load_from_disk(final_dir)
        if check is not None:
            check(dataset)
        return dataset, True
    made = missing_directories(cache_root)
    os.makedirs(cache_root, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=cache_root)
    try:
        build(tmp_dir)
        if check is not None:
            check(load_from_disk(tmp_dir))
        try:
            os.rename(tmp_dir, final_dir)
        except OSError:
            if not os.path.isdir(final_dir):
                raise
            logger.info("another process finished the same cache first; using its copy")
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        remove_if_empty(made)
        raise
    finally:
        if os.path.isdir(tmp_dir):
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return load_from_disk(final_dir), False


def missing_directories(path: str) -> list:
    """path and those of its parents that do not exist, deepest first: what os.makedirs(path) creates
    (for "out/run/../cache", out/run too, which the kernel needs to resolve the "..")."""
    missing = []
    while path and not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def remove_if_empty(directories: list) -> None:
    """Remove those of directories (deepest first) that are empty; another process building into one
    keeps it."""
    for directory in directories:
        if os.path.basename(directory) in (os.curdir, os.pardir):
            continue  # "x/.." names x's parent, listed under its own name if it was made
        try:
            os.rmdir(directory)
        except OSError:
            pass


def data_cache_dir(requested: Optional[str]) -> str:
    import datasets

    return requested or os.path.join(datasets.config.HF_DATASETS_CACHE, "llama_lora_toolkit")
