"""Benchmark: the weights fingerprint of a run's identity (issue 29), first run and second run.

Builds a model directory of --size_gb of safetensors shards (--shard_gb each; one U8 tensor per shard, its bytes a
repeated random block: hashing cost does not depend on the content) in a temporary directory under --work_dir, then:

* first run  - a fresh FingerprintMemo (an empty memo root) and lorakit.core.fingerprints.weights_fingerprint:
               every shard is read and hashed (blake2b). The shards were just written, so part of them may still
               be in the page cache: a cold read from disk can only be slower.
* second run - what a later run of the same job does: a new FingerprintMemo read from the memo root the first
               run saved, and weights_fingerprint again: each shard is only stat-ed (its stat signature is in the
               memo). Target: under a second for 14 GB.

The directory is removed at the end (also on failure). Run alone (another CPU-heavy job distorts the first run):

    python benchmarks/bench_fingerprint.py --size_gb 14
"""

import argparse
import json
import os
import shutil
import struct
import tempfile
import time
from typing import NamedTuple

from lorakit.core import fingerprints
from lorakit.core.fingerprints import FingerprintMemo, save_weights_memo, weights_fingerprint

BLOCK = 64 << 20


def write_shard(path: str, size: int, block: bytes) -> None:
    """A valid safetensors file holding one U8 tensor of `size` bytes."""
    header = json.dumps({"weight": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        left = size
        while left:
            handle.write(block[:min(left, len(block))])
            left -= min(left, len(block))


def build_model(directory: str, size_gb: float, shard_gb: float) -> int:
    block = os.urandom(BLOCK)
    total, shard = int(size_gb * 1e9), int(shard_gb * 1e9)
    count = -(-total // shard)
    for index in range(count):
        size = min(shard, total - index * shard)
        write_shard(os.path.join(directory, f"model-{index + 1:05d}-of-{count:05d}.safetensors"), size, block)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as handle:
        json.dump({"model_type": "llama"}, handle)
    return count


class Timed(NamedTuple):
    seconds: float
    fingerprint: str | None


def timed_fingerprint(model_dir: str, memo_root: str) -> Timed:
    started = time.perf_counter()
    memo = FingerprintMemo(memo_root)
    fingerprint = weights_fingerprint(model_dir, memo)
    seconds = time.perf_counter() - started
    save_weights_memo(memo, memo_root)
    return Timed(seconds, fingerprint)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size_gb", type=float, default=14.0, help="Total size of the weights (GB, 1e9 bytes).")
    parser.add_argument("--shard_gb", type=float, default=5.0, help="Size of each shard (GB).")
    parser.add_argument("--work_dir", default=None, help="Where the temporary model directory goes.")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="bench_fingerprint_", dir=args.work_dir)
    try:
        model_dir, memo_root = os.path.join(work, "model"), os.path.join(work, "memo")
        os.makedirs(model_dir)
        started = time.perf_counter()
        shards = build_model(model_dir, args.size_gb, args.shard_gb)
        print(f"built {args.size_gb:g} GB in {shards} shard(s) in {time.perf_counter() - started:.1f}s", flush=True)
        time.sleep(fingerprints.RACY_SECONDS + 0.5)  # a file written within RACY_SECONDS is not memoized yet
        first, first_fp = timed_fingerprint(model_dir, memo_root)
        print(f"first run (reads and hashes every shard): {first:.2f}s, {args.size_gb / first:.2f} GB/s", flush=True)
        second, second_fp = timed_fingerprint(model_dir, memo_root)
        print(f"second run (stat only, memo read from disk): {second * 1000:.1f} ms", flush=True)
        assert first_fp == second_fp, "the memoized fingerprint differs from the computed one"
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
