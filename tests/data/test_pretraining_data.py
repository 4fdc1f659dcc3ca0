"""The pretraining data path in-process: blocks, the cache key, concurrent cache builds."""

import hashlib
import json
import multiprocessing
import os

import numpy as np
import pytest
from transformers import AutoTokenizer

from lorakit.core.cli import InputError
from lorakit.data.build_dataset import build_pretraining_blocks
from lorakit.data.splits import split_validation


def blocks_digest(blocks) -> str:
    return hashlib.sha1(np.asarray(blocks["input_ids"], dtype=np.int32).tobytes()).hexdigest()


def cache_entries(cache_dir) -> list:
    return sorted(name for name in os.listdir(cache_dir) if name.startswith("pt-"))


@pytest.fixture
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def test_blocks_are_documents_joined_by_eos(tokenizer, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("我们 今天 学习\n\nthe quick brown fox\n", encoding="utf-8")
    (data / "b.jsonl").write_text(json.dumps({"text": "北京 天气 很好"}, ensure_ascii=False) + "\n", encoding="utf-8")
    expected = []
    for text in ["我们 今天 学习", "the quick brown fox", "北京 天气 很好"]:  # sorted files, empty line skipped
        expected += tokenizer(text, add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
    block_size = 5
    blocks = build_pretraining_blocks(str(data), tokenizer, block_size, str(tmp_path / "cache"))
    rows = [list(row) for row in blocks["input_ids"]]
    assert len(rows) == len(expected) // block_size
    assert sum(rows, []) == expected[: len(rows) * block_size]


def test_parallel_tokenization_equals_serial(tokenizer, tmp_path):
    from helpers.corpora import generated_corpus

    data = tmp_path / "data"
    data.mkdir()
    (data / "corpus.txt").write_text("\n".join(generated_corpus(5000, seed=1)), encoding="utf-8")
    serial = build_pretraining_blocks(str(data), tokenizer, 64, str(tmp_path / "c1"), num_proc=1)
    parallel = build_pretraining_blocks(str(data), tokenizer, 64, str(tmp_path / "c2"), num_proc=2)
    assert len(serial) > 100
    assert blocks_digest(serial) == blocks_digest(parallel)


def test_cache_hits_and_misses(tokenizer, extended_tokenizer_dir, tmp_path, caplog):
    data, cache = tmp_path / "data", tmp_path / "cache"
    data.mkdir()
    (data / "a.txt").write_text("我们 今天 学习 模型\n" * 50, encoding="utf-8")

    def build(tok, block_size=16):
        caplog.clear()
        with caplog.at_level("INFO", logger="lorakit.data.build_dataset"):
            blocks = build_pretraining_blocks(str(data), tok, block_size, str(cache))
        return blocks, "cache hit" in caplog.text

    first, hit = build(tokenizer)
    assert not hit and len(cache_entries(cache)) == 1
    second, hit = build(tokenizer)
    assert hit and blocks_digest(first) == blocks_digest(second)

    # A changed tokenizer, block size or file content never reuses the stale blocks.
    _, hit = build(AutoTokenizer.from_pretrained(extended_tokenizer_dir))
    assert not hit and len(cache_entries(cache)) == 2
    _, hit = build(tokenizer, block_size=8)
    assert not hit and len(cache_entries(cache)) == 3
    stat = os.stat(data / "a.txt")
    (data / "a.txt").write_text("我们 今天 学习 数据\n" * 50, encoding="utf-8")  # same size
    os.utime(data / "a.txt", ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and same mtime
    changed, hit = build(tokenizer)
    assert not hit and len(cache_entries(cache)) == 4
    assert blocks_digest(changed) != blocks_digest(first)
    assert not [name for name in os.listdir(cache) if name.startswith(".tmp")]


def _build_after_barrier(barrier, data, tokenizer_dir, cache, queue):
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        barrier.wait()
        queue.put(blocks_digest(build_pretraining_blocks(data, tokenizer, 16, cache)))
    except BaseException as err:  # noqa: BLE001 reported to the parent, which fails the test
        queue.put(f"error: {err!r}")


def test_concurrent_builds_never_see_half_written_cache(tokenizer, tiny_tokenizer_dir, tmp_path):
    from helpers.corpora import generated_corpus

    data = tmp_path / "data"
    data.mkdir()
    (data / "corpus.txt").write_text("\n".join(generated_corpus(3000, seed=2)), encoding="utf-8")
    reference = blocks_digest(build_pretraining_blocks(str(data), tokenizer, 16, str(tmp_path / "reference")))
    context = multiprocessing.get_context("fork")
    for attempt in range(20):
        cache = str(tmp_path / f"cache{attempt}")
        barrier, queue = context.Barrier(2), context.Queue()
        workers = [context.Process(target=_build_after_barrier,
                                   args=(barrier, str(data), tiny_tokenizer_dir, cache, queue))
                   for _ in range(2)]
        for worker in workers:
            worker.start()
        results = [queue.get(timeout=120) for _ in workers]
        for worker in workers:
            worker.join(timeout=60)
            assert worker.exitcode == 0
        assert results == [reference, reference], (attempt, results)
        assert os.listdir(cache) == cache_entries(cache) and len(os.listdir(cache)) == 1


def test_validation_split_is_seeded_and_disjoint(tokenizer, tmp_path):
    from helpers.corpora import generated_corpus

    data = tmp_path / "data"
    data.mkdir()
    (data / "corpus.txt").write_text("\n".join(generated_corpus(400, seed=3)), encoding="utf-8")
    blocks = build_pretraining_blocks(str(data), tokenizer, 16, str(tmp_path / "cache"))
    train, held_out = split_validation(blocks, 10, seed=42)
    assert len(held_out) == round(len(blocks) * 0.10) and len(train) + len(held_out) == len(blocks)
    train_rows = {tuple(row) for row in train["input_ids"]}
    assert not any(tuple(row) in train_rows for row in held_out["input_ids"])
    again, _ = split_validation(blocks, 0.1, seed=42)  # a fraction, as the anchor passes it
    assert blocks_digest(again) == blocks_digest(train)
    with pytest.raises(InputError, match="validation"):
        split_validation(blocks.select(range(1)), 10, seed=0)
