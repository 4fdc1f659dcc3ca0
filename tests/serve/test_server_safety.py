"""What no request may do to the OpenAI-compatible server (issue 28): sampling values are bounded to what samples
finitely and a guard right before sampling fails a request whose scores are not finite, alone; an accelerator error
makes the server unhealthy (GET /health, 503) and exit with status 1; without a key only the server's own Host names
are answered; bodies must be JSON; answer length and generation time have ceilings; streaming and stop handling cost
time linear in the reply; a client's seed stays its own; OpenAI fields that would change the answer's meaning are
refused. On the tiny model, served in this process (and once in a subprocess, for the real exit)."""

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import uvicorn
from transformers import AutoTokenizer, TopPLogitsWarper

from helpers.commands import REPO, check_refused, free_port, run_in_process, script_env
from helpers.server import SERVER_SCRIPT, assert_error_body, call, launch, serving
from lorakit.serve import inference
from lorakit.serve.completion_service import is_device_error
from lorakit.serve.inference import (
    FiniteScoresGuard,
    NonFiniteScores,
    SamplingSettings,
    TextDeltaStreamer,
    cut_at_stop,
    tokens_until_stop,
)

FAULTY_SERVER = os.path.join(REPO, "tests", "helpers", "faulty_server.py")
MODEL = "tiny"
CHAT = "/v1/chat/completions"
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 8,
        "temperature": 0}
GOOD_TEXT = {"model": MODEL, "prompt": "the quick brown", "max_tokens": 8, "temperature": 0}
MAX_TOKENS_LIMIT, DEFAULT_MAX_TOKENS = 64, 16


def common(model_dir):
    return ["--base_model", model_dir, "--template", "human_assistant", "--model_name", MODEL]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    app, _, _ = launch([*common(tiny_model_dir), "--max_tokens_limit", MAX_TOKENS_LIMIT,
                        "--default_max_tokens", DEFAULT_MAX_TOKENS])
    with serving(app) as (port, _):
        yield {"port": port, "service": app.state.service}


def answer(server, **change):
    status, body = call(server["port"], CHAT, {**GOOD, **change})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def stream_events(port, body, path=CHAT):
    status, text = call(port, path, {**body, "stream": True})
    assert status == 200, text
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: {")]


def refused(port, body, status, param, code=None, path=CHAT):
    got, reply = call(port, path, body)
    assert got == status, (body, reply)
    assert_error_body(reply, "invalid_request_error" if status < 500 else "server_error")
    assert reply["error"]["param"] == param, reply
    if code is not None:
        assert reply["error"]["code"] == code, reply
    return reply["error"]["message"]


# ----------------------------------------------------------------------------- sampling bounds and the guard

OUT_OF_BOUNDS = [("temperature", 1e-300), ("temperature", 0.005), ("temperature", 2.01), ("temperature", -0.5),
                 ("repetition_penalty", 1e-300), ("repetition_penalty", 0.49), ("repetition_penalty", 2.5),
                 ("repetition_penalty", 0), ("top_p", 0), ("top_p", 1.01), ("top_k", -1)]
AT_THE_BOUNDS = [{"temperature": 0.01}, {"temperature": 2}, {"temperature": 1, "repetition_penalty": 0.5},
                 {"temperature": 1, "repetition_penalty": 2}, {"temperature": 1, "top_p": 1}, {"top_k": 0}]


def test_sampling_values_beyond_what_samples_finitely_get_400_naming_the_field(server):
    port, before = server["port"], answer(server)
    for field, value in OUT_OF_BOUNDS:
        for path, body in ((CHAT, GOOD), ("/v1/completions", GOOD_TEXT)):
            refused(port, {**body, field: value}, 400, field, "invalid_value", path)
    for change in AT_THE_BOUNDS:
        assert call(port, CHAT, {**GOOD, **change})[0] == 200, change
    assert answer(server) == before


def counting_multinomial(monkeypatch):
    """torch.multinomial, recording the probabilities it samples from."""
    sampled, real = [], torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda probs, *args, **kwargs: sampled.append(probs.clone())
                        or real(probs, *args, **kwargs))
    return sampled


def test_scores_that_are_not_finite_fail_their_request_alone(server, monkeypatch):
    """temperature 1e-300, had it passed the checks, scales the scores to infinity: the guard fails the request
    (plain and streamed) before anything is sampled, and the next request is served as before."""
    service, before = server["service"], answer(server)
    settings_for = service.settings_for
    monkeypatch.setattr(service, "settings_for", lambda *args: dataclasses.replace(settings_for(*args),
                                                                                  temperature=1e-300))
    sampled = counting_multinomial(monkeypatch)
    message = refused(server["port"], {**GOOD, "temperature": 1}, 500, None, "non_finite_scores")
    assert "not finite" in message
    error = stream_events(server["port"], {**GOOD, "temperature": 1})[-1]
    assert_error_body(error, "server_error")
    assert error["error"]["code"] == "non_finite_scores"
    assert not sampled
    monkeypatch.undo()
    assert answer(server) == before
    assert call(server["port"], "/health") == (200, {"status": "ok"})


def test_the_guard_sees_the_very_scores_that_are_sampled(server, monkeypatch):
    """generate runs its own warpers after the processors it is given: none is built, even where the checkpoint's
    generation_config asks for some, so temperature, top-k, top-p and repetition penalty all come before the guard,
    and what it passes is what torch.multinomial samples."""
    generator = server["service"].generator
    for name, value in {"temperature": 0.05, "top_k": 1, "top_p": 0.1, "typical_p": 0.2, "min_p": 0.9}.items():
        monkeypatch.setattr(generator.model.generation_config, name, value)
    guarded, real_guard = [], FiniteScoresGuard.__call__
    monkeypatch.setattr(FiniteScoresGuard, "__call__", lambda self, input_ids, scores: guarded.append(
        real_guard(self, input_ids, scores).clone()) or scores)
    sampled = counting_multinomial(monkeypatch)
    settings = SamplingSettings(max_new_tokens=12, temperature=0.7, top_k=20, top_p=0.95, repetition_penalty=1.3,
                                seed=0)
    generator.generate([generator.encode_text("the quick brown")], settings)
    assert len(guarded) == len(sampled) >= 4
    for scores, probs in zip(guarded, sampled, strict=True):
        assert torch.allclose(torch.softmax(scores, dim=-1), probs)
    kept = [int((probs > 0).sum()) for probs in sampled]
    assert max(kept) > 1 and max(kept) <= 20, kept  # the request's top_k, not the checkpoint's top_k=1


def test_a_processor_that_makes_nan_is_caught_before_sampling(server, monkeypatch):
    """The last warper before the guard (top-p) turns the scores into NaN: the generation fails with
    NonFiniteScores, and torch.multinomial never sees them."""
    generator = server["service"].generator
    monkeypatch.setattr(TopPLogitsWarper, "__call__", lambda self, input_ids, scores: torch.full_like(
        scores, float("nan")))
    sampled = counting_multinomial(monkeypatch)
    with pytest.raises(NonFiniteScores):
        generator.generate([generator.encode_text("the quick brown")],
                           SamplingSettings(max_new_tokens=4, temperature=0.7, top_k=0, top_p=0.9))
    assert not sampled


# ----------------------------------------------------------------------------- accelerator errors


def device_side_assert():
    raise torch.AcceleratorError("CUDA error: device-side assert triggered")


def test_which_errors_are_accelerator_errors():
    assert is_device_error(torch.AcceleratorError("CUDA error: device-side assert triggered"))
    assert is_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_device_error(RuntimeError("../aten/src/ATen/native/cuda/Indexing.cu: device-side assert triggered"))
    assert not is_device_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_device_error(RuntimeError("CUDA error: out of memory"))
    assert not is_device_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_device_error(ValueError("CUDA error"))
    assert not is_device_error(NonFiniteScores("not finite"))


def test_an_accelerator_error_makes_the_server_unhealthy_and_stop(tiny_model_dir):
    """The worker meets a device-side assert (injected: a CPU cannot make one) in a streamed request: the stream
    ends with the error, the server stops itself (on_failure), /health says why with 503, and every request,
    whatever it asks and whatever its Host, gets 503 with OpenAI's error body, for good."""
    app, _, _ = launch(common(tiny_model_dir))
    service, stops = app.state.service, []
    service.on_failure = lambda: stops.append(service.failure)
    with serving(app) as (port, _):
        assert call(port, "/health") == (200, {"status": "ok"})
        assert call(port, CHAT, GOOD)[0] == 200
        service.fault_injection = device_side_assert
        error = stream_events(port, GOOD)[-1]
        assert_error_body(error, "server_error")
        assert error["error"]["code"] == "server_unhealthy"
        assert len(stops) == 1 and "AcceleratorError" in stops[0]
        service.fault_injection = None  # the process cannot generate again: it stays unhealthy
        status, health = call(port, "/health", headers={"Host": "elsewhere.example"})
        assert status == 503 and health == {"status": "unhealthy", "reason": service.failure}
        for path, body in (("/v1/models", None), (CHAT, GOOD), (CHAT, {**GOOD, "stream": True}),
                           ("/v1/completions", GOOD_TEXT)):
            status, reply = call(port, path, body)
            assert status == 503, (path, reply)
            assert_error_body(reply, "server_error")
            assert reply["error"]["code"] == "server_unhealthy"
    assert len(stops) == 1


def test_main_stops_the_server_and_exits_1_after_an_accelerator_error(tiny_model_dir, monkeypatch):
    def serve_until_the_fault(server, sockets=None):
        server.config.app.state.service.fail(torch.AcceleratorError("CUDA error: device-side assert triggered"))
        assert server.should_exit  # on_failure told uvicorn to stop

    monkeypatch.setattr(uvicorn.Server, "run", serve_until_the_fault)
    result = run_in_process(SERVER_SCRIPT, common(tiny_model_dir))
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "accelerator error (AcceleratorError)" in errors[0], result.stderr[-3000:]


def test_the_real_server_exits_with_status_1_after_an_accelerator_error(tiny_model_dir, tmp_path):
    """The server as users start it, in its own process, with the fault injected: the request that meets it gets
    503, and the process ends by itself with status 1 for a supervisor to restart it."""
    port, log_path = free_port(), tmp_path / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, FAULTY_SERVER, *common(tiny_model_dir), "--port", str(port)],
                                   cwd=REPO, env=script_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while True:
            assert process.poll() is None, log_path.read_text()[-3000:]
            assert time.time() < deadline, log_path.read_text()[-3000:]
            try:
                if call(port, "/health") == (200, {"status": "ok"}):
                    break
            except OSError:  # not listening yet
                time.sleep(0.2)
        status, reply = call(port, CHAT, GOOD)
        assert status == 503 and reply["error"]["code"] == "server_unhealthy", reply
        returncode = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log_path.read_text()
    assert returncode == 1, output[-3000:]
    assert output.strip().splitlines()[-1].startswith("error: accelerator error (AcceleratorError)"), output[-3000:]


# ----------------------------------------------------------------------------- hosts and content types


def test_without_a_key_only_the_servers_own_names_are_answered(server):
    """A web page that rebinds its own name to 127.0.0.1 sends that name as Host: refused with 400."""
    port = server["port"]
    for host in ("localhost", "localhost:8000", "127.0.0.1:1", "[::1]:8000", "LOCALHOST."):
        assert call(port, CHAT, GOOD, headers={"Host": host})[0] == 200, host
    for host in ("evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io", "0.0.0.0",
                 "10.0.0.7:8000"):
        status, reply = call(port, CHAT, GOOD, headers={"Host": host})
        assert status == 400, (host, reply)
        assert_error_body(reply)
        assert reply["error"]["code"] == "invalid_host"
    assert call(port, "/health", headers={"Host": "evil.example"}) == (200, {"status": "ok"})


def test_allowed_hosts_widen_the_names_and_a_key_opens_them_all(tiny_model_dir):
    app, _, result = launch([*common(tiny_model_dir), "--host", "0.0.0.0", "--allowed_hosts", "Model.LAN, gpu7"])
    assert ("serving on 0.0.0.0 without an API key: other machines are served only under the names of "
            "--allowed_hosts (gpu7, model.lan)") in result.stderr
    with serving(app) as (port, _):
        for host in ("model.lan:8000", "GPU7", "localhost"):
            assert call(port, CHAT, GOOD, headers={"Host": host})[0] == 200, host
        assert call(port, CHAT, GOOD, headers={"Host": "10.0.0.7:8000"})[0] == 400
    _, _, result = launch([*common(tiny_model_dir), "--host", "0.0.0.0"])
    assert "--allowed_hosts (none: no --allowed_hosts)" in result.stderr
    app, _, _ = launch([*common(tiny_model_dir), "--host", "10.0.0.7"])  # the bound address is its own name
    with serving(app) as (port, _):
        assert call(port, CHAT, GOOD, headers={"Host": "10.0.0.7:8000"})[0] == 200
    app, _, _ = launch([*common(tiny_model_dir), "--api_key", "k"])
    with serving(app) as (port, _):
        assert call(port, CHAT, GOOD, headers={"Host": "evil.example", "Authorization": "Bearer k"})[0] == 200
        assert call(port, CHAT, GOOD, headers={"Host": "evil.example"})[0] == 401


def test_a_post_body_must_be_declared_json(server):
    """A browser posts text/plain or a form to another site without asking it first, never JSON."""
    port = server["port"]
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None,
                         "application/json; charset=latin-1", "application/jsonp"):
        status, reply = call(port, CHAT, GOOD, headers={"Content-Type": content_type})
        assert status == 415, (content_type, reply)
        assert_error_body(reply)
        assert reply["error"]["code"] == "unsupported_media_type"
    for content_type in ("application/json", "Application/JSON; charset=UTF-8", 'application/json;charset="utf-8"'):
        assert call(port, CHAT, GOOD, headers={"Content-Type": content_type})[0] == 200, content_type
    assert call(port, "/v1/models", headers={"Content-Type": None})[0] == 200


# ----------------------------------------------------------------------------- costs


def test_max_tokens_above_the_limit_is_refused_not_cut(server, monkeypatch):
    port = server["port"]
    for field in ("max_tokens", "max_completion_tokens"):
        message = refused(port, {**GOOD, field: MAX_TOKENS_LIMIT + 1}, 400, field, "invalid_value")
        assert f"at most {MAX_TOKENS_LIMIT}" in message
    refused(port, {**GOOD_TEXT, "max_tokens": MAX_TOKENS_LIMIT + 1}, 400, "max_tokens", "invalid_value",
            "/v1/completions")
    generator = server["service"].generator
    monkeypatch.setattr(generator, "eos_ids", [len(generator.tokenizer) + 1])  # no EOS: the limits end the answers
    status, reply = call(port, CHAT, {**GOOD, "max_tokens": MAX_TOKENS_LIMIT})
    assert status == 200 and reply["usage"]["completion_tokens"] == MAX_TOKENS_LIMIT, reply
    status, reply = call(port, CHAT, {key: value for key, value in GOOD.items() if key != "max_tokens"})
    assert status == 200 and reply["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS, reply


@pytest.mark.parametrize("args, expected", [
    (["--max_tokens_limit", "100", "--default_max_tokens", "200"], "--max_tokens_limit 100: must be at least"),
    (["--request_timeout", "0"], "--request_timeout 0.0: must be a positive number of seconds"),
    (["--request_timeout", "inf"], "--request_timeout inf: must be a positive number of seconds"),
], ids=["limit_below_default", "no_time", "endless"])
def test_bad_cost_flags_are_refused(tmp_path, args, expected):
    check_refused(run_in_process(SERVER_SCRIPT, ["--base_model", tmp_path, *args]), expected)


def test_a_generation_past_its_time_limit_stops_with_finish_reason_length(server, monkeypatch):
    """A clock that moves one second per reading and a 5-second limit: the answer so far comes back, plain or
    streamed, ended by the limit as by max_tokens."""
    service, generator = server["service"], server["service"].generator
    clock = itertools.count()
    monkeypatch.setattr(inference, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(service.limits, "request_timeout", 5.0)
    monkeypatch.setattr(generator, "eos_ids", [len(generator.tokenizer) + 1])
    status, reply = call(server["port"], CHAT, {**GOOD, "max_tokens": 40})
    assert status == 200 and reply["choices"][0]["finish_reason"] == "length", reply
    assert 5 <= reply["usage"]["completion_tokens"] < 10, reply
    events = stream_events(server["port"], {**GOOD, "max_tokens": 40})
    assert events[-1]["choices"][0]["finish_reason"] == "length"


class CountingTokenizer:
    """A tokenizer whose decode counts the tokens it is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0
        self.all_special_ids = tokenizer.all_special_ids

    def decode(self, token_ids, **kwargs):
        self.decoded += len(token_ids)
        return self.tokenizer.decode(token_ids, **kwargs)


def streamed(tokenizer, token_ids, stops):
    """(tokens decoded, the text streamed, the most text held back at once) of a streamer fed token_ids one by
    one, as generate does."""
    counting, deltas, held = CountingTokenizer(tokenizer), [], 0
    streamer = TextDeltaStreamer(counting, deltas.append, stops)
    streamer.put(torch.tensor([[1, 2, 3]]))  # the prompt
    for token in token_ids:
        streamer.put(torch.tensor([token]))
        held = max(held, len(streamer.scanner.pending))
    streamer.end()
    return counting.decoded, "".join(deltas), held


def test_streaming_and_stops_cost_time_linear_in_the_reply(tiny_model_dir):
    """Each token is decoded a few times, however long the reply (decoding the whole reply at each token costs
    ~n²/2 tokens: 500,000 for 1,000), the text is the reply decoded at once, and only what may begin a stop is
    held back."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "我们 今天 学习 模型, the quick brown fox 🤖 jumps. " * 120
    reply = tokenizer(text, add_special_tokens=False)["input_ids"]
    stops = ["never appears", "🤖🤖"]
    costs = {}
    for length in (250, 1000):
        costs[length], text, held = streamed(tokenizer, reply[:length], stops)
        assert text == tokenizer.decode(reply[:length], skip_special_tokens=True)
        assert held < max(map(len, stops))
    assert costs[1000] <= 5 * 1000 and costs[1000] < 4.5 * costs[250], costs
    # A stop at the very end: the stream is cut before it, and counting the tokens up to it is linear too.
    stopped = reply[:1000] + tokenizer("STOP", add_special_tokens=False)["input_ids"] + reply[:50]
    _, text, _ = streamed(tokenizer, stopped, ["STOP"])
    assert text == cut_at_stop(tokenizer.decode(stopped, skip_special_tokens=True), ["STOP"]).text
    counting = CountingTokenizer(tokenizer)
    count = tokens_until_stop(counting, stopped, ["STOP"])
    assert cut_at_stop(tokenizer.decode(stopped[:count]), ["STOP"]).hit
    assert not cut_at_stop(tokenizer.decode(stopped[:count - 1]), ["STOP"]).hit
    assert counting.decoded <= 5 * len(stopped), counting.decoded


# ----------------------------------------------------------------------------- seeds


def test_a_seed_seeds_its_own_request_and_nothing_else(server):
    torch.manual_seed(99)
    state = torch.get_rng_state()
    sampled = {**GOOD, "temperature": 1.0, "max_tokens": 16}
    first = answer(server, **sampled, seed=1234)
    assert torch.equal(torch.get_rng_state(), state)  # the process's random stream is where it was
    assert answer(server, **sampled, seed=1234) == first
    streamed_text = "".join(event["choices"][0]["delta"].get("content") or ""
                            for event in stream_events(server["port"], {**sampled, "seed": 1234}) if event["choices"])
    assert streamed_text == first
    assert len({answer(server, **sampled, seed=seed) for seed in range(5)}) > 1  # the seed does pick the sample
    assert torch.equal(torch.get_rng_state(), state)


# ----------------------------------------------------------------------------- OpenAI fields

TOOL = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}
NEUTRAL_CHAT = [
    {"tools": None, "tool_choice": None, "functions": None, "function_call": None, "response_format": None,
     "logprobs": None, "top_logprobs": None, "logit_bias": None, "presence_penalty": None, "frequency_penalty": None,
     "n": None},
    {"tools": [TOOL], "tool_choice": "none", "response_format": {"type": "text"}, "logprobs": False,
     "top_logprobs": 0, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0, "n": 1,
     "parallel_tool_calls": True, "user": "someone"},
    {"tools": [], "functions": [], "function_call": "none", "tool_choice": "none", "logit_bias": {"50256": 0}},
]
REFUSED_CHAT = {
    "tools, no tool_choice (auto)": ({"tools": [TOOL]}, "tools"),
    "tools, tool_choice auto": ({"tools": [TOOL], "tool_choice": "auto"}, "tools"),
    "tools, a named tool": ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "weather"}}},
                            "tools"),
    "tool_choice required, no tools": ({"tool_choice": "required"}, "tool_choice"),
    "functions": ({"functions": [TOOL["function"]]}, "functions"),
    "function_call": ({"function_call": {"name": "weather"}}, "function_call"),
    "json_object": ({"response_format": {"type": "json_object"}}, "response_format"),
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    "logprobs": ({"logprobs": True}, "logprobs"),
    "top_logprobs": ({"top_logprobs": 2}, "top_logprobs"),
    "logit_bias": ({"logit_bias": {"5": 10}}, "logit_bias"),
    "logit_bias, one of them not 0": ({"logit_bias": {"5": 0, "6": -0.5}}, "logit_bias"),
    "presence_penalty": ({"presence_penalty": 0.5}, "presence_penalty"),
    "frequency_penalty": ({"frequency_penalty": -1}, "frequency_penalty"),
    "n": ({"n": 2}, "n"),
}
NEUTRAL_TEXT = [{"logprobs": None, "echo": False, "best_of": 1, "suffix": None, "n": 1, "logit_bias": {},
                 "presence_penalty": 0, "frequency_penalty": 0}, {"suffix": "", "best_of": None, "echo": None},
                {"logit_bias": {"50256": 0, "7": 0.0}}]
REFUSED_TEXT = {"logprobs": 1, "echo": True, "best_of": 2, "suffix": "the end", "n": 3, "logit_bias": {"7": -100},
                "presence_penalty": 1}


def test_fields_that_would_change_the_answer_are_refused_at_all_but_their_neutral_values(server):
    port, plain = server["port"], answer(server)
    for neutral in NEUTRAL_CHAT:
        assert answer(server, **neutral) == plain, neutral
    for name, (change, param) in REFUSED_CHAT.items():
        message = refused(port, {**GOOD, **change}, 400, param, "unsupported_value")
        assert param in message and "not supported" in message, (name, message)
    status, reply = call(port, "/v1/completions", GOOD_TEXT)
    assert status == 200, reply
    for neutral in NEUTRAL_TEXT:
        status, neutral_reply = call(port, "/v1/completions", {**GOOD_TEXT, **neutral})
        assert status == 200 and neutral_reply["choices"][0]["text"] == reply["choices"][0]["text"], neutral_reply
    for param, value in REFUSED_TEXT.items():
        refused(port, {**GOOD_TEXT, param: value}, 400, param, "unsupported_value", "/v1/completions")


def test_chat_refuses_sampling_values_that_cannot_sample():
    """The chat CLI takes the server's bounds: a bad value is one line at start-up (exit 2), not a failed run."""
    from lorakit.core.cli import InputError
    from lorakit.serve.chat import sampling_settings
    from lorakit.serve.chat_config import ChatArguments

    for name, value in (("temperature", 1e-300), ("temperature", 2.5), ("repetition_penalty", 1e-300),
                        ("repetition_penalty", 3.0)):
        with pytest.raises(InputError, match=f"--{name} must be"):
            sampling_settings(ChatArguments(**{name: value}))
    assert sampling_settings(ChatArguments(temperature=0, repetition_penalty=0.5)).temperature == 0


def test_a_lone_surrogate_in_a_request_is_a_400_naming_the_field(server):
    """JSON's escape "\\ud800" decodes to half of a UTF-16 pair, which is no character: the tokenizer raised TypeError
    on it (a 500). Each field that holds one is refused by name, before anything echoes it back (the model's name)."""
    port = server["port"]  # call() sends json.dumps' ASCII: the surrogate travels as the escape
    message = refused(port, {**GOOD, "messages": [{"role": "user", "content": "the quick \ud800 fox"}]}, 400,
                      "messages[0].content", "invalid_value")
    assert "lone surrogate (\\ud800" in message, message
    refused(port, {**GOOD_TEXT, "prompt": ["the \udfff brown"]}, 400, "prompt[0]", "invalid_value", "/v1/completions")
    refused(port, {**GOOD_TEXT, "stop": "\udc00"}, 400, "stop", "invalid_value", "/v1/completions")
    refused(port, {**GOOD, "model": f"{MODEL}\ud800"}, 400, "model", "invalid_value")
    assert answer(server, messages=[{"role": "user", "content": "the quick \U0001F600 fox"}])  # a pair is a character


def test_a_completion_prompt_keeps_a_special_tokens_text_as_text(server):
    """"</s>" in a /v1/completions prompt became the end-of-sequence token, while chat keeps it as text
    (records.control_text): completions follow the same rule."""
    generator = server["service"].generator
    tokenizer = generator.tokenizer
    held = generator.encode_text(f"the quick{tokenizer.eos_token} brown")
    assert tokenizer.eos_token_id not in held
    assert tokenizer.decode(held, skip_special_tokens=True).replace(" ", "") == "thequick</s>brown"
    assert generator.encode_text("the quick brown") == tokenizer("the quick brown")["input_ids"]
    status, reply = call(port := server["port"], "/v1/completions", {**GOOD_TEXT, "prompt": "the quick</s> brown"})
    assert status == 200 and reply["usage"]["prompt_tokens"] == len(generator.encode_text("the quick</s> brown")), (
        port, reply)
