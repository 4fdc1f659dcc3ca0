"""Conversations -> token ids and labels with any chat template: the answer spans the model
learns, found by character offsets in one render, each trained through its turn-end token."""

import functools
import logging
import os
from bisect import bisect_right
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from jinja2 import TemplateError

from lorakit.core.cli import InputError
from lorakit.records.chat_templates import first_special_token, render_text, special_token_texts, turn_end_text
from lorakit.records.control_text import CharRange, encode_prompt, encode_protected, marked_conversation, unmark
from lorakit.records.readers import Message, Tools

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# How many times the most text max_length tokens can spell a record may hold before it is dropped untokenized. A
# token stands for at most max_token_bytes of text, so a record over max_length * max_token_bytes bytes cannot fit:
# the margin covers a normalizer that shortens text before it is split (NFKC writes a 3-byte full-width letter as 1
# byte) and template text, which only adds tokens. Only a tokenizer that deletes or collapses text (whitespace runs)
# could fit more, and not 4 times the longest token's worth per token.
RECORD_BYTES_MARGIN = 4


def max_token_bytes(tokenizer: "PreTrainedTokenizerBase") -> int:
    """The most UTF-8 bytes the text of one token takes, from the vocabulary's token strings: each takes at least as
    many bytes as the text it stands for (byte-level BPE writes a byte as a character of 1 or 2 bytes, SentencePiece
    a space as "\u2581" (3 bytes), byte fallback a byte as "<0xE9>" (6 bytes))."""
    return max((len(str(token).encode("utf-8", "surrogatepass")) for token in tokenizer.get_vocab()), default=1)


def text_bytes(value: Any) -> int:
    """The UTF-8 bytes of every string in value (messages, tools; keys left out, which can only count fewer)."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, dict):
        return sum(text_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_bytes(item) for item in value)
    return 0


class AnswerSpan(NamedTuple):
    """Where an assistant turn's trained text lies in a render (character offsets), and whether EOS follows it."""

    start: int
    end: int
    add_eos: bool  # a plain-text turn end: EOS is appended so the model still learns to stop


class Segment(NamedTuple):
    """A stretch of the rendered conversation: trained (an answer) or not, and whether EOS follows it."""

    text: str
    trained: bool
    add_eos: bool


class RenderedAnswers(NamedTuple):
    """A conversation's text and the spans of its answers in it."""

    text: str
    spans: list[AnswerSpan]


class TokenizedConversation(NamedTuple):
    """Token ids and their labels (-100 where untrained)."""

    input_ids: list[int]
    labels: list[int]


class ConversationTokenizer:
    """Token ids and labels of a conversation rendered by a chat template, for any template.

    The whole conversation is rendered once with the model's own template (as transformers would
    render it); each assistant message is then found in that text by character offsets and its
    span is trained: from where the model starts writing (after the template's generation
    prompt) through the content, reasoning and tool calls the template renders, up to and
    including the turn-end token (`turn_end_text`). System, user and tool text is never
    trained. Where the render starts with `apply_chat_template(messages[:k],
    add_generation_prompt=True)`, the answer's prompt is exactly the inference prompt; templates
    that render earlier turns differently (Qwen3 drops reasoning before the last user turn,
    Mistral moves the system prompt into the last user turn) are handled by finding the
    template's generation header before the answer instead of requiring growing prefixes.

    keep_after_turn_end keeps what the template renders after the last answer's turn end (ChatML's
    "\n"): a reward model reads its score at the last token, at the end of the whole turn, as
    transformers' and TRL's reward models read it. after_turn_end_ids() is what that adds, and what PPO
    appends to a generated answer before scoring it."""

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", template: str, max_length: int,
                 train_on_last_turn_only: bool = False, keep_after_turn_end: bool = False,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.max_length = max_length
        self.last_turn_only = train_on_last_turn_only
        self.keep_after_turn_end = keep_after_turn_end
        self.template_kwargs = dict(template_kwargs or {})
        if tokenizer.eos_token is None:
            raise InputError("the tokenizer has no eos_token: answers could not end")
        self.turn_end, self.turn_end_is_special = turn_end_text(tokenizer, template, self.template_kwargs)
        self.specials = special_token_texts(tokenizer)  # what a record's text may not turn into (control_text)
        self.notes: dict[str, int] = {}  # what the template does differently from inference, counted once per build

    def render(self, messages: list[Message], add_generation_prompt: bool, tools: Tools | None = None,
               where: str = "a conversation") -> str:
        try:
            return render_text(
                self.tokenizer, messages, chat_template=self.template, add_generation_prompt=add_generation_prompt,
                tools=tools, **self.template_kwargs,
            )
        except TemplateError as err:  # the template's own raise_exception (roles it does not support, ...)
            raise InputError(f"{where}: the chat template refuses this conversation ({err})") from None

    def segments(self, where: str, messages: list[Message], tools: Tools | None = None) -> list[Segment]:
        """The segments covering the conversation up to its last answer's turn end (with keep_after_turn_end, up
        to the end of the render)."""
        whole = self.render(messages, add_generation_prompt=False, tools=tools, where=where)
        answers = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        spans = self.answer_spans(where, whole, messages, answers, tools)
        prompt = self.render(messages[:answers[-1]], add_generation_prompt=True, tools=tools, where=where)
        text = whole
        if not whole.startswith(prompt):
            text, spans = self.on_inference_prompt(where, whole, prompt, spans, messages, answers, tools)
        start, end, add_eos = spans[-1]
        if self.keep_after_turn_end and not add_eos:  # an appended EOS ends the row itself: nothing follows it
            spans[-1] = AnswerSpan(start, len(text), add_eos)
        segments, position = [], 0
        for turn, (start, end, add_eos) in enumerate(spans):
            trained = not self.last_turn_only or turn == len(spans) - 1
            segments += [Segment(text[position:start], False, False), Segment(text[start:end], trained, add_eos)]
            position = end
        return segments

    def answer_spans(self, where: str, text: str, messages: list[Message], answers: list[int],
                     tools: Tools | None) -> list[AnswerSpan]:
        spans, position = [], 0
        for index in answers:
            spans.append(self.answer_span(where, text, position, messages, index, tools))
            position = spans[-1].end
        return spans

    def on_inference_prompt(self, where: str, whole: str, prompt: str, spans: list[AnswerSpan], messages: list[Message],
                            answers: list[int], tools: Tools | None) -> RenderedAnswers:
        """The template renders the last answer's prompt differently in a finished conversation than
        as the inference prompt (Mistral-Nemo drops the system prompt unless the last turn is the
        user's; the DeepSeek-R1 distills' generation prompt opens a think block): train on the
        inference prompt itself, followed by the last answer as the conversation renders it, so
        the model learns to answer the prompt it will be given."""
        last = answers[-1]
        if messages[last].get("reasoning_content"):
            raise InputError(f"{where}: turn {last} (assistant): field 'reasoning_content': the template's "
                             "generation prompt leaves no reasoning for the model to write (is enable_thinking false?)")
        self.note("prompt", f"the chat template renders a finished conversation's last prompt as "
                            f"{whole[max(0, spans[-1].start - 40):spans[-1].start]!r} but the inference prompt as "
                            f"{prompt[-40:]!r}: answers are trained after the inference prompt")
        start, end, add_eos = spans[-1]
        tail = whole[end:] if self.keep_after_turn_end and not add_eos else ""
        text = prompt + whole[start:end] + tail
        earlier = self.answer_spans(where, prompt, messages[:last], answers[:-1], tools)
        return RenderedAnswers(text, earlier + [AnswerSpan(len(prompt), len(prompt) + end - start, add_eos)])

    def answer_span(self, where: str, text: str, position: int, messages: list[Message], index: int,
                    tools: Tools | None) -> AnswerSpan:
        """The span of assistant message `index` in the rendered text, at or after
        `position` (the end of the previous answer)."""
        message = messages[index]
        prompt = self.render(messages[:index], add_generation_prompt=True, tools=tools)
        if len(prompt) >= position and text.startswith(prompt):
            start = len(prompt)
        else:
            start = self.header_end(text, position, messages, index, tools)
        where_turn = f"{where}: turn {index} (assistant)"
        anchor = self.find_body(where_turn, text, start, message, last=index == len(messages) - 1)
        end = text.find(self.turn_end, anchor)
        if end < 0:
            raise InputError(f"{where_turn}: the chat template does not close this answer with {self.turn_end!r}")
        # A plain-text turn end gets EOS appended, so the model still learns to stop.
        return AnswerSpan(start, end + len(self.turn_end), not self.turn_end_is_special)

    def header_end(self, text: str, position: int, messages: list[Message], index: int, tools: Tools | None) -> int:
        """Where the assistant starts writing when the render is not a growing prefix: after the
        longest head of the template's generation header (what add_generation_prompt adds) found
        between the turns before the answer and the answer's own first text; at that text if the
        header is not there (a template whose generation prompt adds nothing, like Mistral's)."""
        with_header = self.render(messages[:index], add_generation_prompt=True, tools=tools)
        without = self.render(messages[:index], add_generation_prompt=False, tools=tools)
        header = with_header[len(os.path.commonprefix([with_header, without])):]
        cursor = position
        for previous in messages[index - 1::-1]:
            if previous["role"] in ("assistant", "system"):
                break
            found = text.find(previous["content"], cursor) if previous["content"] else -1
            cursor = found + len(previous["content"]) if found >= 0 else cursor
        message = messages[index]
        pieces = [message.get("reasoning_content") or "", message["content"], message["content"].strip()]
        pieces += [call["function"]["name"] for call in message.get("tool_calls") or []]
        starts = [text.find(piece.strip(), cursor) for piece in pieces if piece.strip()]
        body = min((at for at in starts if at >= 0), default=len(text))
        for size in range(len(header), 0, -1):
            at = text.rfind(header[:size], cursor, body)
            if at >= 0:
                return at + size
        return body

    def find_body(self, where_turn: str, text: str, start: int, message: Message, last: bool) -> int:
        """The end of what the answer itself renders (reasoning, content, tool calls) after start."""
        anchor = start
        reasoning = (message.get("reasoning_content") or "").strip()
        content = message["content"]
        content_at = -1
        for candidate in (content, content.strip()):
            if candidate and content_at < 0:
                content_at, found = text.find(candidate, start), candidate
        if content.strip() and content_at < 0:
            raise InputError(f"{where_turn}: the chat template does not render this answer's content verbatim; "
                             "choose a --template")
        if content_at >= 0:
            anchor = content_at + len(found)
        if reasoning:
            reasoning_at = text.find(reasoning, start)
            if not 0 <= reasoning_at < (content_at if content_at >= 0 else len(text)):
                if last:
                    raise InputError(f"{where_turn}: field 'reasoning_content': the chat template does not render "
                                     "reasoning; put it in the content or choose a template that renders it")
                self.note("reasoning", "the chat template drops reasoning_content of answers before the last user "
                                       "turn (as Qwen3's does): those answers are trained without it")
        for call in message.get("tool_calls") or []:
            name = call["function"]["name"]
            found_at = text.find(name, anchor)
            if found_at < 0:
                raise InputError(f"{where_turn}: field 'tool_calls': the chat template does not render tool call "
                                 f"'{name}'; choose a template that supports tools")
            anchor = found_at + len(name)
        return anchor

    @functools.cached_property
    def record_byte_limit(self) -> int:
        """The most bytes of text a record may hold and still be tokenized (RECORD_BYTES_MARGIN): read from the
        vocabulary once, in the process that builds the data (forked workers inherit it)."""
        return RECORD_BYTES_MARGIN * self.max_length * max_token_bytes(self.tokenizer)

    def too_large(self, messages: list[Message], tools: Tools | None = None) -> bool:
        """Whether a conversation holds more text than max_length tokens could: a 50 MB record took a minute and
        gigabytes to tokenize only to be cut to max_length; such a one is dropped before it is rendered."""
        return text_bytes(messages) + text_bytes(tools) > self.record_byte_limit

    def note(self, kind: str, message: str) -> None:
        """Count a by-design difference between training and inference renders; logged once."""
        if kind not in self.notes:
            logger.warning("%s", message)
        self.notes[kind] = self.notes.get(kind, 0) + 1

    def __call__(self, where: str, messages: list[Message], tools: Tools | None = None) -> dict[str, Any] | None:
        """{"input_ids", "labels", "control_text": whether the record's text held a special token's text (encoded
        as text: records.control_text), "cut_answer": whether max_length cut into the last answer kept, which so
        loses its turn end}, or None when no answer token fits in max_length."""
        messages, tools, marked = marked_conversation(self.specials, messages, tools)
        segments = self.segments(where, messages, tools)
        segments, protected = unmarked_segments(segments) if marked else UnmarkedSegments(segments, [])
        if getattr(self.tokenizer, "is_fast", False):
            input_ids, labels = self.tokenize_whole(segments, protected)
        else:
            input_ids, labels = self.tokenize_by_segment(segments, protected)
        # Keep the prompt's head and cut the answer; a sample left without an answer token is dropped. The cut falls
        # inside an answer where trained tokens lie on both sides of it (answers never touch: a prompt lies between).
        cut_answer = len(labels) > self.max_length and -100 not in labels[self.max_length - 1 : self.max_length + 1]
        input_ids, labels = input_ids[: self.max_length], labels[: self.max_length]
        if all(label == -100 for label in labels):
            return None
        return {"input_ids": input_ids, "labels": labels, "control_text": marked, "cut_answer": cut_answer}

    def prompt_ids(self, where: str, messages: list[Message], tools: Tools | None = None) -> list[int]:
        """The ids of the inference prompt of messages (the generation prompt after them), as serving encodes it."""
        return encode_prompt(self.tokenizer, self.specials, lambda rendered_messages, rendered_tools: self.render(
            rendered_messages, add_generation_prompt=True, tools=rendered_tools, where=where), messages, tools)

    def answer_end_id(self) -> int:
        """The id of the token that ends an answer: the template's turn-end token, else EOS."""
        token = first_special_token(self.turn_end, special_token_texts(self.tokenizer)) if self.turn_end_is_special \
            else None
        # One token (a str) converts to one id; transformers types the call for a list of tokens too.
        return cast(int, self.tokenizer.convert_tokens_to_ids(token)) if token else self.tokenizer.eos_token_id

    def after_turn_end_ids(self) -> list[int]:
        """The ids the template puts after an answer's EOS to close its turn (empty for templates
        that end a turn at EOS): what a row of keep_after_turn_end adds to one without it."""
        probe = [{"role": "user", "content": "1 + 1 ="}, {"role": "assistant", "content": "2"}]
        with_end = ConversationTokenizer(self.tokenizer, self.template, 1 << 30, keep_after_turn_end=True,
                                         template_kwargs=self.template_kwargs)
        at_eos = ConversationTokenizer(self.tokenizer, self.template, 1 << 30, template_kwargs=self.template_kwargs)
        whole_row, short_row = with_end("turn end probe", probe), at_eos("turn end probe", probe)
        assert whole_row is not None and short_row is not None  # max_length 1 << 30 keeps the probe's answer
        whole, short = whole_row["input_ids"], short_row["input_ids"]
        if whole[: len(short)] != short:
            raise InputError("the chat template's turn end changes how the answer before it is tokenized; "
                             "choose a --template")
        return whole[len(short):]

    def tokenize_whole(self, segments: list[Segment], protected: list[CharRange]) -> TokenizedConversation:
        """Tokenize the rendered conversation as one string (as inference encodes a prompt: no
        tokenizer-added prefix in front of each segment) and label tokens by character offsets.
        protected: where the record's own special-token texts lie (encoded as text)."""
        text = "".join(segment.text for segment in segments)
        starts, position = [], 0
        for segment in segments:
            starts.append(position)
            position += len(segment.text)
        encoding = encode_protected(self.tokenizer, text, protected)
        input_ids, labels = [], []
        pending_eos = None  # a segment needing an extra EOS, emitted before the first token past it
        for token, (start, _) in zip(encoding.input_ids, encoding.offsets, strict=True):
            index = bisect_right(starts, start) - 1
            if pending_eos is not None and pending_eos != index:
                self.append_eos(input_ids, labels, segments[pending_eos].trained)
                pending_eos = None
            input_ids.append(token)
            labels.append(token if segments[index].trained else -100)
            if segments[index].add_eos:
                pending_eos = index
        if pending_eos is not None:
            self.append_eos(input_ids, labels, segments[pending_eos].trained)
        return TokenizedConversation(input_ids, labels)

    def append_eos(self, input_ids: list[int], labels: list[int], trained: bool) -> None:
        input_ids.append(self.tokenizer.eos_token_id)
        labels.append(self.tokenizer.eos_token_id if trained else -100)

    def tokenize_by_segment(self, segments: list[Segment], protected: list[CharRange]) -> TokenizedConversation:
        """Slow tokenizers have no offsets: tokenize segment by segment."""
        input_ids, labels, position = [], [], 0
        for text, trained, add_eos in segments:
            inside = [(start - position, end - position) for start, end in protected
                      if position <= start < position + len(text)]
            ids = encode_protected(self.tokenizer, text, inside).input_ids if text else []
            position += len(text)
            ids += [self.tokenizer.eos_token_id] if add_eos else []
            input_ids += ids
            labels += ids if trained else [-100] * len(ids)
        return TokenizedConversation(input_ids, labels)




class UnmarkedSegments(NamedTuple):
    """A render's segments without markers, and the ranges of the record's own special-token texts in them."""

    segments: list[Segment]
    protected: list[CharRange]


def unmarked_segments(segments: list[Segment]) -> UnmarkedSegments:
    """Segments of a marked render (records.control_text) without their markers, and where the record's own
    special-token texts lie in their joined text. A marked token never spans two segments: a segment boundary sits at
    the template's own text (a generation prompt, a turn end)."""
    clean, protected, position = [], [], 0
    for segment in segments:
        text, inside = unmark(segment.text)
        protected += [(position + start, position + end) for start, end in inside]
        clean.append(segment._replace(text=text))
        position += len(text)
    return UnmarkedSegments(clean, protected)
