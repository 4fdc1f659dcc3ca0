"""Chat templates as Jinja strings, the form transformers stores in a tokenizer's
`chat_template`: the one used in training is saved with the tokenizer, so inference renders
prompts exactly as training did.

Each named template ends every assistant turn with the tokenizer's EOS, so the model learns to
stop; the conversation's tokens are the template's rendering, nothing inserted around it."""

import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from lorakit.core.cli import InputError, read_json
from lorakit.core.model_files import TEMPLATE_KWARGS_FILE

if TYPE_CHECKING:  # for annotations only: the record readers stay free of transformers (and torch)
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Chinese-LLaMA-Alpaca-2's default system prompt.
LLAMA2_SYSTEM_PROMPT = "You are a helpful assistant. 你是一个乐于助人的助手。"
ALPACA_SYSTEM_PROMPT = ("Below is an instruction that describes a task. "
                        "Write a response that appropriately completes the request.")

# {bos} is replaced by "{{ bos_token }}" for tokenizers that put BOS before every text, and by
# nothing for those that do not (the template then renders what the tokenizer would encode).
TEMPLATES = {
    # Meta's Llama-2 chat format, as Chinese-LLaMA-Alpaca-2 trains it.
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
        "{% set turns = messages[1:] %}{% else %}"
        "{% set system = '" + LLAMA2_SYSTEM_PROMPT + "' %}{% set turns = messages %}{% endif %}"
        "{% for message in turns %}"
        "{% if message['role'] == 'user' %}"
        "{% if loop.first %}{bos}[INST] <<SYS>>\n{{ system }}\n<</SYS>>\n\n{{ message['content'] }} [/INST]"
        "{% else %}{bos}[INST] {{ message['content'] }} [/INST]{% endif %}"
        "{% else %} {{ message['content'] }} {{ eos_token }}{% endif %}"
        "{% endfor %}"
    ),
    "alpaca": (
        "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
        "{% set turns = messages[1:] %}{% else %}"
        "{% set system = '" + ALPACA_SYSTEM_PROMPT + "' %}{% set turns = messages %}{% endif %}"
        "{bos}{{ system }}\n\n"
        "{% for message in turns %}"
        "{% if message['role'] == 'user' %}### Instruction:\n{{ message['content'] }}\n\n### Response:\n"
        "{% else %}{{ message['content'] }}{{ eos_token }}\n\n{% endif %}"
        "{% endfor %}"
    ),
    "chatml": (
        "{bos}{% for message in messages %}"
        "{% if message['role'] == 'assistant' %}<|im_start|>assistant\n{{ message['content'] }}"
        "{% if eos_token != '<|im_end|>' %}<|im_end|>{% endif %}{{ eos_token }}\n"
        "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # DeepSpeed-Chat's format: " Human: ... Assistant: ...".
    "human_assistant": (
        "{bos}{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ message['content'] }}"
        "{% elif message['role'] == 'user' %} Human: {{ message['content'] }}"
        "{% if not loop.last or add_generation_prompt %} Assistant:{% endif %}"
        "{% else %} {{ message['content'] }}{{ eos_token }}{% endif %}"
        "{% endfor %}"
    ),
}


def named_template(name: str, tokenizer: "PreTrainedTokenizerBase") -> str:
    if name not in TEMPLATES:
        raise InputError(f"--template {name} is unknown; choose one of: {', '.join(sorted(TEMPLATES))}")
    adds_bos = bool(tokenizer("", add_special_tokens=True)["input_ids"]) and tokenizer.bos_token is not None
    return TEMPLATES[name].replace("{bos}", "{{ bos_token }}" if adds_bos else "")


class ResolvedTemplate(NamedTuple):
    """A chat template and where it came from: a --template name, or "tokenizer" for the tokenizer's own."""

    name: str
    text: str  # the Jinja source


def resolve_template(requested: str | None, tokenizer: "PreTrainedTokenizerBase",
                     log: logging.Logger) -> ResolvedTemplate:
    """The template to train with: --template, else the tokenizer's own, else llama2."""
    if requested:
        return ResolvedTemplate(requested, named_template(requested, tokenizer))
    if tokenizer.chat_template:
        return ResolvedTemplate("tokenizer", tokenizer.chat_template)
    log.info("the tokenizer has no chat_template: using the llama2 template")
    return ResolvedTemplate("llama2", named_template("llama2", tokenizer))


@dataclass(frozen=True)
class ChatTemplate:
    """The chat template a run renders with, and the keyword arguments it renders with."""

    text: str
    kwargs: dict[str, Any]


def use_template(requested: str | None, tokenizer: "PreTrainedTokenizerBase",
                 template_kwargs: dict[str, Any] | None = None) -> ChatTemplate:
    """Resolve the template; every consumer takes it from what this returns. The tokenizer gets a
    copy only to save it: save_pretrained writes its chat_template and save_template_kwargs the
    keyword arguments, with every adapter, so inference renders prompts exactly as training did."""
    name, template = resolve_template(requested, tokenizer, logger)
    logger.info("chat template: %s%s", name, f" with {template_kwargs}" if template_kwargs else "")
    chat_template = ChatTemplate(template, dict(template_kwargs or {}))
    tokenizer.chat_template = chat_template.text
    tokenizer.chat_template_kwargs = chat_template.kwargs
    return chat_template


def save_template_kwargs(tokenizer: "PreTrainedTokenizerBase", directory: str) -> None:
    kwargs = getattr(tokenizer, "chat_template_kwargs", None)
    if kwargs:
        with open(os.path.join(directory, TEMPLATE_KWARGS_FILE), "w", encoding="utf-8") as handle:
            json.dump(kwargs, handle, indent=2)


def saved_template_kwargs(directory: str | None) -> dict[str, Any]:
    """The template keyword arguments training saved next to a tokenizer ({} if none)."""
    path = os.path.join(directory, TEMPLATE_KWARGS_FILE) if directory else ""
    if not os.path.isfile(path):
        return {}
    return read_json(path, TEMPLATE_KWARGS_FILE)


def special_token_texts(tokenizer: "PreTrainedTokenizerBase") -> list[str]:
    """Every special token's text (the tokenizer's named ones and added tokens marked special),
    longest first so a search finds `<|im_end|>` before a shorter token inside it."""
    texts = set(tokenizer.all_special_tokens)
    texts.update(token.content for token in tokenizer.added_tokens_decoder.values() if token.special)
    return sorted((text for text in texts if text), key=len, reverse=True)


def first_special_token(text: str, specials: list[str]) -> str | None:
    """The special token that occurs first in text (None if none does)."""
    found = [(text.find(token), -len(token), token) for token in specials if token in text]
    return min(found)[2] if found else None


class TurnEnd(NamedTuple):
    """What a template writes to close an assistant turn, and whether it ends on a special token."""

    text: str
    special: bool


def render_text(tokenizer: "PreTrainedTokenizerBase", messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """The text tokenizer.apply_chat_template(messages, tokenize=False, **kwargs) renders."""
    # transformers types the result as every form the call can return (ids, a BatchEncoding); untokenized it is str.
    return cast(str, tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))


def turn_end_text(tokenizer: "PreTrainedTokenizerBase", template: str,
                  template_kwargs: dict[str, Any] | None = None) -> TurnEnd:
    """The text and special flag with which the template closes an assistant turn: the text after an
    answer up to and including the first special token (EOS for most; `<|im_end|>` for ChatML
    with another EOS, `<|eot_id|>` for Llama-3, `<end_of_turn>` for Gemma, `<|end|>` for Phi-3),
    special=True. A template that writes no special token there (a plain-text format) gives what
    it writes after the answer, whitespace-trimmed, and special=False: training then appends EOS
    so the model still learns to stop."""
    sentinel = "\u2063answer\u2063"
    rendered = render_text(
        tokenizer, [{"role": "user", "content": "q"}, {"role": "assistant", "content": sentinel}],
        chat_template=template, **(template_kwargs or {}),
    )
    after = rendered.split(sentinel, 1)[-1]
    special = first_special_token(after, special_token_texts(tokenizer))
    if special is None:
        return TurnEnd(after.rstrip(), False)
    return TurnEnd(after[: after.index(special) + len(special)], True)


def parse_template_kwargs(template_kwargs: str | None, enable_thinking: bool | None) -> dict[str, Any]:
    """--template_kwargs (a JSON object) and --enable_thinking as the keyword arguments the chat
    template is rendered with, in training and in serving alike."""
    kwargs = {}
    if template_kwargs:
        try:
            kwargs = json.loads(template_kwargs)
        except json.JSONDecodeError as err:
            raise InputError(f"--template_kwargs {template_kwargs!r}: not valid JSON ({err.msg})") from None
        if not isinstance(kwargs, dict):
            raise InputError(f"--template_kwargs {template_kwargs!r}: must be a JSON object such as "
                             '\'{"enable_thinking": false}\'')
    if enable_thinking is not None:
        if "enable_thinking" in kwargs and kwargs["enable_thinking"] != enable_thinking:
            raise InputError("--enable_thinking and --template_kwargs' enable_thinking disagree: give one")
        kwargs["enable_thinking"] = enable_thinking
    return kwargs
