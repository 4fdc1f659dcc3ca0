"""Text from a record or a request never becomes a control token: a user who writes `<|im_end|>` in a message gets
those characters read as text, not a turn end, and only the chat template's own special tokens are tokens. Training
(data.conversation_tokenizer, data.prompts) and serving (serve.inference) encode through this one module, so the ids
of a prompt are the same in both.

After Jinja has rendered, the template's tokens and the user's text cannot be told apart, so the user's strings are
marked before the render: each special token's text in them is wrapped in two private-use characters (the markers
transformers' own sanitize_control_tokens uses; markers already in a string are dropped first, so they cannot be
forged). unmark() then removes the markers and returns where the user's special-token texts lie in the render;
encode_protected() tokenizes the render as always and re-encodes just those tokens as plain text. A conversation
without any special token's text in its strings (nearly every one) renders and tokenizes exactly as before.

Torch-free: the tokenizer is used through its public methods (a fast tokenizer's backend pipeline for the plain-text
encoding, which keeps no state between calls and so is safe under a server's concurrent requests)."""

import functools
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from lorakit.core.cli import InputError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MARK_OPEN, MARK_CLOSE = "\U000f0000", "\U000f0001"
MARKED_TOKEN = re.compile(f"{MARK_OPEN}([^{MARK_OPEN}{MARK_CLOSE}]+){MARK_CLOSE}")

CharRange = tuple[int, int]


def mark(value: Any, specials: list[str]) -> Any:
    """value (a string, or lists and dicts of them: messages, tools) with each special token's text in its strings
    wrapped in the markers. Dict keys are not marked (a template reads them as field names)."""
    if isinstance(value, str):
        value = without_markers(value)
        return special_pattern(tuple(specials)).sub(f"{MARK_OPEN}\\g<0>{MARK_CLOSE}", value) if specials else value
    if isinstance(value, dict):
        return {key: mark(item, specials) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [mark(item, specials) for item in value]
    return value


@functools.cache
def special_pattern(specials: tuple[str, ...]) -> re.Pattern:
    """Any of the special texts, longest first, so a token is matched before a shorter one inside it."""
    return re.compile("|".join(re.escape(text) for text in sorted(specials, key=len, reverse=True)))


def holds_special_text(value: Any, specials: list[str]) -> bool:
    """Whether any string in value holds a special token's text (or a marker character)."""
    if isinstance(value, str):
        return MARK_OPEN in value or MARK_CLOSE in value or any(special in value for special in specials)
    if isinstance(value, dict):
        return any(holds_special_text(item, specials) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_special_text(item, specials) for item in value)
    return False


class UnmarkedText(NamedTuple):
    """A render with the markers removed, and the character ranges of the user's special-token texts in it."""

    text: str
    protected: list[CharRange]


def unmark(rendered: str) -> UnmarkedText:
    """Remove the markers. A marked token's text is kept and its range recorded; a lone marker (left by a template
    that split a marked string) is dropped."""
    if MARK_OPEN not in rendered and MARK_CLOSE not in rendered:
        return UnmarkedText(rendered, [])
    pieces, protected, length, position = [], [], 0, 0
    for match in MARKED_TOKEN.finditer(rendered):
        before = without_markers(rendered[position:match.start()])
        start = length + len(before)
        pieces += [before, match.group(1)]
        protected.append((start, start + len(match.group(1))))
        length, position = start + len(match.group(1)), match.end()
    pieces.append(without_markers(rendered[position:]))
    return UnmarkedText("".join(pieces), protected)


def without_markers(text: str) -> str:
    return text.replace(MARK_OPEN, "").replace(MARK_CLOSE, "")


class ProtectedEncoding(NamedTuple):
    """Token ids of a text, and each token's character span (start, end) in it."""

    input_ids: list[int]
    offsets: list[CharRange]


def encode_protected(tokenizer: "PreTrainedTokenizerBase", text: str,
                     protected: list[CharRange]) -> ProtectedEncoding:
    """text's ids as the tokenizer encodes it (no tokens added around it), except that a special token lying in a
    protected range is encoded as its plain text. Offsets need a fast tokenizer; a slow one encodes the text in
    pieces around the protected ranges (each token's span is then its piece's)."""
    if not getattr(tokenizer, "is_fast", False):
        return _encode_in_pieces(tokenizer, text, protected)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(encoding["input_ids"]), [tuple(span) for span in encoding["offset_mapping"]]
    if not protected:
        return ProtectedEncoding(ids, offsets)
    special_ids = set(tokenizer.all_special_ids) | {
        index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
    input_ids, spans = [], []
    for token, (start, end) in zip(ids, offsets, strict=True):
        if token in special_ids and any(start < stop and begin < end for begin, stop in protected):
            plain = plain_text_ids(tokenizer, text[start:end])
            input_ids += plain
            spans += [(start, end)] * len(plain)
        else:
            input_ids.append(token)
            spans.append((start, end))
    return ProtectedEncoding(input_ids, spans)


def _encode_in_pieces(tokenizer: "PreTrainedTokenizerBase", text: str,
                      protected: list[CharRange]) -> ProtectedEncoding:
    input_ids, spans, position = [], [], 0
    for start, end in sorted(protected) + [(len(text), len(text))]:
        if start > position:
            piece = tokenizer(text[position:start], add_special_tokens=False)["input_ids"]
            input_ids += piece
            spans += [(position, start)] * len(piece)
        if end > start:
            plain = plain_text_ids(tokenizer, text[start:end])
            input_ids += plain
            spans += [(start, end)] * len(plain)
        position = max(position, end)
    return ProtectedEncoding(input_ids, spans)


def plain_text_ids(tokenizer: "PreTrainedTokenizerBase", text: str) -> list[int]:
    """text encoded as plain text, matching no added token, as if it followed other text (no SentencePiece prefix
    space): encoded after a newline, whose ids are then removed, as transformers' encode_marked_chat does."""
    newline = _plain_ids(tokenizer, "\n")
    ids = _plain_ids(tokenizer, "\n" + text)
    ids = ids[len(newline):] if ids[:len(newline)] == newline else ids
    specials = set(tokenizer.all_special_ids)
    if specials & set(ids):
        raise InputError(f"{text!r}: this tokenizer encodes that text as a special token even as plain text; "
                         "remove it from the data")
    return ids


def _plain_ids(tokenizer: "PreTrainedTokenizerBase", text: str) -> list[int]:
    if getattr(tokenizer, "is_fast", False):
        backend = tokenizer.backend_tokenizer
        normalized = backend.normalizer.normalize_str(text) if backend.normalizer is not None else text
        splits = [split for split, _ in backend.pre_tokenizer.pre_tokenize_str(normalized)] \
            if backend.pre_tokenizer is not None else [normalized]
        return [token.id for split in splits for token in backend.model.tokenize(split)]
    # A list of tokens converts to a list of ids (transformers types the call for a single token too).
    return cast(list[int], tokenizer.convert_tokens_to_ids(tokenizer.tokenize(text, split_special_tokens=True)))


# Renders messages (and tools) to the text a template makes of them: a tokenizer's apply_chat_template with the
# run's template, generation prompt and keyword arguments.
Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]


class MarkedConversation(NamedTuple):
    """Messages and tools as the template is given them (marked where they hold special-token text), and whether
    they had to be marked."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    marked: bool


def marked_conversation(specials: list[str], messages: list[dict[str, Any]],
                        tools: list[dict[str, Any]] | None = None) -> MarkedConversation:
    """specials: the tokenizer's special texts (chat_templates.special_token_texts), found once per tokenizer by the
    caller: finding them walks the tokenizer's added tokens, which costs a sixth of tokenizing a conversation."""
    if not holds_special_text([messages, tools], specials):
        return MarkedConversation(messages, tools, False)
    return MarkedConversation(mark(messages, specials), mark(tools, specials) if tools else tools, True)


def encode_prompt(tokenizer: "PreTrainedTokenizerBase", specials: list[str], render: Render,
                  messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The ids of a conversation's prompt as render makes it: what serving encodes and what PPO's prompts are; the
    template's own tokens are tokens, the messages' texts are text (specials: as marked_conversation takes them)."""
    messages, tools, marked = marked_conversation(specials, messages, tools)
    text, protected = unmark(render(messages, tools)) if marked else (render(messages, tools), [])
    return encode_protected(tokenizer, text, protected).input_ids


def encode_text_prompt(tokenizer: "PreTrainedTokenizerBase", specials: list[str], text: str) -> list[int]:
    """A plain-text prompt's ids (the server's /v1/completions) with the tokenizer's own tokens around it (its BOS
    convention, as tokenizer(text) adds them), a special token's text in it encoded as text, as in a chat message: a
    client who writes "</s>" sends those characters, not an end of sequence. A prompt without such text (nearly every
    one) encodes exactly as tokenizer(text)."""
    if not holds_special_text(text, specials):
        return tokenizer(text)["input_ids"]
    plain, protected = unmark(mark(text, specials))
    before, after = added_around(tokenizer)
    return before + encode_protected(tokenizer, plain, protected).input_ids + after


class AddedIds(NamedTuple):
    """The ids a tokenizer adds around a text of its own accord."""

    before: list[int]
    after: list[int]


def added_around(tokenizer: "PreTrainedTokenizerBase") -> AddedIds:
    """The ids the tokenizer adds before and after a text (BOS; EOS for some), found around a probe's own ids:
    tokenizers spell the convention in different places (a post-processor, add_bos_token, a template)."""
    probe = "a"
    whole, own = tokenizer(probe)["input_ids"], tokenizer(probe, add_special_tokens=False)["input_ids"]
    for start in range(len(whole) - len(own) + 1):
        if whole[start:start + len(own)] == own:
            return AddedIds(whole[:start], whole[start + len(own):])
    # The probe's ids changed with the added ones: what an empty text gets, in front.
    return AddedIds(tokenizer("")["input_ids"], [])
