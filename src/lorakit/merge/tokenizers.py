#!/usr/bin/env python
"""Extend a tokenizer's vocabulary with pieces learned on a corpus (Chinese, or any language).

    python scripts/merge/merge_tokenizers.py --base_tokenizer BASE_DIR --output_dir NEW_DIR \
        --train_corpus zh1.txt,zh2.txt [--vocab_size 20000 --model_type bpe]
    python scripts/merge/merge_tokenizers.py --base_tokenizer BASE_DIR --output_dir NEW_DIR \
        --extra_sp_model chinese_sp.model --eval_corpus heldout.txt

The new pieces come from a SentencePiece model, trained here on --train_corpus (one document a
line; every 20th line is held out for the report unless --eval_corpus is given) or given with
--extra_sp_model (Chinese-LLaMA's route). They are appended after every existing id, so the ids
of all original tokens, special tokens included, are unchanged and the old embedding rows stay
valid; the training scripts then resize the embeddings (new rows start at the mean).

How the pieces are merged depends on the base:

* SentencePiece (a LLaMA-1/2 style tokenizer.model): proto surgery, as Chinese-LLaMA's
  merge_tokenizers.py does. New pieces are appended with scores: for a BPE model below every
  base piece, in the extra model's merge order, so the base's own merges keep priority and text
  the base already handled is segmented as before; for a unigram model with the extra model's
  log-probabilities. The output holds the merged tokenizer.model and its tokenizer.json.
* BPE tokenizer.json, byte-level (LLaMA-3, Qwen, SmolLM2, GPT-2) or SentencePiece-style
  (Metaspace, byte fallback: what transformers 5 saves for LLaMA-2): each piece becomes a vocab
  entry AND merge rules that build it, appended after the base's merges. BPE applies merges in
  rank order, so the new ones run only after the base's have finished: they continue the base's
  segmentation exactly where the extra model would merge further, and English text the base
  already covers is unaffected. Added tokens (tokenizer.add_tokens) would instead be matched
  greedily on the raw text before the base's pre-tokenizer and model, splitting words the base
  tokenized well (" testing" -> " t" + "esting" with pieces learned from mostly-Chinese text).
  Single characters are made reachable first, then longer pieces in the extra model's order, so
  each longer piece is normally one merge of two earlier ones; a character the base splits into
  three byte tokens needs one intermediate token (reported). Limitation: where the base merges a
  space with the first byte of the next character (" 文" -> "Ġæ" ...), that character keeps its
  byte tokens unless the extra model learned the space-prefixed piece.

The report (printed and written to OUTPUT/vocab_extension_report.json, next to the extra model
as vocab_extension_pieces.model): vocabulary sizes,
tokens per character on the held-out text before/after (the figure vocabularies are extended
for), round-trip counts, how many new tokens are actually used, and sample tokenizations.
Guarantees, checked before the output is renamed into place: every original token (special
tokens included) keeps its id, every new piece encodes to its own token, and every held-out line
the base tokenizer round-trips, the merged one round-trips too.

This module holds the steps; the command that runs them in order is lorakit.commands.merge_tokenizers, its
arguments lorakit.merge.tokenizers_config.
"""

import argparse
import json
import logging
import os
import tempfile
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict, cast

from lorakit.core.text_lines import byte_lines
from lorakit.merge.common import InputError, code_files, copy_files, read_json, tokenizer_files

if TYPE_CHECKING:  # imported where used: the merge loads sentencepiece, tokenizers and transformers late
    # protoc's generated module builds its classes at run time: mypy finds no ModelProto in it.
    from sentencepiece.sentencepiece_model_pb2 import ModelProto  # type: ignore[attr-defined]
    from tokenizers.normalizers import Normalizer
    from tokenizers.pre_tokenizers import PreTokenizer
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("merge_tokenizers")

REPORT_FILE = "vocab_extension_report.json"
PIECES_FILE = "vocab_extension_pieces.model"  # the extra SentencePiece model, kept for reproducibility
# Mixed text every tokenizer must round-trip: Chinese, English, digits, emoji, full-width punctuation.
PROBES = (
    "我们今天学习中文模型的训练，并扩展词表。",
    "Hello world! The quick brown fox jumps over the lazy dog 123.",
    "混合 mixed 文本 text 🎉🚀 表情 emoji，全角：“引号”。",
)


class GuaranteeError(Exception):
    """A merged tokenizer broke a guarantee (a bug, not bad input): nothing is written."""


# ----------------------------------------------------------------------------- corpus


def corpus_files(value: str, flag: str) -> list[str]:
    files = [path.strip() for path in value.split(",") if path.strip()]
    if not files:
        raise InputError(f"{flag} names no file")
    for path in files:
        if not os.path.isfile(path):
            raise InputError(f"{path}: {flag} file does not exist")
    return files


class CorpusLine(NamedTuple):
    """One non-empty line of a corpus file, without its line ending."""

    path: str
    number: int  # from 1
    text: str


def read_lines(files: list[str]) -> Iterator[CorpusLine]:
    """(file, line number, text) of every non-empty line ("\n", "\r\n" or a lone "\r" ends one; a byte order mark
    is not text: core.text_lines); a line that is not UTF-8 is refused."""
    for path in files:
        with open(path, "rb") as handle:
            for number, raw in byte_lines(handle):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise InputError(f"{path}:{number}: not valid UTF-8") from None
                if text.strip():
                    yield CorpusLine(path, number, text)


def split_corpus(args: argparse.Namespace, train_path: str | None) -> list[str]:
    """Write the training lines to train_path (if training); return the eval lines."""
    eval_lines: list[str] = []
    if args.eval_corpus:
        for _, _, text in read_lines(corpus_files(args.eval_corpus, "--eval_corpus")):
            if len(eval_lines) < args.max_eval_lines:
                eval_lines.append(text)
    if train_path is None:
        return eval_lines
    held_out = not args.eval_corpus
    written = 0
    with open(train_path, "w", encoding="utf-8") as out:
        for index, (_, _, text) in enumerate(read_lines(corpus_files(args.train_corpus, "--train_corpus"))):
            if held_out and index % args.heldout_every == args.heldout_every - 1:
                if len(eval_lines) < args.max_eval_lines:
                    eval_lines.append(text)
                continue
            out.write(text + "\n")
            written += 1
    if written == 0:
        raise InputError(f"{args.train_corpus}: --train_corpus holds no training lines")
    return eval_lines


# ----------------------------------------------------------------------------- base tokenizer


@dataclass
class BaseTokenizer:
    path: str
    kind: str  # "sentencepiece", "byte_level" or "metaspace"
    proto: "ModelProto | None" = None  # sentencepiece kind
    data: dict[str, Any] = field(default_factory=dict)  # parsed tokenizer.json (BPE kinds)

    @property
    def model_proto(self) -> "ModelProto":
        """proto, which the sentencepiece kind (the only one that reads it) always has."""
        assert self.proto is not None, f"{self.path}: a {self.kind} base has no SentencePiece model"
        return self.proto


def json_types(node: Any) -> list[str]:
    """Every component 'type' inside a tokenizer.json normalizer / pre_tokenizer tree."""
    if isinstance(node, dict):
        found = [node["type"]] if "type" in node else []
        for value in node.values():
            found += json_types(value)
        return found
    if isinstance(node, list):
        return [t for item in node for t in json_types(item)]
    return []


def find_component(node: Any, type_name: str) -> dict[str, Any] | None:
    if isinstance(node, dict):
        if node.get("type") == type_name:
            return node
        node = list(node.values())
    if isinstance(node, list):
        for item in node:
            found = find_component(item, type_name)
            if found is not None:
                return found
    return None


def load_proto(path: str) -> "ModelProto":
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]  # built at run time, as above
    try:
        with open(path, "rb") as handle:
            proto.ParseFromString(handle.read())
    except Exception as err:  # noqa: BLE001 - protobuf raises DecodeError and friends
        raise InputError(f"{path}: not a SentencePiece model ({type(err).__name__})") from None
    if not proto.pieces:
        raise InputError(f"{path}: not a SentencePiece model (no pieces)")
    return proto


def inspect_base(path: str) -> BaseTokenizer:
    if not os.path.isdir(path):
        raise InputError(f"{path}: --base_tokenizer does not exist or is not a directory")
    model_path = os.path.join(path, "tokenizer.model")
    if os.path.isfile(model_path):
        proto = load_proto(model_path)
        if proto.trainer_spec.model_type not in (proto.trainer_spec.BPE, proto.trainer_spec.UNIGRAM):
            raise InputError(f"{model_path}: only BPE and unigram SentencePiece models can be extended")
        return BaseTokenizer(path, "sentencepiece", proto=proto)
    json_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(json_path):
        raise InputError(f"{path}: --base_tokenizer has neither tokenizer.model nor tokenizer.json")
    data = read_json(json_path, "tokenizer.json")
    model = data.get("model") or {}
    if model.get("type") != "BPE":
        raise InputError(f"{json_path}: model type {model.get('type')}: only BPE tokenizer.json bases "
                         "(byte-level or SentencePiece-style) can be extended")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise InputError(f"{json_path}: BPE with a continuing_subword_prefix/end_of_word_suffix is not supported")
    if "ByteLevel" in json_types(data.get("pre_tokenizer")):
        return BaseTokenizer(path, "byte_level", data=data)
    if model.get("byte_fallback") or "Metaspace" in json_types(data.get("pre_tokenizer")):
        return BaseTokenizer(path, "metaspace", data=data)
    raise InputError(f"{json_path}: a BPE tokenizer that is neither byte-level nor SentencePiece-style "
                     "(no ByteLevel pre-tokenizer, no byte fallback): its unknown characters could not round-trip")


def read_tokenizer_dir(path: str, trust_remote_code: bool = False) -> "PreTrainedTokenizerBase":
    """The transformers tokenizer saved in directory path (LLaMA's class for a bare tokenizer.model)."""
    from transformers import AutoTokenizer, LlamaTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError) as err:
        if "trust_remote_code" in str(err):  # not LLaMA's class below: its own code may tokenize differently
            raise InputError(f"{path}: this tokenizer needs its own Python code (auto_map); if you trust that "
                             "directory, rerun with --trust_remote_code") from None
        if os.path.isfile(os.path.join(path, "tokenizer.model")):
            return LlamaTokenizer.from_pretrained(path)  # a bare tokenizer.model: LLaMA's class
        raise InputError(f"{path}: cannot load a tokenizer from this directory ({err})") from None


# ----------------------------------------------------------------------------- extra pieces


class TrainingOptions(TypedDict):
    """The SentencePieceTrainer.train options that follow from the base."""

    normalization_rule_name: str
    add_dummy_prefix: bool
    remove_extra_whitespaces: bool
    split_digits: bool


def training_options(base: BaseTokenizer) -> TrainingOptions:
    """SentencePiece settings that make the extra pieces match how the base sees text."""
    if base.kind == "sentencepiece":
        spec = base.model_proto.normalizer_spec
        known = ("identity", "nfkc", "nmt_nfkc", "nfkc_cf", "nmt_nfkc_cf")
        return {"normalization_rule_name": spec.name if spec.name in known else "identity",
                "add_dummy_prefix": spec.add_dummy_prefix, "remove_extra_whitespaces": spec.remove_extra_whitespaces,
                "split_digits": base.model_proto.trainer_spec.split_digits}
    metaspace = find_component(base.data.get("pre_tokenizer"), "Metaspace") or {}
    prepends = metaspace.get("prepend_scheme", "never") in ("always", "first") or metaspace.get("add_prefix_space") \
        or "Prepend" in json_types(base.data.get("normalizer"))
    # Raw text, no NFKC: a piece normalized to "," would never match the "，" in the text.
    return {"normalization_rule_name": "identity", "add_dummy_prefix": bool(prepends and base.kind == "metaspace"),
            "remove_extra_whitespaces": False, "split_digits": True}


def train_extra_model(args: argparse.Namespace, base: BaseTokenizer, train_path: str, work_dir: str) -> "ModelProto":
    import sentencepiece as spm

    spec = base.model_proto.trainer_spec if base.kind == "sentencepiece" else None
    unigram_base = spec is not None and spec.model_type == spec.UNIGRAM
    model_type = args.model_type or ("unigram" if unigram_base else "bpe")
    options = training_options(base)
    logger.info("training a %s SentencePiece model, vocab %d, on %s (%s)", model_type, args.vocab_size,
                args.train_corpus, ", ".join(f"{k}={v}" for k, v in options.items()))
    try:
        spm.SentencePieceTrainer.train(
            input=train_path, model_prefix=os.path.join(work_dir, "extra"), model_type=model_type,
            vocab_size=args.vocab_size, character_coverage=args.character_coverage, byte_fallback=True,
            input_sentence_size=args.input_sentence_size, shuffle_input_sentence=True,
            max_sentence_length=args.max_sentence_length, num_threads=args.num_threads, minloglevel=2,
            **options)
    except RuntimeError as err:  # e.g. "Vocabulary size too high (N). Please set it to a value <= M."
        raise InputError(f"{args.train_corpus}: SentencePiece training failed: {str(err).strip()}") from None
    return load_proto(os.path.join(work_dir, "extra.model"))


class ExtraPiece(NamedTuple):
    """An ordinary piece of the extra SentencePiece model and its score."""

    text: str
    score: float


def extra_pieces(extra: "ModelProto") -> list[ExtraPiece]:
    """(piece, score) of the extra model's ordinary pieces (no control, unknown or byte pieces)."""
    normal = extra.SentencePiece.NORMAL
    return [ExtraPiece(piece.piece, piece.score) for piece in extra.pieces if piece.type == normal]


def check_compatible(base: BaseTokenizer, extra: "ModelProto", extra_name: str) -> None:
    spec = extra.trainer_spec
    if base.kind == "sentencepiece":
        base_type = base.model_proto.trainer_spec.model_type
        if spec.model_type != base_type:
            names = {spec.BPE: "bpe", spec.UNIGRAM: "unigram"}
            raise InputError(f"{extra_name}: a {names.get(spec.model_type, spec.model_type)} model cannot extend a "
                             f"{names.get(base_type)} base: train it with --model_type {names.get(base_type)}")
    elif spec.model_type != spec.BPE:
        # A unigram piece's prefixes are often not pieces: no merge chain would reach it.
        raise InputError(f"{extra_name}: a BPE tokenizer.json base needs a BPE extra model (--model_type bpe)")


# ----------------------------------------------------------------------------- SentencePiece base


class SentencePieceMerge(NamedTuple):
    """The merged SentencePiece model and the report's vocabulary counts."""

    proto: "ModelProto"
    stats: dict[str, int]


def merge_sentencepiece(base: BaseTokenizer, extra: "ModelProto") -> SentencePieceMerge:
    """Append the extra pieces the base lacks to a copy of the base proto; (proto, stats)."""
    merged = type(base.model_proto)()
    merged.CopyFrom(base.model_proto)
    present = {piece.piece for piece in merged.pieces}
    unigram = merged.trainer_spec.model_type == merged.trainer_spec.UNIGRAM
    lowest = min(piece.score for piece in merged.pieces)
    added = already = 0
    for text, score in extra_pieces(extra):
        if text in present:
            already += 1
            continue
        piece = merged.pieces.add()
        piece.piece = text
        piece.type = piece.NORMAL
        # BPE: merge priority follows score, so below every base piece keeps the base's merges first.
        piece.score = score if unigram else lowest - 1 - added
        present.add(text)
        added += 1
    merged.trainer_spec.vocab_size = len(merged.pieces)
    return SentencePieceMerge(merged, {"new_tokens": added, "intermediate_tokens": 0, "already_present": already,
                                       "across_pre_tokenizer_boundary": 0})


def write_sentencepiece_tokenizer(base: BaseTokenizer, merged_proto: "ModelProto", out_dir: str,
                                  base_tokenizer: "PreTrainedTokenizerBase",
                                  trust_remote_code: bool = False) -> None:
    """The merged tokenizer.model plus the HF files transformers makes from it."""
    extra_ids = [token for token, index in base_tokenizer.get_vocab().items() if index >= len(base.model_proto.pieces)]
    if extra_ids:
        raise InputError(f"{base.path}: the tokenizer has {len(extra_ids)} token(s) past its tokenizer.model "
                         f"({', '.join(sorted(extra_ids)[:3])}): appended pieces would take their ids; "
                         "extend a tokenizer without added tokens and add them afterwards")
    with tempfile.TemporaryDirectory(dir=out_dir) as work:
        # Without tokenizer.json, transformers converts the merged .model into its fast tokenizer.
        names = [name for name in tokenizer_files(base.path) if name not in ("tokenizer.json", "tokenizer.model")]
        copy_files(base.path, names + code_files(base.path), work)
        with open(os.path.join(work, "tokenizer.model"), "wb") as handle:
            handle.write(merged_proto.SerializeToString())
        tokenizer = read_tokenizer_dir(work, trust_remote_code)
        tokenizer.save_pretrained(out_dir)
        copy_files(work, ["tokenizer.model"], out_dir)


# ----------------------------------------------------------------------------- BPE tokenizer.json base


def bpe_segment(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """What a BPE model makes of one pre-tokenized word: apply the lowest-ranked merge first."""
    symbols = list(symbols)
    while len(symbols) > 1:
        best = None
        for i in range(len(symbols) - 1):
            rank = ranks.get((symbols[i], symbols[i + 1]))
            if rank is not None and (best is None or rank < best[0]):
                best = (rank, i)
        if best is None:
            break
        i = best[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    return symbols


def piece_to_token(base: BaseTokenizer, piece: str, normalizer: "Normalizer | None",
                   pre_tokenizer: "PreTokenizer") -> str | None:
    """The string a piece is in the base's BPE alphabet, or None if the base's pre-tokenizer
    would split it (a merge never crosses a pre-token boundary, so it could never be used)."""
    if base.kind == "metaspace":
        metaspace = find_component(base.data.get("pre_tokenizer"), "Metaspace") or {}
        token = piece.replace(" ", "\u2581")
        if metaspace.get("split", True) and "\u2581" in token[1:]:
            return None
        return token
    text = piece.replace("\u2581", " ")
    if normalizer is not None:
        text = normalizer.normalize_str(text)
    parts = pre_tokenizer.pre_tokenize_str(text)
    return parts[0][0] if len(parts) == 1 else None


class BpeGrowth:
    """A BPE model's vocab and merge list as extra pieces are added: each new token takes the
    next free id, and is reached by merge rules appended after the base's (lowest priority)."""

    def __init__(self, model: dict[str, Any]) -> None:
        self.vocab: dict[str, int] = model["vocab"]  # grown in place
        self.pairs: list[tuple[str, str]] = []
        for merge in model["merges"]:  # "a b", or ["a", "b"]: tokenizers has loaded the file, each is a pair
            first, second = merge.split(" ", 1) if isinstance(merge, str) else merge
            self.pairs.append((first, second))
        self.ranks = {pair: rank for rank, pair in enumerate(self.pairs)}
        self.next_id = max(self.vocab.values()) + 1
        self.stats = {"new_tokens": 0, "intermediate_tokens": 0, "already_present": 0,
                      "across_pre_tokenizer_boundary": 0, "unreachable": 0}
        self.new_tokens: list[str] = []

    def add_entry(self, token: str) -> None:
        self.vocab[token] = self.next_id
        self.next_id += 1

    def add_piece(self, token: str | None, metaspace: bool) -> None:
        """Add one extra piece, as the base's BPE alphabet spells it (None: the base's
        pre-tokenizer would split it)."""
        if token is None:
            self.stats["across_pre_tokenizer_boundary"] += 1
            return
        if token in self.vocab:
            self.stats["already_present"] += 1
            return
        if metaspace:
            for char in token:  # characters are the alphabet: one missing becomes a token itself
                if char not in self.vocab:
                    self.add_entry(char)
                    if char == token:
                        self.stats["new_tokens"] += 1
                        self.new_tokens.append(token)
                    else:
                        self.stats["intermediate_tokens"] += 1
            if token in self.vocab:
                return
        elif any(char not in self.vocab for char in token):
            self.stats["unreachable"] += 1
            return
        self.add_merge_chain(token)
        self.new_tokens.append(token)

    def add_merge_chain(self, token: str) -> None:
        """Merge rules joining token from what the base's merges make of its characters, left
        to right; every prefix on the way becomes a token (an intermediate one)."""
        segments = bpe_segment(list(token), self.ranks)
        current = segments[0]
        for segment in segments[1:]:
            joined = current + segment
            if joined not in self.vocab:
                self.add_entry(joined)
                self.stats["intermediate_tokens" if joined != token else "new_tokens"] += 1
            if (current, segment) not in self.ranks:
                self.ranks[(current, segment)] = len(self.pairs)
                self.pairs.append((current, segment))
            current = joined


class BpeMerge(NamedTuple):
    """The merged tokenizer.json, the report's vocabulary counts, and the new tokens (checked: each is reached)."""

    data: dict[str, Any]
    stats: dict[str, int]
    new_tokens: list[str]


def merge_bpe_json(base: BaseTokenizer, extra: "ModelProto") -> BpeMerge:
    """Append vocab entries and merge rules for the extra pieces; (tokenizer.json dict, stats, new tokens)."""
    from tokenizers import Tokenizer

    data = json.loads(json.dumps(base.data))  # a deep copy
    backend = Tokenizer.from_str(json.dumps(base.data))
    model = data["model"]
    string_merges = bool(model["merges"]) and isinstance(model["merges"][0], str)
    # tokenizers numbers added tokens that are missing from the model's vocab right after it when
    # it loads a file, whatever ids the file gives them: LLaMA-3's specials (128000+) would move up
    # to make room for the new pieces. Listed in the vocab (as SmolLM2's specials already are),
    # they keep their ids; the model never produces them (no merge builds them).
    for added in data.get("added_tokens") or []:
        if added["content"] not in model["vocab"]:
            model["vocab"][added["content"]] = added["id"]
    growth = BpeGrowth(model)
    pieces = [text for text, _ in extra_pieces(extra)]
    # Characters first: then a longer piece is (nearly always) one merge of two reachable pieces.
    for piece in [p for p in pieces if len(p) == 1] + [p for p in pieces if len(p) > 1]:
        growth.add_piece(piece_to_token(base, piece, backend.normalizer, backend.pre_tokenizer),
                         metaspace=base.kind == "metaspace")
    model["merges"] = [" ".join(pair) if string_merges else list(pair) for pair in growth.pairs]
    return BpeMerge(data, growth.stats, growth.new_tokens)


def write_bpe_tokenizer(base: BaseTokenizer, data: dict[str, Any], out_dir: str) -> None:
    from tokenizers import Tokenizer

    Tokenizer.from_str(json.dumps(data)).save(os.path.join(out_dir, "tokenizer.json"))
    copy_files(base.path, [name for name in tokenizer_files(base.path) if name != "tokenizer.json"], out_dir)


def unreachable_tokens(out_dir: str, new_tokens: list[str]) -> list[str]:
    """New tokens the merged BPE model does not produce from their own text (should be none)."""
    from tokenizers import Tokenizer

    model = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json")).model
    return [token for token in new_tokens if [t.value for t in model.tokenize(token)] != [token]]


# ----------------------------------------------------------------------------- report and guarantees


def encode_all(tokenizer: "PreTrainedTokenizerBase", lines: list[str]) -> list[list[int]]:
    return tokenizer(lines, add_special_tokens=False)["input_ids"] if lines else []


def round_trips(tokenizer: "PreTrainedTokenizerBase", lines: list[str], encoded: list[list[int]]) -> list[bool]:
    decoded = tokenizer.batch_decode(encoded, clean_up_tokenization_spaces=False) if lines else []
    return [text == back for text, back in zip(lines, decoded, strict=True)]


def readable_tokens(tokenizer: "PreTrainedTokenizerBase", ids: list[int]) -> list[str]:
    """Each token as text; a token holding part of a character's bytes as its raw form."""
    shown: list[str] = []
    for i in ids:
        # One id decodes to one string (transformers types both calls for a list of ids too).
        text = cast(str, tokenizer.decode([i], clean_up_tokenization_spaces=False))
        shown.append(text if "\ufffd" not in text else cast(str, tokenizer.convert_ids_to_tokens(i)))
    return shown


def check_guarantees(base_tokenizer: "PreTrainedTokenizerBase", merged: "PreTrainedTokenizerBase", lines: list[str],
                     base_ok: list[bool], merged_ok: list[bool]) -> None:
    base_vocab, merged_vocab = base_tokenizer.get_vocab(), merged.get_vocab()
    moved = [token for token, index in base_vocab.items() if merged_vocab.get(token) != index]
    if moved:
        raise GuaranteeError(f"{len(moved)} original token(s) changed id, e.g. {moved[0]!r}: "
                             f"{base_vocab[moved[0]]} -> {merged_vocab.get(moved[0])}")
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        if getattr(base_tokenizer, f"{name}_id", None) != getattr(merged, f"{name}_id", None):
            raise GuaranteeError(f"{name} changed id: {getattr(base_tokenizer, f'{name}_id')} -> "
                                 f"{getattr(merged, f'{name}_id')}")
    for token in base_tokenizer.all_special_tokens:
        if merged.convert_tokens_to_ids(token) != base_tokenizer.convert_tokens_to_ids(token):
            raise GuaranteeError(f"special token {token!r} changed id")
    broken = [text for text, before, after in zip(lines, base_ok, merged_ok, strict=True) if before and not after]
    if broken:
        raise GuaranteeError(f"{len(broken)} line(s) the base round-trips no longer do, e.g. {broken[0][:80]!r}")


def cjk_share(lines: list[str]) -> float:
    chars = sum(len(line) for line in lines)
    cjk = sum(1 for line in lines for char in line if unicodedata.name(char, "").startswith("CJK UNIFIED"))
    return cjk / max(chars, 1)


def sentencepiece_agreement(model_path: str, lines: list[str], encoded: list[list[int]]) -> float:
    """Share of lines the merged tokenizer.json encodes exactly as sentencepiece does with the
    merged tokenizer.model (tools such as llama.cpp read the .model)."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=model_path)
    same = sum(processor.encode(line) == ids for line, ids in zip(lines, encoded, strict=True))
    return same / max(len(lines), 1)


def eval_figures(eval_lines: list[str], before_ids: list[list[int]], after_ids: list[list[int]],
                 first_new: int) -> dict[str, Any]:
    """The held-out lines' figures: characters, tokens before and after, and how much the new tokens (ids from
    first_new on) are used."""
    chars = sum(len(line) for line in eval_lines)
    tokens_before = sum(len(ids) for ids in before_ids)
    tokens_after = sum(len(ids) for ids in after_ids)
    new_ids = [i for ids in after_ids for i in ids if i >= first_new]
    return {"lines": len(eval_lines), "characters": chars, "cjk_character_share": cjk_share(eval_lines),
            "tokens_before": tokens_before, "tokens_after": tokens_after,
            "tokens_per_char_before": tokens_before / max(chars, 1),
            "tokens_per_char_after": tokens_after / max(chars, 1),
            "token_reduction": 1 - tokens_after / max(tokens_before, 1),
            "new_tokens_used": len(set(new_ids)), "new_token_share_of_output": len(new_ids) / max(tokens_after, 1)}


def build_report(args: argparse.Namespace, base: BaseTokenizer, base_tokenizer: "PreTrainedTokenizerBase",
                 merged: "PreTrainedTokenizerBase", stats: dict[str, int], eval_lines: list[str],
                 new_tokens_unreachable: list[str], merged_model: str | None = None) -> dict[str, Any]:
    probe_lines = list(PROBES)
    texts = eval_lines + probe_lines
    before_ids, after_ids = encode_all(base_tokenizer, texts), encode_all(merged, texts)
    before_ok = round_trips(base_tokenizer, eval_lines + probe_lines, before_ids)
    after_ok = round_trips(merged, eval_lines + probe_lines, after_ids)
    check_guarantees(base_tokenizer, merged, eval_lines + probe_lines, before_ok, after_ok)
    if new_tokens_unreachable:
        raise GuaranteeError(f"{len(new_tokens_unreachable)} new token(s) are not produced from their own text, "
                             f"e.g. {new_tokens_unreachable[0]!r}")
    n = len(eval_lines)
    samples = []
    for index in list(range(min(args.num_samples, n))) + list(range(n, n + len(probe_lines))):
        samples.append({"text": (eval_lines + probe_lines)[index],
                        "before": readable_tokens(base_tokenizer, before_ids[index]),
                        "after": readable_tokens(merged, after_ids[index])})
    return {
        "base_tokenizer": base.path,
        "base_kind": base.kind,
        "extra_model": args.extra_sp_model or f"trained on {args.train_corpus} ({args.model_type or 'default type'}, "
                                             f"vocab {args.vocab_size})",
        "vocab_size": {"before": len(base_tokenizer), "after": len(merged), **stats},
        "eval": {
            "source": args.eval_corpus or f"every {args.heldout_every}th line of --train_corpus, held out of training",
            **eval_figures(eval_lines, before_ids[:n], after_ids[:n], len(base_tokenizer)),
            "round_trip_before": sum(before_ok[:n]), "round_trip_after": sum(after_ok[:n]),
        },
        "probes_round_trip": all(after_ok[n:]),
        "sentencepiece_agreement": (sentencepiece_agreement(merged_model, eval_lines, after_ids[:n])
                                    if merged_model else None),
        "samples": samples,
        "guarantees": {"original_ids_unchanged": True, "special_tokens_unchanged": True,
                       "round_trip_kept": True, "every_new_token_reachable": True},
    }


def print_report(report: dict[str, Any]) -> None:
    v, e = report["vocab_size"], report["eval"]
    print(f"vocabulary: {v['before']} -> {v['after']} (+{v['new_tokens']} new pieces, "
          f"+{v['intermediate_tokens']} intermediate tokens; {v['already_present']} pieces already present, "
          f"{v['across_pre_tokenizer_boundary']} split by the base's pre-tokenizer)")
    print(f"eval text: {e['lines']} lines, {e['characters']} characters ({100 * e['cjk_character_share']:.0f}% CJK), "
          f"from {e['source']}")
    print(f"tokens per character: {e['tokens_per_char_before']:.3f} -> {e['tokens_per_char_after']:.3f} "
          f"({100 * e['token_reduction']:.1f}% fewer tokens); round-trip {e['round_trip_before']} -> "
          f"{e['round_trip_after']} of {e['lines']} lines; {e['new_tokens_used']} distinct new tokens used "
          f"({100 * e['new_token_share_of_output']:.0f}% of the output)")
    if report["sentencepiece_agreement"] is not None:
        print(f"tokenizer.json and the merged tokenizer.model encode {100 * report['sentencepiece_agreement']:.1f}% "
              "of the eval lines identically")
        if report["sentencepiece_agreement"] < 0.99:
            logger.warning("tokenizer.json (transformers' conversion of the .model) segments differently from "
                           "sentencepiece on some lines; transformers' LlamaTokenizer converts every .model to BPE, "
                           "which is faithful for BPE models only")
    for sample in report["samples"]:
        text = sample["text"] if len(sample["text"]) <= 60 else sample["text"][:60] + "..."
        print(f"  {text}\n    before ({len(sample['before'])}): {' | '.join(sample['before'][:24])}"
              f"{' ...' if len(sample['before']) > 24 else ''}\n    after  ({len(sample['after'])}): "
              f"{' | '.join(sample['after'][:24])}{' ...' if len(sample['after']) > 24 else ''}")
