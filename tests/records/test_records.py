"""lorakit.records.readers: every record shape -> one validated list of messages, with an explicit end
(ANSWER for training, PROMPT where the model answers next) and no stand-in answers."""

import json
import re

import pytest

from lorakit.core.cli import InputError
from lorakit.records.readers import (
    ANSWER,
    PROMPT,
    conversation_of,
    preference_of,
    prompt_of,
    read_conversations,
    read_records,
    request_of,
)

SYSTEM = {"role": "system", "content": "be brief"}
HISTORY = [["1+1?", "2"]]
ALPACA = {"instruction": "Add", "input": "2 3", "output": "5", "system": "be brief", "history": HISTORY}
# The same conversation in each shape that carries one.
SHAPES = {
    "alpaca": ALPACA,
    "sharegpt": {"conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "1+1?"},
                                   {"from": "gpt", "value": "2"}, {"from": "human", "value": "Add\n2 3"},
                                   {"from": "gpt", "value": "5"}]},
    "messages": {"messages": [SYSTEM, {"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                              {"role": "user", "content": "Add\n2 3"}, {"role": "assistant", "content": "5"}]},
}
CONTEXT = [SYSTEM, {"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
           {"role": "user", "content": "Add\n2 3"}]


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_gives_the_same_messages(shape):
    assert conversation_of("f:1", SHAPES[shape]) == CONTEXT + [{"role": "assistant", "content": "5"}]
    assert prompt_of("f:1", SHAPES[shape]) == CONTEXT  # a PPO prompt drops the answer it does not need
    if shape == "alpaca":  # its answer is a field of its own, which a prompt does not read
        assert conversation_of("f:1", SHAPES[shape], PROMPT) == CONTEXT
    else:  # a conversation given as a prompt must already end where the model answers
        with pytest.raises(InputError, match=r"must end on a user turn \(or a tool result\), not on an answer$"):
            conversation_of("f:1", SHAPES[shape], PROMPT)


def test_prompts_need_no_answer():
    no_output = {key: value for key, value in ALPACA.items() if key != "output"}
    assert prompt_of("f:1", no_output) == CONTEXT
    assert prompt_of("f:1", {"prompt": "Add\n2 3"}) == [{"role": "user", "content": "Add\n2 3"}]
    with pytest.raises(InputError, match="^f:1: field 'output' is missing$"):
        conversation_of("f:1", no_output, ANSWER)


def test_preference_context_is_validated_without_a_stand_in_answer():
    record = {"prompt": "Add\n2 3", "system": "be brief", "history": HISTORY, "chosen": "5", "rejected": "6",
              "margin": 1}
    assert preference_of("f:2", record) == (CONTEXT, "5", "6", 1.0)
    pair = {"chosen": SHAPES["messages"]["messages"],
            "rejected": SHAPES["messages"]["messages"][:-1] + [{"role": "assistant", "content": "6"}]}
    assert preference_of("f:2", pair) == (CONTEXT, "5", "6", 0.0)
    for name in ("chosen", "rejected"):
        with pytest.raises(InputError, match=f"^f:2: field '{name}': empty answer$"):
            preference_of("f:2", {**record, name: "  "})


def test_a_tool_result_is_a_prompt_the_model_answers():
    call = {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]}
    messages = [{"role": "user", "content": "Add 2 and 3"}, call, {"role": "tool", "content": "5", "name": "add"}]
    prompt = conversation_of("r", {"messages": messages}, PROMPT)
    assert prompt[1]["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
    with pytest.raises(InputError, match=r"^r: field 'messages\[2\]': the conversation ends on a tool turn"):
        conversation_of("r", {"messages": messages}, ANSWER)


def test_chat_requests():
    assert request_of("q:1", {"prompt": "hi"}, system_prompt="be brief") == (
        "prompt", "hi", [SYSTEM, {"role": "user", "content": "hi"}])
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(InputError, match=r"^q:2: field 'messages\[1\]': the conversation must end on a user turn"):
        request_of("q:2", {"messages": messages})
    with pytest.raises(InputError, match="^q:3: field 'prompt' or 'messages' is missing$"):
        request_of("q:3", {"question": "hi"})
    with pytest.raises(InputError, match=r"^q:4: field 'messages\[1\]': two consecutive user turns$"):
        request_of("q:4", {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})


def test_unicode_line_separators_inside_strings_are_data(tmp_path):
    """json.dumps(ensure_ascii=False) leaves U+2028, U+2029 and U+0085 raw inside strings: they
    belong to the record, not a line break (str.splitlines() would cut the record there)."""
    answer = "one\u2028two\u2029three\x85four"
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in [
        {"instruction": "q1", "output": answer}, {"instruction": "q2", "output": "plain"}]) + "\n", encoding="utf-8")
    assert [(where, messages[-1]["content"]) for where, messages, _ in read_conversations(str(path))] == [
        (f"{path}:1", answer), (f"{path}:2", "plain")]


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused(tmp_path, suffix, constant):
    good = '{"prompt": "p", "chosen": "c", "rejected": "r", "margin": 1}'
    bad = good.replace('"margin": 1', f'"margin": {constant}')
    path = tmp_path / f"d{suffix}"
    path.write_text(f"{good}\n{bad}\n" if suffix == ".jsonl" else f"[\n{good},\n{bad}\n]\n")
    line = 2 if suffix == ".jsonl" else 3
    expected = f"^{path}:{line}: not valid JSON \\({constant} is not a number JSON allows\\)$"
    with pytest.raises(InputError, match=expected):
        list(read_records(str(path)))


# ----------------------------------------------------------------------------- what files look like in the wild

GOOD = '{"instruction": "q", "output": "a"}'


def nested(depth: int) -> str:
    """A record whose field "x" nests depth - 1 lists: depth levels with the record itself."""
    return '{"instruction": "q", "output": "a", "x": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


@pytest.mark.parametrize("depth", [50_000, 101])
@pytest.mark.parametrize("shape", ["jsonl", "json", "documents", "tool arguments"])
def test_a_deeply_nested_record_is_one_line(tmp_path, shape, depth):
    """50,000 levels: json's recursive decoder raised RecursionError, a traceback; 101 levels decode, and whatever
    walks the record later (json.dumps, a template's tojson) would recurse that deep: both are refused, by line."""
    from lorakit.records.readers import read_documents

    record = nested(depth)
    if shape == "tool arguments":  # sharegpt's function_call value: JSON text, decoded by the reader
        call = '{"name": "f", "arguments": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"
        turns = [{"from": "human", "value": "q"}, {"from": "function_call", "value": call},
                 {"from": "observation", "value": "1"}, {"from": "gpt", "value": "a"}]
        record = json.dumps({"conversations": turns})
    path = tmp_path / f"d.{'json' if shape == 'json' else 'jsonl'}"
    path.write_text(f"[{GOOD},\n{record}]" if shape == "json" else f"{GOOD}\n{record}\n")
    field = r"field 'conversations\[1\]\.value': " if shape == "tool arguments" else ""
    expected = rf"^{path}:2: {field}lists and objects nested more than 100 levels deep$"
    with pytest.raises(InputError, match=expected):
        if shape == "documents":
            path.write_text(f'{{"text": "a"}}\n{record.replace("instruction", "text")}\n')
            list(read_documents(str(path)))
        else:
            read_conversations(str(path))


def test_a_record_100_levels_deep_is_read(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(nested(100) + "\n")
    assert [line for line, _ in read_records(str(path))] == [1]


def test_a_byte_order_mark_is_not_text(tmp_path):
    """Windows tools write one in front of UTF-8: .jsonl's first line was refused as invalid JSON, a .json list was
    "not a list", and a .txt corpus trained on it as part of its first document (the tokenizer corpus too)."""
    from lorakit.merge.tokenizers import read_lines
    from lorakit.records.readers import read_documents

    bom = "\ufeff"
    (tmp_path / "d.jsonl").write_text(f"{bom}{GOOD}\n{GOOD}\n", encoding="utf-8")
    (tmp_path / "d.json").write_text(f"{bom}[{GOOD},\n{GOOD}]", encoding="utf-8")
    (tmp_path / "t.txt").write_text(f"{bom}第一 文档\n第二\n", encoding="utf-8")
    (tmp_path / "t.jsonl").write_text(f'{bom}{{"text": "第一"}}\n', encoding="utf-8")
    for name in ("d.jsonl", "d.json"):
        assert [line for line, _ in read_records(str(tmp_path / name))] == [1, 2]
    assert list(read_documents(str(tmp_path / "t.txt"))) == ["第一 文档", "第二"]
    assert list(read_documents(str(tmp_path / "t.jsonl"))) == ["第一"]
    assert [line.text for line in read_lines([str(tmp_path / "t.txt")])] == ["第一 文档", "第二"]


def test_lone_carriage_returns_end_lines(tmp_path):
    """Old Mac OS line ends ("\\r" alone) made a .txt corpus one document and a .jsonl file one unreadable line. They
    end lines, in every format, "\\r\\n" as one line end; a raw "\\r" cannot be inside a valid JSON string."""
    from lorakit.merge.tokenizers import read_lines
    from lorakit.records.readers import read_documents

    (tmp_path / "t.txt").write_bytes("一\r二\r\n三\n\r四".encode())
    assert list(read_documents(str(tmp_path / "t.txt"))) == ["一", "二", "三", "四"]
    assert [(line.number, line.text) for line in read_lines([str(tmp_path / "t.txt")])] == [
        (1, "一"), (2, "二"), (3, "三"), (5, "四")]
    (tmp_path / "d.jsonl").write_bytes(f"{GOOD}\r{GOOD}\r\r{{broken\r".encode())
    with pytest.raises(InputError, match=rf"^{tmp_path / 'd.jsonl'}:4: not valid JSON"):
        list(read_records(str(tmp_path / "d.jsonl")))
    (tmp_path / "d.jsonl").write_bytes(f"{GOOD}\r{GOOD}\r".encode())
    assert [line for line, _ in read_records(str(tmp_path / "d.jsonl"))] == [1, 2]
    (tmp_path / "d.json").write_bytes(f"[\r{GOOD},\r{{broken}}]".encode())
    with pytest.raises(InputError, match=rf"^{tmp_path / 'd.json'}:3: not valid JSON"):
        list(read_records(str(tmp_path / "d.json")))
    (tmp_path / "bad.jsonl").write_bytes(f"{GOOD}\r".encode() + b"\xff\r")
    with pytest.raises(InputError, match=rf"^{tmp_path / 'bad.jsonl'}:2: not valid UTF-8$"):
        list(read_records(str(tmp_path / "bad.jsonl")))


@pytest.mark.parametrize("shape", ["jsonl", "json", "documents", "prompts", "tool arguments"])
def test_a_lone_surrogate_is_one_line_naming_the_field(tmp_path, shape):
    """JSON's escape "\\ud800" decodes to half of a UTF-16 pair, which is no character: SFT and pretraining crashed on
    it in the tokenizer (TypeError, exit 1). Refused where it is read, by line and field; a pair (one character) and an
    escaped backslash before "ud800" (text) are read."""
    from lorakit.data.prompts import read_prompts
    from lorakit.records.readers import read_documents

    readers = {"jsonl": read_conversations, "json": read_conversations, "tool arguments": read_conversations,
               "documents": lambda path: list(read_documents(path)),
               "prompts": lambda path: read_prompts([path], None, 1, 42)}
    good = '{"instruction": "q \\ud83d\\ude00 \\\\ud800", "output": "a"}'
    bad, field = '{"instruction": "q", "output": "a \\uDFFF b"}', "output"
    if shape == "documents":
        good, bad, field = '{"text": "\\ud83d\\ude00"}', '{"text": "a", "meta": ["\\ud800"]}', "meta[0]"
    if shape == "tool arguments":  # sharegpt's function_call value: JSON text, its escape escaped once more
        call = json.dumps({"name": "f", "arguments": {"city": "\ud800"}})
        turns = [{"from": "human", "value": "q"}, {"from": "function_call", "value": call},
                 {"from": "observation", "value": "1"}, {"from": "gpt", "value": "a"}]
        bad, field = json.dumps({"conversations": turns}), "conversations[1].value.arguments.city"
    path = tmp_path / f"d.{'json' if shape == 'json' else 'jsonl'}"
    path.write_text(f"[{good},\n{bad}]" if shape == "json" else f"{good}\n{bad}\n")
    expected = (rf"^{path}:2: field '{re.escape(field)}' holds a lone surrogate "
                r"\(\\u(dfff|d800), half of a UTF-16 pair\), which is not text$")
    with pytest.raises(InputError, match=expected):
        readers[shape](str(path))
    path.write_text(f"[{good}]" if shape == "json" else f"{good}\n")
    assert readers[shape](str(path))


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_key_given_twice_is_refused_naming_it(tmp_path, suffix):
    """json keeps the last of two values of one key without a word: a record with two "output"s trained on whichever
    came last. Refused by line and key, at any depth; documents too."""
    from lorakit.records.readers import read_documents

    twice = '{"messages": [{"role": "user", "content": "q", "content": "r"}, {"role": "assistant", "content": "a"}]}'
    path = tmp_path / f"d{suffix}"
    path.write_text(f"{GOOD}\n{twice}\n" if suffix == ".jsonl" else f"[{GOOD},\n{twice}]")
    with pytest.raises(InputError, match=rf"^{path}:2: field 'content' is given twice in one object"):
        read_conversations(str(path))
    (tmp_path / "t.jsonl").write_text('{"text": "a", "text": "b"}\n')
    with pytest.raises(InputError, match=r"t.jsonl:1: field 'text' is given twice"):
        list(read_documents(str(tmp_path / "t.jsonl")))
