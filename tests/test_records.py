"""lorakit.records.readers: every record shape -> one validated list of messages, with an explicit end
(ANSWER for training, PROMPT where the model answers next) and no stand-in answers."""

import json

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
