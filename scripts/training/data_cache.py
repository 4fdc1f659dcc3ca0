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


def data_cache_dir(requested: Optional[str]) -> str:
    import datasets

    return requested or os.path.join(datasets.config.HF_DATASETS_CACHE, "llama_lora_toolkit")
