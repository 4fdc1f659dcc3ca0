"""Content fingerprints of files, memoized by each file's stat signature: a file read once is only stat-ed later,
until it changes. Torch- and datasets-free, so the data cache's keys and the pipeline's stage hashes share one
implementation (lorakit.data.cache keys tokenized data with it; lorakit.pipeline hashes a stage's data and models)."""

import hashlib
import json
import logging
import os
import time
from typing import NamedTuple

from lorakit.core.atomic import write_json_atomically

logger = logging.getLogger(__name__)


def file_fingerprint(path: str) -> str:
    """Content hash: a file edited in place (same size, even same mtime) still changes the key."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# git's "racily clean" rule: a file changed this recently may change again within the same timestamp tick (a
# coarse filesystem clock) without its ctime moving, so its fingerprint is not memoized yet.
RACY_SECONDS = 2.0
# In each memo directory (a data cache entry, the pipeline's marker directory): the fingerprints of its files.
FINGERPRINT_MEMO_NAME = "file-fingerprints.json"


class StatSignature(NamedTuple):
    """A file's stat signature; json.dumps writes it as the JSON list the memos key on."""

    path: str
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int


def stat_signature(path: str) -> StatSignature:
    """What moves whenever the file's content may have changed. ctime is set by the kernel on every write and
    cannot be set back by the user (os.utime restores mtime only), so an in-place edit of the same size with the
    old mtime put back still changes the signature; inode and device catch a file replaced by another."""
    info = os.stat(path)
    return StatSignature(os.path.abspath(path), info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino,
                         info.st_dev)


def read_fingerprint_memo(path: str) -> dict[str, str]:
    """{stat signature as JSON: content fingerprint}; a missing or unreadable memo is an empty one."""
    try:
        with open(path, encoding="utf-8") as handle:
            memo = json.load(handle)
    except (OSError, ValueError):
        return {}
    if not isinstance(memo, dict):
        return {}
    return {key: value for key, value in memo.items() if key.startswith('["') and isinstance(value, str)}


class FingerprintMemo:
    """file_fingerprint of files, memoized by stat signature in the directories under a root (a data cache's
    entries, each holding its files' fingerprints, so the memo goes with the entry and the cache root holds
    entries only). The first process of a node (the local main process, which main_process_first lets go first)
    reads each file once; the node's other ranks, and later runs on unchanged files, only stat them. A file that
    changed while it was read, or within RACY_SECONDS, is hashed again next time."""

    def __init__(self, cache_root: str) -> None:
        self.known: dict[str, str] = {}
        if os.path.isdir(cache_root):
            for name in sorted(os.listdir(cache_root)):
                if not name.startswith("."):
                    self.known.update(read_fingerprint_memo(os.path.join(cache_root, name, FINGERPRINT_MEMO_NAME)))
        self.settled: dict[str, str] = {}

    def __call__(self, path: str) -> str:
        started_ns = time.time_ns()
        signature = stat_signature(path)
        key = json.dumps(signature)
        fingerprint = self.known.get(key)
        if fingerprint is None:
            fingerprint = file_fingerprint(path)
            if signature.ctime_ns >= started_ns - RACY_SECONDS * 1e9 or stat_signature(path) != signature:
                return fingerprint
        self.settled[key] = fingerprint
        return fingerprint

    def save_into(self, entry_dir: str) -> None:
        """Add the settled fingerprints to entry_dir's memo (a temporary file renamed: a concurrent reader sees the
        old memo or the new one), unless it holds them already; a read-only cache keeps serving its entries."""
        memo_path = os.path.join(entry_dir, FINGERPRINT_MEMO_NAME)
        stored = read_fingerprint_memo(memo_path)
        paths = {json.loads(key)[0] for key in self.settled}
        # One signature per file: an earlier version's goes (a copy of the same files elsewhere keeps its own).
        memo = {key: value for key, value in stored.items() if json.loads(key)[0] not in paths}
        memo.update(self.settled)
        if memo == stored:
            return
        try:
            write_json_atomically(memo_path, memo, indent=None)
        except OSError as err:
            logger.info("file fingerprints not memoized in %s: %s", entry_dir, err)


# ----------------------------------------------------------------------------- a model's or adapter's weights

# The files of a model or adapter directory that hold weights: what its fingerprint reads (config and tokenizer
# files are not weights; a run's identity records the config separately and its data keys cover the tokenizer).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# The memo entry (a directory under a memo root) where weight fingerprints are kept: a run's data cache holds one,
# so that each node reads a base once (its own --data_cache_dir); the merge and the servers use a user-wide one.
WEIGHTS_MEMO_ENTRY = "weight-fingerprints"


def weight_files(directory: str) -> list[str]:
    """The weight files directly in directory, by name."""
    return sorted(name for name in os.listdir(directory)
                  if name.endswith(WEIGHT_SUFFIXES) and os.path.isfile(os.path.join(directory, name)))


def weights_fingerprint(directory: str, memo: FingerprintMemo | None = None) -> str | None:
    """One content hash of every weight file of a model or adapter directory (each file's blake2b, memoized by its
    stat signature: read once, then stat-ed, until it changes), with its name; None for a directory holding none.
    The same weights re-saved in another layout (shards, dtype, .bin vs .safetensors) hash differently."""
    names = weight_files(directory)
    if not names:
        return None
    fingerprint = memo or file_fingerprint
    digest = hashlib.blake2b(digest_size=16)
    for name in names:
        digest.update(f"{name} {fingerprint(os.path.join(directory, name))}\n".encode())
    return digest.hexdigest()


def user_memo_root() -> str:
    """Where the merge and the servers memoize weight fingerprints: $LORAKIT_FINGERPRINT_CACHE, else
    ~/.cache/lorakit."""
    return os.environ.get("LORAKIT_FINGERPRINT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "lorakit")


def save_weights_memo(memo: FingerprintMemo, root: str) -> None:
    """memo's settled fingerprints into root's weights entry; a root that cannot be written keeps nothing."""
    entry = os.path.join(root, WEIGHTS_MEMO_ENTRY)
    try:
        os.makedirs(entry, exist_ok=True)
    except OSError as err:
        logger.info("weight fingerprints not memoized in %s: %s", entry, err)
        return
    memo.save_into(entry)
