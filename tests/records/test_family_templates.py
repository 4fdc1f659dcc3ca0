"""SFT masking with the real chat templates of the families users bring (Llama-3.1, Qwen2.5,
Qwen3, Mistral-Nemo, Phi-3.5, Gemma-2, a DeepSeek-R1 distill; GPT-2 with a named template), on
their real tokenizers: the trained tokens are exactly each answer and the token that closes its
turn, nothing of the system, user or tool turns, and the last answer's prompt is the inference
prompt."""

import pytest
from transformers import AutoTokenizer

from helpers.families import family_tokenizer_dir
from lorakit.core.cli import InputError
from lorakit.data.conversation_tokenizer import ConversationTokenizer
from lorakit.records.chat_templates import named_template, parse_template_kwargs
from lorakit.records.readers import conversation_of

# The token each family's template closes an assistant turn with.
TURN_END = {"llama3": "<|eot_id|>", "qwen2.5": "<|im_end|>", "qwen3": "<|im_end|>", "mistral": "</s>",
            "phi3.5": "<|end|>", "gemma2": "<end_of_turn>", "deepseek-r1-qwen": "<｜end▁of▁sentence｜>",
            "gpt2": "<|endoftext|>"}
# What each template renders of an answer before its turn end, beyond the content itself:
# Qwen3 opens the answer after the last user turn with an (empty) think block; GPT-2 has no
# template of its own and trains with the named chatml one, whose <|im_end|> is plain text there.
LAST_ANSWER_HEAD = {"qwen3": "<think>\n\n</think>\n\n"}
ANSWER_TAIL = {"gpt2": "<|im_end|>"}
SUPPORTS_SYSTEM = {name for name in TURN_END if name != "gemma2"}
RENDERS_TOOLS = {"llama3", "qwen2.5", "qwen3", "mistral", "deepseek-r1-qwen"}

SYSTEM = "You are terse. 请简短回答。"
MULTI_TURN = [{"role": "user", "content": "第一个问题：一加一？"},
              {"role": "assistant", "content": "First answer: 二."},
              {"role": "user", "content": "And the second question?"},
              {"role": "assistant", "content": "Second answer, 第二个。"}]
TOOL_CALL = {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_TURNS = [{"role": "user", "content": "What is the weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
              {"role": "tool", "content": "22C and clear skies", "tool_call_id": "call00001", "name": "get_weather"},
              {"role": "assistant", "content": "It is warm and sunny."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module", params=sorted(TURN_END))
def family(request):
    tokenizer = AutoTokenizer.from_pretrained(family_tokenizer_dir(request.param))
    template = tokenizer.chat_template or named_template("chatml", tokenizer)
    return request.param, tokenizer, template


def trained_runs(sample) -> list:
    """Token ids of each contiguous trained run."""
    runs, current = [], []
    for token, label in zip(sample["input_ids"], sample["labels"], strict=True):
        if label == -100:
            runs, current = (runs + [current], []) if current else (runs, current)
        else:
            assert label == token
            current.append(token)
    return runs + ([current] if current else [])


def expected_answer(name, content, last) -> str:
    return (LAST_ANSWER_HEAD.get(name, "") if last else "") + content + ANSWER_TAIL.get(name, "") + TURN_END[name]


def assert_inference_prompt(tokenizer, template, messages, sample, tools=None, **kwargs):
    """The tokens before the last answer are the inference prompt's tokens, and its trained run
    starts right after them."""
    prompt = tokenizer.apply_chat_template(messages[:-1], chat_template=template, tokenize=False,
                                           add_generation_prompt=True, tools=tools, **kwargs)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert sample["input_ids"][: len(prompt_ids)] == prompt_ids
    assert sample["labels"][len(prompt_ids) - 1] == -100 and sample["labels"][len(prompt_ids)] != -100


@pytest.mark.parametrize("with_system", [False, True])
def test_multi_turn_labels_are_the_answers_and_their_turn_end(family, with_system):
    name, tokenizer, template = family
    if with_system and name not in SUPPORTS_SYSTEM:
        with pytest.raises(InputError, match=r"t:1: the chat template refuses this conversation"):
            ConversationTokenizer(tokenizer, template, 4096)(
                "t:1", [{"role": "system", "content": SYSTEM}] + MULTI_TURN)
        return
    messages = conversation_of("t:1", {"messages": ([{"role": "system", "content": SYSTEM}] if with_system else [])
                                       + MULTI_TURN})
    sample = ConversationTokenizer(tokenizer, template, 4096)("t:1", messages)
    runs = [tokenizer.decode(run) for run in trained_runs(sample)]
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert runs == [expected_answer(name, a, last=i == len(answers) - 1) for i, a in enumerate(answers)]
    assert_inference_prompt(tokenizer, template, messages, sample)


def test_train_on_last_turn_only_keeps_the_ids(family):
    name, tokenizer, template = family
    full = ConversationTokenizer(tokenizer, template, 4096)("t:1", MULTI_TURN)
    last = ConversationTokenizer(tokenizer, template, 4096, train_on_last_turn_only=True)("t:1", MULTI_TURN)
    assert last["input_ids"] == full["input_ids"]
    assert trained_runs(last) == trained_runs(full)[-1:]


def test_reasoning_is_trained_where_the_template_renders_it(family):
    name, tokenizer, template = family
    messages = [dict(m) for m in MULTI_TURN]
    messages[1]["reasoning_content"] = "earlier reasoning"
    messages[3]["reasoning_content"] = "Let me think: 二加二。"
    conversation_tokenizer = ConversationTokenizer(tokenizer, template, 4096)
    if name != "qwen3":
        with pytest.raises(InputError, match=r"t:7: turn 3 \(assistant\): field 'reasoning_content'"):
            conversation_tokenizer("t:7", messages)
        return
    sample = conversation_tokenizer("t:7", messages)
    runs = [tokenizer.decode(run) for run in trained_runs(sample)]
    # Qwen3 drops the reasoning of answers before the last user turn: that answer trains without it.
    assert runs == ["First answer: 二.<|im_end|>",
                    "<think>\nLet me think: 二加二。\n</think>\n\nSecond answer, 第二个。<|im_end|>"]
    assert conversation_tokenizer.notes == {"reasoning": 1}
    assert_inference_prompt(tokenizer, template, messages, sample)


def test_tool_calls_are_trained_and_tool_results_are_not(family):
    name, tokenizer, template = family
    conversation_tokenizer = ConversationTokenizer(tokenizer, template, 4096)
    if name not in RENDERS_TOOLS:
        with pytest.raises(InputError,
                           match=r"^t:3: (turn 1 \(assistant\): field 'tool_calls'|the chat template refuses)"):
            conversation_tokenizer("t:3", TOOL_TURNS, TOOLS)
        return
    sample = conversation_tokenizer("t:3", TOOL_TURNS, TOOLS)
    runs = [tokenizer.decode(run) for run in trained_runs(sample)]
    assert len(runs) == 2
    assert "get_weather" in runs[0] and "Paris" in runs[0] and runs[0].endswith(TURN_END[name])
    assert runs[1] == expected_answer(name, "It is warm and sunny.", last=True)
    assert not any("22C" in run or "weather in Paris" in run or "Weather of a city" in run for run in runs)
    assert_inference_prompt(tokenizer, template, TOOL_TURNS, sample, tools=TOOLS)


def test_qwen3_without_thinking_trains_the_answer_after_the_empty_think_block():
    tokenizer = AutoTokenizer.from_pretrained(family_tokenizer_dir("qwen3"))
    kwargs = parse_template_kwargs(None, enable_thinking=False)
    sample = ConversationTokenizer(tokenizer, tokenizer.chat_template, 4096, template_kwargs=kwargs)("t:1", MULTI_TURN)
    runs = [tokenizer.decode(run) for run in trained_runs(sample)]
    # The inference prompt itself ends with "<think>\n\n</think>\n\n": the model writes the answer only.
    assert runs == ["First answer: 二.<|im_end|>", "Second answer, 第二个。<|im_end|>"]
    assert_inference_prompt(tokenizer, tokenizer.chat_template, MULTI_TURN, sample, enable_thinking=False)


@pytest.mark.parametrize("name, conversation", [("deepseek-r1-qwen", MULTI_TURN),
                                                ("mistral", [{"role": "system", "content": SYSTEM}] + MULTI_TURN)])
def test_a_last_prompt_rendered_unlike_inference_is_trained_on_the_inference_prompt(name, conversation, caplog):
    """The R1 distill's generation prompt opens a think block its render of a finished
    conversation lacks; Mistral-Nemo's template drops the system prompt unless the conversation
    ends on the user's turn. The last answer is trained right after the inference prompt (the
    system prompt kept), and the difference is logged, not silent."""
    tokenizer = AutoTokenizer.from_pretrained(family_tokenizer_dir(name))
    conversation_tokenizer = ConversationTokenizer(tokenizer, tokenizer.chat_template, 4096)
    with caplog.at_level("WARNING"):
        sample = conversation_tokenizer("t:1", conversation)
    assert conversation_tokenizer.notes == {"prompt": 1}
    assert "inference prompt" in caplog.text
    assert_inference_prompt(tokenizer, tokenizer.chat_template, conversation, sample)
    assert tokenizer.decode(trained_runs(sample)[-1]) == expected_answer(name, "Second answer, 第二个。", last=True)
    if name == "mistral":
        assert SYSTEM in tokenizer.decode(sample["input_ids"])


def test_an_answer_the_template_does_not_render_verbatim_is_refused():
    tokenizer = AutoTokenizer.from_pretrained(family_tokenizer_dir("deepseek-r1-qwen"))
    messages = MULTI_TURN[:-1] + [{"role": "assistant", "content": "<think>hidden</think>visible"}]
    with pytest.raises(InputError, match=r"^t:9: turn 3 \(assistant\): the chat template does not render this "
                                         r"answer's content verbatim"):
        ConversationTokenizer(tokenizer, tokenizer.chat_template, 4096)("t:9", messages)


def test_sharegpt_function_call_and_observation_map_to_tool_turns():
    record = {"conversations": [{"from": "human", "value": "weather?"},
                                {"from": "function_call",
                                 "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
                                {"from": "observation", "value": "22C"}, {"from": "gpt", "value": "Warm."}],
              "tools": '[{"type": "function", "function": {"name": "get_weather"}}]'}
    messages = conversation_of("s:1", record)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["tool_calls"] == [{"type": "function",
                                          "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    with pytest.raises(InputError, match=r"s:2: field 'conversations\[1\]': the tool turn cannot follow a user turn"):
        conversation_of("s:2", {"conversations": record["conversations"][:1] + record["conversations"][2:]})
