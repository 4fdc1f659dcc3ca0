"""Chat CLI, batch generation and the OpenAI-compatible server, on the tiny model: every answer
is checked against a direct greedy model.generate on the same rendered prompt."""

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers.commands import REPO, assert_ok, check_refused, free_port, refuse, run_in_process, script_env
from lorakit.records.chat_templates import named_template, use_template
from lorakit.serve.inference import PromptTooLong, template_turn_end, trim_history

INFERENCE = os.path.join(REPO, "scripts", "inference")
CHAT_SCRIPT = os.path.join(INFERENCE, "chat.py")
SERVER_SCRIPT = os.path.join(INFERENCE, "openai_api_server.py")
API_KEY = "test-key-123"
MODEL_NAME = "tiny-chat"
GREEDY = ["--temperature", "0", "--repetition_penalty", "1.0"]


# ----------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory, tiny_model_dir):
    """A LoRA adapter with random (non-zero) weights, saved with a templated tokenizer as SFT
    saves sft_lora_model (the base's own tokenizer has no template). The tiny base alone answers
    nearly every prompt alike; the random adapter makes its greedy answers differ per prompt, so
    an answer equal to the reference's shows the prompt was rendered the same."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, config)
    out = tmp_path_factory.mktemp("lora")
    model.save_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    use_template("human_assistant", tokenizer)
    tokenizer.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory, tiny_model_dir, lora_dir):
    """The same adapter merged into the base, saved with the templated tokenizer."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    out = tmp_path_factory.mktemp("chat_model")
    PeftModel.from_pretrained(base, lora_dir).merge_and_unload().save_pretrained(str(out))
    AutoTokenizer.from_pretrained(lora_dir).save_pretrained(str(out))
    return str(out)


class Reference:
    """Direct model.generate, greedy, on a prompt rendered by the tokenizer's chat template."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model.eval(), tokenizer

    def chat_ids(self, messages):
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompt_ids, max_new_tokens):
        """(text, generated ids, stopped on EOS)."""
        with torch.no_grad():
            output = self.model.generate(
                input_ids=torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=self.tokenizer.eos_token_id,
                pad_token_id=self.tokenizer.eos_token_id,
            )[0, len(prompt_ids):].tolist()
        return (self.tokenizer.decode(output, skip_special_tokens=True), output,
                output[-1] == self.tokenizer.eos_token_id)

    def chat(self, messages, max_new_tokens):
        return self.generate(self.chat_ids(messages), max_new_tokens)


@pytest.fixture(scope="module")
def chat_reference(chat_model_dir):
    return Reference(AutoModelForCausalLM.from_pretrained(chat_model_dir, dtype=torch.float32),
                     AutoTokenizer.from_pretrained(chat_model_dir))


@pytest.fixture(scope="module")
def lora_reference(tiny_model_dir, lora_dir):
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return Reference(PeftModel.from_pretrained(base, lora_dir), AutoTokenizer.from_pretrained(lora_dir))


def user(text):
    return [{"role": "user", "content": text}]


# ----------------------------------------------------------------------------- server


def http(base_url, path, body=None, key=API_KEY, raw=None):
    """(status, parsed JSON) of a plain HTTP request, for what the openai client cannot send."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(base_url + path, data=data, method="POST" if data is not None else "GET",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def server(tiny_model_dir, lora_dir, tmp_path_factory):
    """The server as users run it (base + LoRA, with an API key), once for the module."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    log = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, SERVER_SCRIPT, "--base_model", tiny_model_dir, "--lora_model", lora_dir,
         "--port", str(port), "--api_key", API_KEY, "--model_name", MODEL_NAME],
        cwd=REPO, env=script_env(), stdout=log, stderr=subprocess.STDOUT,
    )
    base_url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 120
    try:
        while True:
            assert process.poll() is None, f"server exited:\n{log_path.read_text()[-3000:]}"
            assert time.time() < deadline, f"server not ready:\n{log_path.read_text()[-3000:]}"
            try:
                if http(base_url, "/models")[0] == 200:
                    break
            except OSError:  # not listening yet
                pass
            time.sleep(0.2)
        yield base_url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key=API_KEY, max_retries=0, timeout=60)


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, **kwargs)


def streamed(stream):
    """(concatenated text, chunks) of a streamed response."""
    chunks = list(stream)
    text = "".join((c.choices[0].delta.content or "") if hasattr(c.choices[0], "delta") else c.choices[0].text
                   for c in chunks if c.choices)
    return text, chunks


def test_models_and_greedy_chat_equal_direct_generate(client, lora_reference):
    assert [model.id for model in client.models.list().data] == [MODEL_NAME]
    messages = [{"role": "system", "content": "the quick brown fox"}] + user("我们 今天 学习 模型")
    prompt_ids = lora_reference.chat_ids(messages)
    expected, ids, hit_eos = lora_reference.generate(prompt_ids, 6)
    assert not hit_eos  # so the answer is cut by max_tokens
    reply = chat(client, messages, max_tokens=6)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), 6)
    assert reply.usage.total_tokens == len(prompt_ids) + 6

    # Long enough to reach EOS: "stop", and the EOS counts as a generated token.
    expected, ids, hit_eos = lora_reference.chat(user("the quick brown fox"), 60)
    reply = chat(client, user("the quick brown fox"), max_tokens=60)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == ("stop" if hit_eos else "length")
    assert reply.usage.completion_tokens == len(ids)


def test_streaming_equals_non_streaming(client):
    messages = user("北京 上海 天气 很好")
    whole = chat(client, messages, max_tokens=40)
    text, chunks = streamed(chat(client, messages, max_tokens=40, stream=True, stream_options={"include_usage": True}))
    assert len(chunks) >= 4 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == whole.choices[0].message.content and text
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0] is [c for c in chunks if c.choices][-1]
    assert finishing[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_text_completions_plain_and_streamed(client, lora_reference):
    prompt = "the quick brown"
    prompt_ids = lora_reference.tokenizer(prompt)["input_ids"]
    expected, ids, hit_eos = lora_reference.generate(prompt_ids, 8)
    reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0)
    assert reply.object == "text_completion"
    assert reply.choices[0].text == expected
    assert reply.choices[0].finish_reason == ("stop" if hit_eos else "length")
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt_ids), len(ids))
    text, chunks = streamed(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                                      stream=True))
    assert text == expected and chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason


def test_stop_sequence_cuts_the_text(client):
    messages = user("one two three four")
    full = chat(client, messages, max_tokens=30).choices[0].message.content
    words = full.split()
    assert len(words) >= 4, full
    stop = words[2]
    expected = full[: full.find(stop)]
    reply = chat(client, messages, max_tokens=30, stop=[stop, "never appears"])
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < 30
    text, chunks = streamed(chat(client, messages, max_tokens=30, stop=stop, stream=True))
    assert text == expected and [c for c in chunks if c.choices][-1].choices[0].finish_reason == "stop"


def test_concurrent_requests_get_their_own_answers(client):
    prompts = [user("我们 今天 学习"), user("river mountain city"), user("data train learn"), user("北京 人民 日报")]
    alone = [chat(client, messages, max_tokens=24).choices[0].message.content for messages in prompts]
    together = [None] * len(prompts)

    def ask(index):
        if index % 2:
            together[index] = streamed(chat(client, prompts[index], max_tokens=24, stream=True))[0]
        else:
            together[index] = chat(client, prompts[index], max_tokens=24).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert together == alone
    assert len(set(alone)) > 1  # the prompts lead to different answers


BAD_REQUESTS = {
    "unknown_role": ({"messages": [{"role": "robot", "content": "hi"}]}, "messages", "unknown role 'robot'"),
    "empty_messages": ({"messages": []}, "messages", "non-empty list"),
    "ends_on_assistant": ({"messages": user("hi") + [{"role": "assistant", "content": "x"}]}, "messages",
                          "must end on a user turn"),
    "max_tokens_0": ({"messages": user("hi"), "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    "max_tokens_over_context": ({"messages": user("hi"), "max_tokens": 300}, "max_tokens", "at most"),
    "prompt_too_long": ({"messages": user("the quick brown fox " * 80)}, "messages", "leaving no room"),
    "temperature_3": ({"messages": user("hi"), "temperature": 3}, "temperature", "less than or equal to 2"),
    "top_p_0": ({"messages": user("hi"), "top_p": 0}, "top_p", "greater than 0"),
    "n_2": ({"messages": user("hi"), "n": 2}, "n", "not supported"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_get_400_with_an_openai_error_body(client, case):
    kwargs, param, message = BAD_REQUESTS[case]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL_NAME, **kwargs)
    assert caught.value.status_code == 400
    body = caught.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param and message in body["error"]["message"], body


def test_malformed_json_and_unknown_model(server):
    status, body = http(server, "/chat/completions", raw=b'{"model": "tiny-chat", "messages": [')
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = http(server, "/chat/completions", {"model": "gpt-4", "messages": user("hi")})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_missing_or_wrong_key_is_refused(server):
    for headers in ({"Authorization": openai.Omit()}, {"Authorization": "Bearer wrong-key"}):
        with pytest.raises(openai.AuthenticationError) as caught:
            openai.OpenAI(base_url=server, api_key=API_KEY, max_retries=0).models.list(extra_headers=headers)
        assert caught.value.status_code == 401
        assert caught.value.response.json()["error"]["code"] == "invalid_api_key"
    assert http(server, "/models", key=None)[0] == 401


# ----------------------------------------------------------------------------- chat CLI


def test_generation_also_stops_where_the_template_ends_a_turn(tiny_tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)  # EOS is </s>
    # chatml ends an answer with <|im_end|> before EOS: a reply must stop there, not show it.
    assert template_turn_end(tokenizer, named_template("chatml", tokenizer)) == "<|im_end|>"
    for name in ("llama2", "alpaca", "human_assistant"):  # answers end right at EOS
        assert template_turn_end(tokenizer, named_template(name, tokenizer)) == ""


def test_trim_history_drops_the_oldest_exchanges_first():
    def exchange(n):
        return [{"role": "user", "content": f"q{n}" * 10}, {"role": "assistant", "content": f"a{n}" * 10}]

    messages = [{"role": "system", "content": "s" * 5}] + exchange(1) + exchange(2) + user("q3" * 10)
    length = lambda kept: sum(len(m["content"]) for m in kept)  # noqa: E731
    assert trim_history(messages, length, 200) == (messages, 0)
    kept, dropped = trim_history(messages, length, 5 + 20 * 3)
    assert dropped == 1 and kept == messages[:1] + messages[3:]
    kept, dropped = trim_history(messages, length, 5 + 20)
    assert dropped == 2 and kept == messages[:1] + messages[-1:]
    with pytest.raises(PromptTooLong):
        trim_history(messages, length, 24)


def test_chat_cli_session_trims_history_and_matches_direct_generate(chat_model_dir, chat_reference):
    first, second, third = "我们 今天", "the quick brown fox jumps over lazy dog model", "河 river"
    max_new = 8
    answer1 = chat_reference.chat(user(first), max_new)[0]
    with_history = len(chat_reference.chat_ids(user(first) + [{"role": "assistant", "content": answer1}]
                                               + user(second)))
    budget = max(len(chat_reference.chat_ids(user(first))), len(chat_reference.chat_ids(user(second))))
    assert budget < with_history  # the second turn only fits without the first exchange
    session = "\n".join([first, second, "/clear", third, "/quit", "never read"]) + "\n"
    result = subprocess.run(
        [sys.executable, CHAT_SCRIPT, "--base_model", chat_model_dir, "--max_new_tokens", str(max_new),
         "--max_context_tokens", str(budget + max_new), "--show_prompt", *GREEDY],
        input=session, cwd=REPO, env=script_env(), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    prompts = re.findall(r"--- prompt ---\n(.*?)\n--- end of prompt ---", out, re.S)
    answers = re.findall(r"Assistant: (.*?)\n\nUser: ", out, re.S)
    assert len(prompts) == 3 and len(answers) == 3, out
    assert "dropped the 1 oldest exchange(s)" in out and out.count("dropped the") == 1
    assert "(history cleared)" in out
    assert first in prompts[0] and first not in prompts[1] and second in prompts[1]
    assert second not in prompts[2] and third in prompts[2]
    assert answers == [answer1, chat_reference.chat(user(second), max_new)[0],
                       chat_reference.chat(user(third), max_new)[0]]
    assert "never read" not in out


# ----------------------------------------------------------------------------- batch mode

BATCH_RECORDS = [
    {"prompt": "我们 今天 学习 模型 数据 训练 中文"},
    {"messages": [{"role": "system", "content": "be brief"}] + user("river")},
    {"prompt": "the quick brown fox"},
    {"messages": user("北京") + [{"role": "assistant", "content": "上海 天气"}] + user("很好 人民 日报 经济 发展")},
    {"prompt": "one"},
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


def test_batch_predictions_in_input_order_equal_one_by_one_greedy(tmp_path, chat_model_dir, chat_reference):
    data = write_jsonl(tmp_path / "prompts.jsonl", BATCH_RECORDS)
    predictions = tmp_path / "out" / "predictions.jsonl"
    # In-process (chat.py's real process runs in the session test above).
    assert_ok(run_in_process(CHAT_SCRIPT, ["--base_model", chat_model_dir, "--data_file", data,
                                           "--predictions_file", predictions, "--batch_size", "3",
                                           "--max_new_tokens", "10", *GREEDY]))
    lines = [json.loads(line) for line in predictions.read_text(encoding="utf-8").splitlines()]
    assert len(lines) == len(BATCH_RECORDS)
    lengths = set()
    for record, line in zip(BATCH_RECORDS, lines, strict=True):
        (name, value), = record.items()
        assert line[name] == value
        messages = user(value) if name == "prompt" else value
        text, _, hit_eos = chat_reference.chat(messages, 10)
        assert line["response"] == text
        assert line["finish_reason"] == ("stop" if hit_eos else "length")
        lengths.add(len(chat_reference.chat_ids(messages)))
    # Every prompt has its own length: each batch really was left-padded.
    assert len(lengths) == len(BATCH_RECORDS)
    assert len({line["response"] for line in lines}) == len(lines)


def test_batch_refuses_existing_output_and_bad_lines(tmp_path, chat_model_dir, tiny_model_dir):
    data = write_jsonl(tmp_path / "prompts.jsonl", BATCH_RECORDS)
    existing = tmp_path / "existing.jsonl"
    existing.write_text("keep me\n")
    args = ["--base_model", chat_model_dir, "--data_file", data, "--predictions_file", existing]
    check_refused(refuse(CHAT_SCRIPT, args, in_process=True), "--predictions_file already exists")
    assert existing.read_text() == "keep me\n"

    bad_cases = {
        "missing.jsonl": (BATCH_RECORDS[:2] + [{"question": "x"}],
                          "missing.jsonl:3: field 'prompt' or 'messages' is missing"),
        "role.jsonl": ([{"messages": [{"role": "bot", "content": "x"}]}],
                       "role.jsonl:1: field 'messages[0].role' has unknown role"),
        "type.jsonl": ([{"prompt": 7}], "type.jsonl:1: field 'prompt' must be a string"),
    }
    for name, (records, expected) in bad_cases.items():
        output = tmp_path / f"{name}.out"
        args = ["--base_model", chat_model_dir, "--data_file", write_jsonl(tmp_path / name, records),
                "--predictions_file", output]
        check_refused(refuse(CHAT_SCRIPT, args, in_process=True), expected)
        assert not output.exists()
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(BATCH_RECORDS[0]) + "\n{\"prompt\": \n")
    args = ["--base_model", chat_model_dir, "--data_file", broken, "--predictions_file", tmp_path / "b.out"]
    check_refused(refuse(CHAT_SCRIPT, args, in_process=True), "broken.jsonl:2: not valid JSON")

    # A model whose tokenizer saved no chat template, and no --template: refused, not guessed.
    args = ["--base_model", tiny_model_dir, "--data_file", data, "--predictions_file", tmp_path / "c.out"]
    check_refused(refuse(CHAT_SCRIPT, args, in_process=True), "the tokenizer has no chat_template")
    assert not (tmp_path / "c.out").exists()
