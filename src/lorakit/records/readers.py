"""Every record shape the toolkit reads, turned into chat messages with one validation and one
set of `file:line: field` messages. Torch-free: serving and the merge tools import it without
pulling in datasets or the Trainer.

Shapes: alpaca ({"instruction", "input"?, "output", "system"?, "history"?}), sharegpt
({"conversations": [{"from", "value"}]}), messages ({"messages": [{"role", "content"}]}), preference
pairs ({"prompt", "chosen", "rejected"} or two message lists) and prompts ({"prompt"} or any of the
above without its answer); and pretraining documents (a .txt line, a .jsonl {"text"}).

A conversation has an explicit end:
- ANSWER: it ends with the assistant's answer (what SFT and reward train on);
- PROMPT: it ends where the model answers next, on a user turn or a tool's result (PPO prompts,
  chat, serving, the demo's exact match)."""

import json
import os
import re
from collections.abc import Iterator
from glob import glob
from typing import Any, NamedTuple, NoReturn

from lorakit.core.cli import InputError
from lorakit.core.text_lines import byte_lines, line_at, unified_line_ends

ANSWER, PROMPT = "answer", "prompt"

# One chat turn as chat templates take it: {"role", "content"} and the optional keys message_extras keeps.
Message = dict[str, Any]
Tools = list[dict[str, Any]]  # a record's function schemas, as the template lists them


RECORD_SUFFIXES = (".json", ".jsonl")


# sharegpt's function_call / observation turns are an assistant's tool calls and a tool's result.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "function_call": "assistant",
                  "observation": "tool"}


MESSAGE_ROLES = ("system", "user", "assistant", "tool")


def find_record_files(dataset_dir: str | None, data_paths: list[str] | None) -> list[str]:
    """Every *.json / *.jsonl in dataset_dir, then each --data_path file, each its own dataset."""
    files = []
    if dataset_dir:
        if not os.path.isdir(dataset_dir):
            raise InputError(f"{dataset_dir}: --dataset_dir does not exist or is not a directory")
        found = sorted(p for suffix in RECORD_SUFFIXES for p in glob(os.path.join(dataset_dir, f"*{suffix}")))
        if not found:
            raise InputError(f"{dataset_dir}: no .json or .jsonl files in --dataset_dir")
        files += found
    for path in data_paths or []:
        if not os.path.isfile(path):
            raise InputError(f"{path}: data file does not exist")
        if not path.endswith(RECORD_SUFFIXES):
            raise InputError(f"{path}: data files must be .json (a list) or .jsonl (one record a line)")
        files.append(path)
    return files


class NonFiniteNumber(ValueError):
    """NaN or Infinity in a data file: Python's json accepts them, JSON does not, and one NaN
    (a pair's margin, say) turns every loss after it into NaN."""


def refuse_non_finite(constant: str) -> NoReturn:
    raise NonFiniteNumber(f"{constant} is not a number JSON allows")


# Far beyond any record shape (a conversation's tool call arguments nest a few levels), far below where Python's
# recursive json decoder, json.dumps and the chat templates' tojson give up (about 1000).
MAX_NESTING_DEPTH = 100
TOO_DEEP = f"lists and objects nested more than {MAX_NESTING_DEPTH} levels deep"


def nested_too_deep(text: str, value: Any) -> bool:
    """Whether value, decoded from text, nests lists and objects more than MAX_NESTING_DEPTH deep. A value cannot nest
    deeper than text has opening brackets, so most records are not walked; the walk keeps its own stack."""
    if text.count("[") + text.count("{") <= MAX_NESTING_DEPTH:
        return False
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > MAX_NESTING_DEPTH:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


class DuplicateKey(ValueError):
    """A key given twice in one JSON object. Python's json keeps the last value without a word, so a record with two
    "output"s trains on whichever its writer happened to put last: which one was meant cannot be known."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: the object, or DuplicateKey naming the first key given twice."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(key)
            seen.add(key)
    return value


def printable(text: str) -> str:
    """text as it can be written to a log or a terminal: a lone surrogate escaped (\\ud800), everything else as is."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def given_twice(where: str, err: DuplicateKey) -> InputError:
    return InputError(f"{where}: field '{printable(err.key)}' is given twice in one object (JSON keys must be unique: "
                      "which value was meant?)")


# A lone surrogate (half of a UTF-16 pair) is no character: tokenizers raise TypeError on it, and it cannot be written
# as UTF-8. UTF-8 text cannot hold one, so in a decoded file it can only come from a JSON escape "\ud800".."\udfff"
# (a pair of them decodes to one character): text without such an escape is not walked.
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
SURROGATE = re.compile(r"[\ud800-\udfff]")


class LoneSurrogate(NamedTuple):
    """Where in a decoded value a lone surrogate is (a field path, "" for the value itself) and the surrogate."""

    field_name: str
    code_point: int


def lone_surrogate_in(value: Any) -> LoneSurrogate | None:
    """A string or key of value holding a lone surrogate (the first one, in document order, of the strings), or None.
    The walk keeps its own stack: the reader has bounded the nesting, a request body has not."""
    stack = [(value, "")]
    while stack:
        node, path = stack.pop()
        found = SURROGATE.search(node) if isinstance(node, str) else None
        if found:
            return LoneSurrogate(path, ord(found.group()))
        if isinstance(node, dict):
            children = []
            for key, child in node.items():
                key = str(key)
                key_path = f"{path}.{printable(key)}" if path else printable(key)
                if found := SURROGATE.search(key):
                    return LoneSurrogate(key_path, ord(found.group()))
                children.append((child, key_path))
            stack.extend(reversed(children))
        elif isinstance(node, list):
            stack.extend(reversed([(child, f"{path}[{index}]") for index, child in enumerate(node)]))
    return None


def surrogate_message(found: LoneSurrogate) -> str:
    """What is wrong, without the surrogate itself (it cannot be printed): "field 'x': ..." or the value's own."""
    what = f"a lone surrogate (\\u{found.code_point:04x}, half of a UTF-16 pair), which is not text"
    return f"field '{found.field_name}' holds {what}" if found.field_name else f"holds {what}"


def refuse_lone_surrogates(where: str, text: str, value: Any, field_name: str = "") -> None:
    """Refuse value, decoded from text, with `where` and the field when a string in it holds a lone surrogate."""
    if not SURROGATE_ESCAPE.search(text):
        return
    found = lone_surrogate_in(value)
    if found is not None:
        if field_name:
            found = found._replace(field_name=field_name + (f".{found.field_name}" if found.field_name else ""))
        raise InputError(f"{where}: {surrogate_message(found)}")


def json_value(where: str, text: str, finite: bool = True) -> Any:
    """The JSON value of text (one record's line, or a field holding JSON), refused with `where` when it is not valid
    JSON, holds NaN or Infinity (finite), a key twice in one object or a lone surrogate, or nests deeper than
    MAX_NESTING_DEPTH: refused here, so nothing after the reader recurses over a record without bound (json's decoder
    itself is recursive: RecursionError)."""
    try:
        value = json.loads(text, parse_constant=refuse_non_finite if finite else None, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as err:
        raise InputError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    except NonFiniteNumber as err:
        raise InputError(f"{where}: not valid JSON ({err})") from None
    except DuplicateKey as err:
        raise given_twice(where, err) from None
    except RecursionError:
        raise InputError(f"{where}: {TOO_DEEP}") from None
    if nested_too_deep(text, value):
        raise InputError(f"{where}: {TOO_DEEP}")
    refuse_lone_surrogates(where, text, value)
    return value


class NumberedRecord(NamedTuple):
    """A record and the line it starts on."""

    line: int
    record: Any


def read_records(path: str) -> Iterator[NumberedRecord]:
    """(line number, record) for each record of a .jsonl file or of a .json list. Lines end at "\n", "\r\n" or a
    lone "\r" and a byte order mark is dropped (core.text_lines); not at U+2028, U+2029 or U+0085, as
    str.splitlines() would: json.dumps(ensure_ascii=False) leaves them raw inside strings."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
        text = unified_line_ends(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise InputError(f"{path}:{line_at(raw, err.start)}: not valid UTF-8") from None
    if path.endswith(".jsonl"):
        for line_number, line in enumerate(text.split("\n"), start=1):
            if line.strip():
                yield NumberedRecord(line_number, json_value(f"{path}:{line_number}", line))
        return
    yield from read_json_list(path, text)


def read_json_list(path: str, text: str) -> Iterator[NumberedRecord]:
    """Decode a JSON list element by element, so each record's error names its own line."""
    decoder = json.JSONDecoder(parse_constant=refuse_non_finite, object_pairs_hook=unique_keys)
    position = len(text) - len(text.lstrip())
    if not text.startswith("[", position):
        raise InputError(f"{path}:1: a .json data file must hold a list of records")
    position += 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text):
            raise InputError(f"{path}:{text.count(chr(10)) + 1}: not valid JSON (the list is not closed)")
        if text[position] == "]":
            return
        line_number = text.count("\n", 0, position) + 1
        start = position
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as err:
            raise InputError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
        except NonFiniteNumber as err:
            raise InputError(f"{path}:{line_number}: not valid JSON ({err})") from None
        except DuplicateKey as err:
            raise given_twice(f"{path}:{line_number}", err) from None
        except RecursionError:
            raise InputError(f"{path}:{line_number}: {TOO_DEEP}") from None
        if nested_too_deep(text[start:position], record):
            raise InputError(f"{path}:{line_number}: {TOO_DEEP}")
        refuse_lone_surrogates(f"{path}:{line_number}", text[start:position], record)
        yield NumberedRecord(line_number, record)


def string_field(where: str, record: dict[str, Any], name: str, required: bool = True) -> str:
    if name not in record or record[name] is None:
        if required:
            raise InputError(f"{where}: field '{name}' is missing")
        return ""
    value = record[name]
    if not isinstance(value, str):
        raise InputError(f"{where}: field '{name}' must be a string, not {type(value).__name__}")
    return value


def alpaca_messages(where: str, record: dict[str, Any], ends_with: str = ANSWER,
                    instruction_field: str = "instruction") -> list[Message]:
    """An alpaca record's conversation: system, history pairs, then the instruction (with its
    input) and, for ANSWER, the output."""
    instruction = string_field(where, record, instruction_field)
    extra_input = string_field(where, record, "input", required=False)
    messages = []
    system = string_field(where, record, "system", required=False)
    if system:
        messages.append({"role": "system", "content": system})
    history = record.get("history") or []
    if not isinstance(history, list):
        raise InputError(f"{where}: field 'history' must be a list of [question, answer] pairs")
    for index, pair in enumerate(history):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise InputError(f"{where}: field 'history[{index}]' must be a [question, answer] pair of strings")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    user = f"{instruction}\n{extra_input}" if extra_input else instruction
    messages.append({"role": "user", "content": user})
    if ends_with == ANSWER:
        messages.append({"role": "assistant", "content": string_field(where, record, "output")})
    return messages


def turn_list(where: str, record: dict[str, Any], name: str, role_key: str, content_key: str,
              roles: dict[str, str] | tuple[str, ...]) -> list[Message]:
    turns = record[name]
    if not isinstance(turns, list) or not turns:
        raise InputError(f"{where}: field '{name}' must be a non-empty list of turns")
    messages: list[Message] = []
    for index, turn in enumerate(turns):
        field_name = f"{name}[{index}]"
        if not isinstance(turn, dict):
            raise InputError(f"{where}: field '{field_name}' must be an object")
        role = string_field(where, turn, role_key) if role_key in turn else None
        if role is None:
            raise InputError(f"{where}: field '{field_name}.{role_key}' is missing")
        if role not in roles:
            raise InputError(f"{where}: field '{field_name}.{role_key}' has unknown role '{role}' "
                             f"(expected one of {', '.join(roles)})")
        content = turn.get(content_key)
        message: Message
        if role == "function_call":  # sharegpt: the value is the call as JSON
            message = {"role": "assistant", "content": "",
                       "tool_calls": [tool_call(where, f"{field_name}.{content_key}", parse_json_field(
                           where, f"{field_name}.{content_key}", content))]}
        elif content is None and turn.get("tool_calls"):
            message = {"role": "assistant", "content": ""}
        elif not isinstance(content, str):
            raise InputError(f"{where}: field '{field_name}.{content_key}' is missing or not a string")
        else:
            message = {"role": roles[role] if isinstance(roles, dict) else role, "content": content}
        messages.append(message | message_extras(where, field_name, turn, message["role"]))
    return messages


def parse_json_field(where: str, field_name: str, value: Any) -> Any:
    """A field given as JSON text (sharegpt's function_call value, tools, a call's arguments), decoded."""
    if not isinstance(value, str):
        return value
    try:
        decoded = json.loads(value, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as err:
        raise InputError(f"{where}: field '{field_name}': not valid JSON ({err.msg})") from None
    except DuplicateKey as err:
        raise given_twice(f"{where}: field '{field_name}'", err) from None
    except RecursionError:
        raise InputError(f"{where}: field '{field_name}': {TOO_DEEP}") from None
    if nested_too_deep(value, decoded):
        raise InputError(f"{where}: field '{field_name}': {TOO_DEEP}")
    refuse_lone_surrogates(where, value, decoded, field_name)
    return decoded


def tool_call(where: str, field_name: str, call: Any) -> dict[str, Any]:
    """One tool call as chat templates expect it: {"type": "function", "function": {"name",
    "arguments"}} (also accepted flat: {"name", "arguments"}); "id" kept where given."""
    if not isinstance(call, dict):
        raise InputError(f"{where}: field '{field_name}' must be an object with 'name' and 'arguments'")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise InputError(f"{where}: field '{field_name}': a tool call needs a 'name' string")
    arguments = parse_json_field(where, f"{field_name}.arguments", function.get("arguments", {}))
    normal = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        normal["id"] = call["id"]
    return normal


def message_extras(where: str, field_name: str, turn: dict[str, Any], role: str) -> dict[str, Any]:
    """The optional keys of a message that templates render: an assistant's reasoning_content and
    tool_calls, a tool result's tool_call_id and name."""
    extras: dict[str, Any] = {}
    if role == "assistant":
        if turn.get("reasoning_content") is not None:
            extras["reasoning_content"] = string_field(where, turn, "reasoning_content")
        if turn.get("tool_calls"):
            calls = turn["tool_calls"]
            if not isinstance(calls, list):
                raise InputError(f"{where}: field '{field_name}.tool_calls' must be a list")
            extras["tool_calls"] = [tool_call(where, f"{field_name}.tool_calls[{i}]", call)
                                    for i, call in enumerate(calls)]
    elif role == "tool":
        for key in ("tool_call_id", "name"):
            if turn.get(key) is not None:
                extras[key] = string_field(where, turn, key)
    return extras


def tools_of(where: str, record: Any) -> Tools | None:
    """A record's "tools" (function schemas the template lists for the model), as a list."""
    tools = parse_json_field(where, "tools", record.get("tools")) if isinstance(record, dict) else None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise InputError(f"{where}: field 'tools' must be a list of function schemas")
    return tools or None


def record_object(where: str, record: Any) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise InputError(f"{where}: a record must be a JSON object")
    return record


class Turns(NamedTuple):
    """A record's list of turns: the field holding it and its messages (both None for an alpaca record)."""

    field_name: str | None
    messages: list[Message] | None


def turns_of(where: str, record: dict[str, Any]) -> Turns:
    """The turns of a sharegpt or messages record; Turns(None, None) for other shapes."""
    if "conversations" in record:
        return Turns("conversations", turn_list(where, record, "conversations", "from", "value", SHAREGPT_ROLES))
    if "messages" in record:
        return Turns("messages", turn_list(where, record, "messages", "role", "content", MESSAGE_ROLES))
    return Turns(None, None)


def conversation_of(where: str, record: Any, ends_with: str = ANSWER) -> list[Message]:
    """One record of any conversation shape as chat messages, validated, ending as `ends_with` says."""
    record = record_object(where, record)
    name, messages = turns_of(where, record)
    if messages is None:  # neither turn list: an alpaca record
        if not ("instruction" in record or "output" in record):
            raise InputError(f"{where}: no 'instruction'/'output', 'conversations' or 'messages' field")
        messages = alpaca_messages(where, record, ends_with)
    return validate_conversation(where, messages, name, ends_with)


def prompt_of(where: str, record: Any) -> list[Message]:
    """A record as a prompt to answer: alpaca (with "instruction" or "prompt"; an "output" is not
    needed), sharegpt or messages records, whose final answer, if any, is dropped."""
    record = record_object(where, record)
    name, messages = turns_of(where, record)
    if messages is not None:
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        return validate_conversation(where, messages, name, PROMPT)
    if "instruction" in record or "prompt" in record:
        field_name = "instruction" if "instruction" in record else "prompt"
        return alpaca_messages(where, record, PROMPT, instruction_field=field_name)
    raise InputError(f"{where}: no 'instruction', 'prompt', 'conversations' or 'messages' field")


# The fields a prompt is built from (prompt_of); every other field of a prompt record travels with it (record_fields).
PROMPT_SOURCE_FIELDS = ("instruction", "prompt", "input", "system", "history", "conversations", "messages")


def reference_answer(where: str, record: Any) -> Any:
    """A prompt record's reference answer, for the rewards that check one: its "answer" field, else an alpaca
    "output", else the content of a final assistant turn (which prompt_of drops from the prompt); None without."""
    record = record_object(where, record)
    if "answer" in record:
        return record["answer"]
    if "output" in record:
        return record["output"]
    _, messages = turns_of(where, record)
    if messages and messages[-1]["role"] == "assistant":
        return messages[-1]["content"]
    return None


def record_fields(where: str, record: Any) -> dict[str, Any]:
    """A prompt record's fields beyond those its prompt is built from, "answer" (reference_answer) among them:
    what a reward function reads by name."""
    record = record_object(where, record)
    fields = {name: value for name, value in record.items() if name not in PROMPT_SOURCE_FIELDS}
    fields["answer"] = reference_answer(where, record)
    return fields


class ChatRequest(NamedTuple):
    """A chat request read: the field it came in ("prompt" or "messages"), that field's value, its messages."""

    field_name: str
    value: Any
    messages: list[Message]


def request_of(where: str, record: Any, system_prompt: str | None = None) -> ChatRequest:
    """A chat request, {"prompt": "..."} or {"messages": [...]}; a system prompt is put first where the
    messages have none."""
    record = record_object(where, record)
    if "messages" in record:
        messages = conversation_of(where, {"messages": record["messages"]}, PROMPT)
        name = "messages"
    elif "prompt" in record:
        messages = [{"role": "user", "content": string_field(where, record, "prompt")}]
        name = "prompt"
    else:
        raise InputError(f"{where}: field 'prompt' or 'messages' is missing")
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return ChatRequest(name, record[name], messages)


# Which roles may follow each role (None: the first turn after an optional system prompt).
FOLLOWS = {None: ("user",), "user": ("assistant",), "assistant": ("user", "tool"), "tool": ("tool", "assistant")}
# The roles a conversation may end on: an answer, or a turn the model answers next.
LAST_ROLES = {ANSWER: ("assistant",), PROMPT: ("user", "tool")}


def validate_conversation(where: str, messages: list[Message], field_name: str | None,
                          ends_with: str = ANSWER) -> list[Message]:
    """System first (optional), then user and assistant alternating (an assistant's tool calls
    followed by tool results, then the assistant again), with non-empty answers, ending with an
    answer (ANSWER) or with a turn the model answers next (PROMPT)."""

    def at(index: int) -> str:
        return f"field '{field_name}[{index}]'" if field_name else "the conversation"

    start = 1 if messages and messages[0]["role"] == "system" else 0
    previous = None
    for index in range(start, len(messages)):
        message, role = messages[index], messages[index]["role"]
        if role == "system":
            raise InputError(f"{where}: {at(index)}: a system turn may only come first")
        allowed = FOLLOWS[previous]
        if role == "tool" and previous == "assistant" and not messages[index - 1].get("tool_calls"):
            allowed = ("user",)
        if role not in allowed:
            after = f"a {previous} turn" if previous else "the start (after an optional system turn)"
            what = f"two consecutive {role} turns" if role == previous else f"the {role} turn cannot follow {after}"
            raise InputError(f"{where}: {at(index)}: {what}")
        if role == "assistant" and not message["content"].strip() and not message.get("tool_calls"):
            raise InputError(f"{where}: {at(index)}: empty answer")
        previous = role
    if len(messages) == start:
        raise InputError(f"{where}: the conversation has no user turn")
    last = messages[-1]["role"]
    if last not in LAST_ROLES[ends_with]:
        if ends_with == ANSWER:
            raise InputError(f"{where}: {at(len(messages) - 1)}: the conversation ends on a {last} turn "
                             "(no answer to train on)")
        raise InputError(f"{where}: {at(len(messages) - 1)}: the conversation must end on a user turn "
                         "(or a tool result), not on an answer")
    return messages


class LocatedRecord(NamedTuple):
    """A record and where it is: "path:line", the prefix of every message about it."""

    where: str
    record: Any


def records_of(path: str) -> list[LocatedRecord]:
    """[(where, record)] of a file, where = "path:line"; an empty file is refused."""
    records = [LocatedRecord(f"{path}:{line}", record) for line, record in read_records(path)]
    if not records:
        raise InputError(f"{path}: file holds no records (empty)")
    return records


class Conversation(NamedTuple):
    """One record of a file read as a conversation."""

    where: str  # "path:line"
    messages: list[Message]
    tools: Tools | None


def read_conversations(path: str) -> list[Conversation]:
    """Every record of a file as a conversation."""
    return [Conversation(where, conversation_of(where, record), tools_of(where, record))
            for where, record in records_of(path)]


class Preference(NamedTuple):
    """A preference pair: the context both answers follow, the two answers, and the margin between them."""

    context: list[Message]  # ends on a user turn
    chosen: str
    rejected: str
    margin: float


def preference_of(where: str, record: Any) -> Preference:
    """A preference pair from {"prompt", "chosen", "rejected", "system"?, "history"?, "margin"?} or
    {"chosen": [messages], "rejected": [messages]} sharing every turn but the last answer."""
    record = record_object(where, record)
    for name in ("chosen", "rejected"):
        if name not in record:
            raise InputError(f"{where}: field '{name}' is missing")
    margin = record.get("margin", 0.0)
    if not isinstance(margin, (int, float)) or isinstance(margin, bool):
        raise InputError(f"{where}: field 'margin' must be a number")
    if isinstance(record["chosen"], list):
        return Preference(*conversation_pair(where, record), float(margin))
    context = alpaca_messages(where, record, PROMPT, instruction_field="prompt")
    chosen, rejected = string_field(where, record, "chosen"), string_field(where, record, "rejected")
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        if not answer.strip():
            raise InputError(f"{where}: field '{name}': empty answer")
    return Preference(context, chosen, rejected, float(margin))


class ConversationPair(NamedTuple):
    """Two message lists that differ in their last answer only: the turns they share, and the two answers."""

    context: list[Message]
    chosen: str
    rejected: str


def conversation_pair(where: str, record: dict[str, Any]) -> ConversationPair:
    chosen, rejected = (validate_conversation(where, turn_list(where, record, name, "role", "content", MESSAGE_ROLES),
                                              name) for name in ("chosen", "rejected"))
    if len(chosen) != len(rejected) or chosen[:-1] != rejected[:-1]:
        raise InputError(f"{where}: fields 'chosen' and 'rejected' must share every turn but the last answer")
    return ConversationPair(chosen[:-1], chosen[-1]["content"], rejected[-1]["content"])


# ----------------------------------------------------------------------------- pretraining documents

PRETRAINING_SUFFIXES = (".txt", ".jsonl")


def find_pretraining_files(dataset_dir: str | None) -> list[str]:
    """Every *.txt (one document a line) and *.jsonl (field "text") directly in dataset_dir."""
    if not dataset_dir:
        raise InputError("--dataset_dir is required")
    if not os.path.isdir(dataset_dir):
        raise InputError(f"{dataset_dir}: --dataset_dir does not exist or is not a directory")
    files = sorted(path for suffix in PRETRAINING_SUFFIXES for path in glob(os.path.join(dataset_dir, f"*{suffix}")))
    if not files:
        raise InputError(f"{dataset_dir}: no .txt or .jsonl files in --dataset_dir")
    return files


def read_documents(path: str) -> Iterator[str]:
    """Yield the documents of one file, refusing the first bad record with file:line:field."""
    is_jsonl = path.endswith(".jsonl")
    count = 0
    with open(path, "rb") as handle:
        for line_number, raw in byte_lines(handle):  # "\n", "\r\n" or a lone "\r" ends a line; no byte order mark
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise InputError(
                    f"{path}:{line_number}: not valid UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1})"
                ) from None
            if not line.strip():
                continue
            text = text_field_of(path, line_number, line) if is_jsonl else line
            if text.strip():
                count += 1
                yield text
    if count == 0:
        raise InputError(f"{path}: file holds no documents (empty)")


def text_field_of(path: str, line_number: int, line: str) -> str:
    record = json_value(f"{path}:{line_number}", line, finite=False)  # only "text" is read: NaN elsewhere is harmless
    if "text" not in record_object(f"{path}:{line_number}", record):
        raise InputError(f"{path}:{line_number}: field 'text' is missing")
    if not isinstance(record["text"], str):
        raise InputError(f"{path}:{line_number}: field 'text' must be a string, not {type(record['text']).__name__}")
    return record["text"]
