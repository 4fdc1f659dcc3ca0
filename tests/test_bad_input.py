"""Bad input: one line naming the problem (file, line, field), exit 2, no traceback, nothing written."""

import json

import pytest

from helpers.commands import PT_SCRIPT, check_refused, refuse, run_script
from helpers.tiny_runs import tiny_pt_args


def write(path, content: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


def snapshot(directory):
    if not directory.exists():
        return None
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


GOOD_LINE = json.dumps({"text": "我们 今天 学习 模型 训练 the quick brown fox"}, ensure_ascii=False).encode() + b"\n"


def case_missing_dir(tmp_path, model_dir):
    return {"dataset_dir": tmp_path / "nope"}, "nope: --dataset_dir does not exist"


def case_no_text_files(tmp_path, model_dir):
    write(tmp_path / "data" / "notes.csv", b"a,b\n")
    return {"dataset_dir": tmp_path / "data"}, "no .txt or .jsonl files"


def case_broken_json(tmp_path, model_dir):
    write(tmp_path / "data" / "c.jsonl", GOOD_LINE + b'{"text": "unterminated\n' + GOOD_LINE)
    return {"dataset_dir": tmp_path / "data"}, "c.jsonl:2: not valid JSON"


def case_missing_text_field(tmp_path, model_dir):
    write(tmp_path / "data" / "c.jsonl", GOOD_LINE * 2 + b'{"content": "x"}\n')
    return {"dataset_dir": tmp_path / "data"}, "c.jsonl:3: field 'text' is missing"


def case_non_utf8(tmp_path, model_dir):
    write(tmp_path / "data" / "c.txt", "第一行\n".encode() + "第二行\n".encode("gbk"))
    return {"dataset_dir": tmp_path / "data"}, "c.txt:2: not valid UTF-8"


def case_empty_file(tmp_path, model_dir):
    write(tmp_path / "data" / "a.txt", "我们 今天\n".encode() * 50)
    write(tmp_path / "data" / "b.txt", b"\n\n")
    return {"dataset_dir": tmp_path / "data"}, "b.txt: file holds no documents"


def case_block_size_too_large(tmp_path, model_dir):
    write(tmp_path / "data" / "a.txt", "我们 今天\n".encode() * 50)
    return ({"dataset_dir": tmp_path / "data", "block_size": 512},
            "--block_size 512 exceeds the model's max_position_embeddings 256")


def case_peft_path_not_adapter(tmp_path, model_dir):
    write(tmp_path / "data" / "a.txt", "我们 今天\n".encode() * 50)
    (tmp_path / "not_adapter").mkdir()
    return ({"dataset_dir": tmp_path / "data", "peft_path": tmp_path / "not_adapter"},
            "--peft_path is not a LoRA adapter (no adapter_config.json)")


def case_vocab_without_trainable_embeddings(tmp_path, model_dir, extended_tokenizer_dir):
    write(tmp_path / "data" / "a.txt", "我们 今天\n".encode() * 50)
    return ({"dataset_dir": tmp_path / "data", "tokenizer_name_or_path": extended_tokenizer_dir},
            "the new rows would never be trained; add --modules_to_save embed_tokens,lm_head")


CASES = [case_missing_dir, case_no_text_files, case_broken_json, case_missing_text_field, case_non_utf8,
         case_empty_file, case_block_size_too_large, case_peft_path_not_adapter,
         case_vocab_without_trainable_embeddings]


@pytest.mark.parametrize("case", CASES, ids=[case.__name__[5:] for case in CASES])
def test_bad_input_is_refused_cleanly(case, tmp_path, tiny_model_dir, extended_tokenizer_dir):
    extra = (extended_tokenizer_dir,) if "vocab" in case.__name__ else ()
    overrides, expected = case(tmp_path, tiny_model_dir, *extra)
    out, cache = tmp_path / "out", tmp_path / "cache"
    options = {"dataset_dir": None, **overrides}
    args = tiny_pt_args(tiny_model_dir, options.pop("dataset_dir"), out, cache, **options)
    # The first case runs as a real process; the others in-process through the same run_cli.
    check_refused(refuse(PT_SCRIPT, args, in_process=case is not CASES[0]), expected)
    assert not out.exists()
    assert not cache.exists() or not [p for p in cache.iterdir()]


def test_non_empty_output_dir_is_left_untouched(tmp_path, tiny_model_dir):
    write(tmp_path / "data" / "a.txt", "我们 今天\n".encode() * 50)
    out = tmp_path / "out"
    write(out / "precious.txt", b"keep me")
    before = snapshot(out)
    result = run_script(tiny_pt_args(tiny_model_dir, tmp_path / "data", out, tmp_path / "cache"))
    check_refused(result, "--output_dir is not empty and holds no complete checkpoint")
    assert snapshot(out) == before
