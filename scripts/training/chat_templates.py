"""Chat templates as Jinja strings, the form transformers stores in a tokenizer's
`chat_template`: the one used in training is saved with the tokenizer, so inference renders
prompts exactly as training did.

Each named template ends every assistant turn with the tokenizer's EOS, so the model learns to
stop; the conversation's tokens are the template's rendering, nothing inserted around it."""

import logging
from typing import Optional

from training_utils import InputError

logger = logging.getLogger(__name__)

# Chinese-LLaMA-Alpaca-2's default system prompt.
LLAMA2_SYSTEM_PROMPT = "You are a helpful assistant. 你是一个乐于助人的助手。"
ALPACA_SYSTEM_PROMPT = "Below is an instruction that describes a task. Write a response that appropriately completes the request."

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


def named_template(name: str, tokenizer) -> str:
    if name not in TEMPLATES:
        raise InputError(f"--template {name} is unknown; choose one of: {', '.join(sorted(TEMPLATES))}")
    adds_bos = bool(tokenizer("", add_special_tokens=True)["input_ids"]) and tokenizer.bos_token is not None
    return TEMPLATES[name].replace("{bos}", "{{ bos_token }}" if adds_bos else "")


def resolve_template(requested: Optional[str], tokenizer, log) -> tuple:
    """(name, jinja) of the template to train with: --template, else the tokenizer's own, else llama2."""
    if requested:
        return requested, named_template(requested, tokenizer)
    if tokenizer.chat_template:
        return "tokenizer", tokenizer.chat_template
    log.info("the tokenizer has no chat_template: using the llama2 template")
    return "llama2", named_template("llama2", tokenizer)


def use_template(requested: Optional[str], tokenizer) -> str:
    """Resolve the template and set it as the tokenizer's chat_template: saved with every
    adapter, so inference renders prompts exactly as training did."""
    name, template = resolve_template(requested, tokenizer, logger)
    logger.info("chat template: %s", name)
    tokenizer.chat_template = template
    return template
