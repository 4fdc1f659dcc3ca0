"""Data preparation at scale: the data files are read once per node (the ranks after the first, and later runs,
only stat them), packed rows are cached with the samples, and --prepare_data_only builds the cache without the
model or a process group, so the training launch starts from a warm cache."""

import builtins
import contextlib
import json
import os
import shutil
import time

import pytest
from transformers import AutoTokenizer

from helpers.commands import SFT_SCRIPT, assert_ok, run_in_process, run_script
from helpers.corpora import generated_corpus
from helpers.tiny_runs import tiny_sft_args
from lorakit.core import fingerprints
from lorakit.data import build_dataset
from lorakit.data import cache as data_cache
from lorakit.data.build_dataset import (
    build_preference_dataset,
    build_pretraining_blocks,
    build_sft_dataset,
    pack_samples,
)
from lorakit.records.chat_templates import named_template


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


@pytest.fixture
def settled_files(monkeypatch):
    """Files written by the test count as settled at once: a real corpus was written long before its run, these
    a moment ago (within data_cache.RACY_SECONDS, whose own test is below)."""
    monkeypatch.setattr(fingerprints, "RACY_SECONDS", 0.0)  # the memo's module (data.cache offers it too)


@contextlib.contextmanager
def data_file_reads(data_dir):
    """Sizes of the files under data_dir opened while the block runs: hashing a file or reading its records opens
    it, a stat does not."""
    reads, real_open, root = [], builtins.open, os.path.abspath(data_dir)

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.path.abspath(file).startswith(root + os.sep):
            reads.append(os.path.getsize(file))
        return real_open(file, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builtins, "open", counting_open)
        yield reads


def conversation_lines(count: int, seed: int) -> list:
    lines = generated_corpus(2 * count, seed)
    return [json.dumps({"messages": [{"role": "user", "content": lines[2 * i]},
                                     {"role": "assistant", "content": lines[2 * i + 1]}]}, ensure_ascii=False)
            for i in range(count)]


def pair_lines(count: int, seed: int) -> list:
    lines = generated_corpus(3 * count, seed)
    return [json.dumps({"prompt": lines[3 * i], "chosen": lines[3 * i + 1], "rejected": lines[3 * i + 2]},
                       ensure_ascii=False) for i in range(count)]


def multi_file_corpus(data_dir, kind: str) -> list:
    """Three files of one kind of records; their paths."""
    data_dir.mkdir()
    paths = []
    for index in range(3):
        if kind == "pt":
            path, lines = data_dir / f"part{index}.txt", generated_corpus(300, seed=index)
        else:
            path = data_dir / f"part{index}.jsonl"
            lines = (conversation_lines if kind == "sft" else pair_lines)(40, seed=index)
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        paths.append(str(path))
    return paths


def builder(kind: str, tokenizer, paths: list, data_dir, cache_dir):
    template = named_template("chatml", tokenizer)
    if kind == "pt":
        return lambda: build_pretraining_blocks(str(data_dir), tokenizer, 16, str(cache_dir))
    if kind == "sft":
        return lambda: build_sft_dataset(paths, tokenizer, template, 128, str(cache_dir))
    return lambda: build_preference_dataset(paths, tokenizer, template, 128, str(cache_dir))


@pytest.mark.parametrize("kind", ["pt", "sft", "pairs"])
def test_the_ranks_after_the_first_read_no_data_file(kind, tokenizer, tmp_path, settled_files):
    data_dir = tmp_path / "data"
    paths = multi_file_corpus(data_dir, kind)
    corpus_bytes = sum(os.path.getsize(path) for path in paths)
    build = builder(kind, tokenizer, paths, data_dir, tmp_path / "cache")
    with data_file_reads(data_dir) as first_rank:
        built = build()  # the node's main process, first (main_process_first): a miss, reads and tokenizes
    assert sum(first_rank) >= corpus_bytes
    with data_file_reads(data_dir) as other_rank:
        loaded = build()  # each other rank of the node, then every later launch: a hit on unchanged files
    assert other_rank == [], f"a cache hit read {sum(other_rank)} bytes of data files"
    assert loaded.to_dict() == built.to_dict()


def test_an_edit_with_the_mtime_put_back_misses_the_memo(tokenizer, tmp_path, settled_files):
    data_dir, cache = tmp_path / "data", tmp_path / "cache"
    data_dir.mkdir()
    corpus = data_dir / "a.txt"
    corpus.write_text("我们 今天 学习 模型\n" * 60, encoding="utf-8")
    first = build_pretraining_blocks(str(data_dir), tokenizer, 16, str(cache))
    stat = os.stat(corpus)
    corpus.write_text("我们 今天 学习 数据\n" * 60, encoding="utf-8")  # same size
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the old mtime: only ctime tells
    with data_file_reads(data_dir) as reads:
        changed = build_pretraining_blocks(str(data_dir), tokenizer, 16, str(cache))
    assert reads and changed.to_dict() != first.to_dict()
    assert len([name for name in os.listdir(cache) if name.startswith("pt-")]) == 2


def test_a_racily_clean_file_is_hashed_again(tokenizer, tmp_path):
    """A file changed within RACY_SECONDS of its read may change again unseen (a coarse timestamp tick): its
    fingerprint is not kept, the next run reads it again."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "a.txt").write_text("\n".join(generated_corpus(200, seed=4)), encoding="utf-8")
    build_pretraining_blocks(str(data_dir), tokenizer, 16, str(tmp_path / "cache"))
    with data_file_reads(data_dir) as reads:
        build_pretraining_blocks(str(data_dir), tokenizer, 16, str(tmp_path / "cache"))
    assert reads == [os.path.getsize(data_dir / "a.txt")]


def test_packed_rows_are_cached_with_the_samples(tokenizer, tmp_path, monkeypatch):
    from lorakit.data.build_dataset import cached_packed_rows
    from lorakit.data.splits import first_samples, split_validation

    paths = multi_file_corpus(tmp_path / "data", "sft")
    cache = str(tmp_path / "cache")
    samples = build_sft_dataset(paths, tokenizer, named_template("chatml", tokenizer), 128, cache)
    train, _ = split_validation(samples, 10, seed=42, what="samples")
    packed = cached_packed_rows(first_samples(train, 80), 512, cache)
    assert packed.to_dict() == pack_samples(first_samples(train, 80), 512).to_dict()
    assert len(packed) < 80 and max(packed["length"]) <= 512

    def no_packing(*args):
        raise AssertionError("a cache hit packed the samples again")

    monkeypatch.setattr(build_dataset, "pack_samples", no_packing)
    again = cached_packed_rows(first_samples(train, 80), 512, cache)  # another rank, or the next launch
    assert again.to_dict() == packed.to_dict()
    with pytest.raises(AssertionError, match="packed the samples again"):
        cached_packed_rows(first_samples(train, 60), 512, cache)  # other samples: another entry


def weightless_copy(model_dir, target) -> str:
    """The model's config and tokenizer without its weights: a run that loads the model fails on it."""
    shutil.copytree(model_dir, target, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return str(target)


def test_a_record_with_more_text_than_max_seq_length_can_hold_is_dropped_untokenized(tokenizer, tmp_path, caplog,
                                                                                     monkeypatch):
    """A 50 MB line was rendered and tokenized in full (65 s, 4.6 GB) only to be cut to --max_seq_length: a record with
    more bytes of text than max_seq_length tokens can spell is dropped before it is rendered, counted with the drops."""
    from lorakit.data.conversation_tokenizer import ConversationTokenizer

    rendered, render = [], ConversationTokenizer.segments
    monkeypatch.setattr(ConversationTokenizer, "segments",
                        lambda self, where, *rest: rendered.append(where) or render(self, where, *rest))
    huge = json.dumps({"messages": [{"role": "user", "content": "很长 " * 5000},
                                    {"role": "assistant", "content": "a"}]})
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join([huge, *conversation_lines(3, seed=0)]) + "\n", encoding="utf-8")
    with caplog.at_level("WARNING", logger="lorakit.data.build_dataset"):
        built = build_sft_dataset([str(data)], tokenizer, named_template("human_assistant", tokenizer), 64,
                                  str(tmp_path / "cache"))
    assert len(built) == 3 and rendered == [f"{data}:{line}" for line in (2, 3, 4)]
    assert "dropped 1 of 4 samples" in caplog.text and "(1 of them hold over" in caplog.text
    # The bound keeps every record max_seq_length tokens could spell: the longest token, max_seq_length times.
    longest = max(tokenizer.get_vocab(), key=lambda token: len(token.encode()))
    template = named_template("human_assistant", tokenizer)
    assert not ConversationTokenizer(tokenizer, template, 64).too_large([{"content": longest * 64}])


@pytest.mark.slow
def test_prepare_data_only_builds_the_cache_a_launch_then_hits(tiny_model_dir, tmp_path, monkeypatch):
    data_dir, cache, out = tmp_path / "data", tmp_path / "cache", tmp_path / "out"
    multi_file_corpus(data_dir, "sft")
    written = time.time()
    options = {"dataset_dir": data_dir, "template": "chatml", "max_seq_length": 128, "packing": True,
               "validation_split_percentage": 10, "max_steps": 1}
    config_only = weightless_copy(tiny_model_dir, tmp_path / "config_only")
    time.sleep(max(0.0, written + data_cache.RACY_SECONDS + 0.1 - time.time()))  # a corpus at rest, as in use
    prepared = run_script(tiny_sft_args(config_only, out, cache, prepare_data_only=True, **options), script=SFT_SCRIPT)
    assert_ok(prepared)
    reported = [line for line in prepared.stdout.splitlines() if line.startswith("data cache entry ")]
    entries = [os.path.basename(line.split()[3].rstrip(":")) for line in reported]
    assert [entry.split("-")[0] for entry in entries] == ["sft", "packed"]
    assert all(line.endswith(": built") for line in reported)
    assert sorted(os.listdir(cache)) == sorted(entries) and not out.exists()

    def no_tokenizing(*args):
        raise AssertionError("the training launch tokenized or packed")

    monkeypatch.setattr(build_dataset, "map_shards", no_tokenizing)
    monkeypatch.setattr(build_dataset, "pack_samples", no_tokenizing)
    with data_file_reads(data_dir) as reads:
        trained = run_in_process(SFT_SCRIPT, tiny_sft_args(tiny_model_dir, out, cache, **options))
    assert_ok(trained)
    assert "supervised samples: cache hit" in trained.stdout and "packed rows: cache hit" in trained.stdout
    # no data entry built: only the memo of the base's weight fingerprints (the run identity's) is new
    assert reads == [] and sorted(os.listdir(cache)) == sorted([*entries, fingerprints.WEIGHTS_MEMO_ENTRY])
    assert os.path.isdir(out / "sft_lora_model")
