"""The OpenAI-compatible server stays up whatever one request sends: each limit answers its 4xx with
OpenAI's error body, a failure answers a generic 500 (its details only in the log), a client that
goes away stops its generation, and after all of it a good request still gets its answer. The
server is main() as users start it, on the tiny model, served in this process by uvicorn."""

import json
import logging
import socket
import threading
import time

import pytest

from helpers.commands import check_refused, run_in_process
from helpers.server import SERVER_SCRIPT, assert_error_body, call, launch, serving
from lorakit.serve import completion_service
from lorakit.serve.inference import Completion

MODEL = "tiny"
MAX_PENDING = 2
GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "the quick brown fox"}], "max_tokens": 8,
        "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """main() with no --host and no key anywhere, and room for MAX_PENDING requests."""
    app, config, _ = launch(["--base_model", tiny_model_dir, "--template", "human_assistant", "--model_name", MODEL,
                             "--max_pending_requests", MAX_PENDING])
    with serving(app) as (port, thread):
        yield {"port": port, "thread": thread, "host": config.host, "service": app.state.service}


def answer(server):
    status, body = call(server["port"], "/v1/chat/completions", GOOD)
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def test_by_default_it_binds_localhost_and_serves_without_a_key(server):
    assert server["host"] == "127.0.0.1"
    assert call(server["port"], "/v1/models") == (200, {"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": server["service"].created, "owned_by": "owner"}]})
    status, body = call(server["port"], "/v1/chat/completions", GOOD)
    assert status == 200 and body["usage"]["completion_tokens"] >= 1, body


def bad_requests(limit_bytes):
    """name -> (how to send it, status, param)."""
    good_json = json.dumps(GOOD).encode()
    return {
        "five stops": (dict(body={**GOOD, "stop": ["a", "b", "c", "d", "e"]}), 400, "stop"),
        "a stop of 65 characters": (dict(body={**GOOD, "stop": "x" * 65}), 400, "stop"),
        "a 100k-character stop": (dict(body={**GOOD, "stop": ["y" * 100_000]}), 400, "stop"),
        "seed 2**64": (dict(body={**GOOD, "seed": 2**64}), 400, "seed"),
        "seed -2**63-1": (dict(body={**GOOD, "seed": -(2**63) - 1}), 400, "seed"),
        "infinite repetition_penalty": (dict(raw=good_json[:-1] + b', "repetition_penalty": Infinity}'), 400,
                                        "repetition_penalty"),
        "a body one byte over": (dict(raw=good_json + b" " * (limit_bytes + 1 - len(good_json))), 413, None),
        "a chunked body over": (dict(chunks=[good_json] + [b" " * 65536] * (limit_bytes // 65536 + 1)), 413, None),
    }


def test_each_limit_gets_its_error_and_a_good_request_still_gets_its_answer(server):
    before = answer(server)
    limit = server["service"].limits.max_request_bytes
    assert limit == 1 << 20  # the default
    for name, (request, status, param) in bad_requests(limit).items():
        got, body = call(server["port"], "/v1/chat/completions", **request)
        assert got == status, (name, body)
        assert_error_body(body)
        assert body["error"]["param"] == param, (name, body)
    # At the limits exactly, the request is served.
    good_json = json.dumps({**GOOD, "stop": ["z" * 64, "q", "r", "s"], "seed": 2**63 - 1}).encode()
    status, body = call(server["port"], "/v1/chat/completions", raw=good_json + b" " * (limit - len(good_json)))
    assert status == 200, body
    assert answer(server) == before
    assert server["service"].slots.taken == 0


def test_a_declared_body_over_the_limit_is_refused_unread(server):
    """A client that waits for '100 Continue' before sending a 1 GB body gets the 413 instead."""
    sock = socket.create_connection(("127.0.0.1", server["port"]), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000000000\r\nExpect: 100-continue\r\n\r\n")
    reply = b""
    while b"}}" not in reply and (data := sock.recv(4096)):
        reply += data
    sock.close()
    assert reply.startswith(b"HTTP/1.1 413 "), reply
    assert_error_body(json.loads(reply.split(b"\r\n\r\n", 1)[1]))


def test_a_full_server_answers_503_at_once_then_serves_again(server, monkeypatch):
    service, entered, release = server["service"], threading.Event(), threading.Event()

    def blocked_generate(prompts, settings, stops=(), streamer=None, cancel=None):
        entered.set()
        assert release.wait(60)
        return [Completion("held", "stop", len(prompts[0]), 1)]

    monkeypatch.setattr(service.generator, "generate", blocked_generate)
    replies = []
    waiting = [threading.Thread(target=lambda: replies.append(call(server["port"], "/v1/chat/completions", GOOD)))
               for _ in range(MAX_PENDING)]
    for thread in waiting:
        thread.start()
    deadline = time.time() + 30
    while not (entered.is_set() and service.slots.taken == MAX_PENDING):
        assert time.time() < deadline, service.slots.taken
        time.sleep(0.02)
    started = time.time()
    status, body = call(server["port"], "/v1/chat/completions", GOOD)
    assert status == 503 and time.time() - started < 5, body
    assert_error_body(body, "server_error")
    assert body["error"]["code"] == "server_overloaded"
    release.set()
    for thread in waiting:
        thread.join(60)
    assert [(status, body["choices"][0]["message"]["content"]) for status, body in replies] == [(200, "held")] * 2
    monkeypatch.undo()
    answer(server)
    assert service.slots.taken == 0


def test_a_failure_answers_a_generic_500_and_logs_the_details(server, monkeypatch, caplog):
    secret = "RuntimeError detail /private/models/path"

    def failing_generate(prompts, settings, stops=(), streamer=None, cancel=None):
        raise RuntimeError(secret)

    before = answer(server)
    monkeypatch.setattr(server["service"].generator, "generate", failing_generate)
    with caplog.at_level(logging.ERROR, logger="lorakit.serve.completion_service"):
        status, body = call(server["port"], "/v1/chat/completions", GOOD)
        _, stream = call(server["port"], "/v1/chat/completions", {**GOOD, "stream": True})
    assert status == 500, body
    assert_error_body(body, "server_error")
    events = [json.loads(line[len("data: "):]) for line in stream.splitlines()
              if line.startswith("data: {")]
    streamed_error = events[-1]
    assert_error_body(streamed_error, "server_error")
    logged = [record for record in caplog.records if record.name == "lorakit.serve.completion_service"]
    for message in (body["error"]["message"], streamed_error["error"]["message"]):
        assert "error id" in message and "private" not in message and "RuntimeError" not in message, message
        error_id = message.split("error id ")[1].rstrip(")")
        record = next(record for record in logged if error_id in record.getMessage())
        assert secret in str(record.exc_info[1])
    monkeypatch.undo()
    assert answer(server) == before
    assert server["service"].slots.taken == 0


class SlowStreamer:
    """Passes tokens on (to the server's streamer, if any) 20 ms apart: a generation long enough to
    leave while it runs."""

    def __init__(self, streamer):
        self.streamer = streamer

    def put(self, value):
        time.sleep(0.02)
        if self.streamer is not None:
            self.streamer.put(value)

    def end(self):
        if self.streamer is not None:
            self.streamer.end()


def send_raw(port, body) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    return sock


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_client_that_goes_away_stops_its_generation(server, monkeypatch, stream):
    generator, runs = server["service"].generator, []
    real_generate = generator.generate

    def recorded_generate(prompts, settings, stops=(), streamer=None, cancel=None):
        run = {"cancel": cancel, "started": threading.Event()}
        runs.append(run)
        run["started"].set()
        run["completions"] = real_generate(prompts, settings, stops, SlowStreamer(streamer), cancel)
        return run["completions"]

    # No EOS ends the reply early: only max_tokens or the cancellation can.
    monkeypatch.setattr(generator, "eos_ids", [len(generator.tokenizer) + 1])
    monkeypatch.setattr(generator, "generate", recorded_generate)
    body = {**GOOD, "max_tokens": 200, "stream": stream}
    sock = send_raw(server["port"], body)
    deadline = time.time() + 30
    while not runs:
        assert time.time() < deadline
        time.sleep(0.01)
    assert runs[0]["started"].wait(30)
    if stream:
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    sock.close()
    while server["service"].slots.taken:
        assert time.time() < deadline, "the generation did not stop"
        time.sleep(0.02)
    # Without EOS, only the cancellation stops it short of 200 tokens.
    generated = runs[0]["completions"][0].completion_tokens
    assert runs[0]["cancel"].is_set() and generated < 100, generated


def test_a_request_whose_client_left_while_queued_is_not_generated(server, monkeypatch):
    service, entered, release, calls = server["service"], threading.Event(), threading.Event(), []
    noticed = threading.Event()
    watch_client = completion_service.cancel_when_gone

    async def noticing_cancel_when_gone(request, cancel):
        await watch_client(request, cancel)
        noticed.set()

    def blocked_generate(prompts, settings, stops=(), streamer=None, cancel=None):
        calls.append(prompts)
        entered.set()
        assert release.wait(60)
        return [Completion("held", "stop", len(prompts[0]), 1)]

    monkeypatch.setattr(completion_service, "cancel_when_gone", noticing_cancel_when_gone)
    monkeypatch.setattr(service.generator, "generate", blocked_generate)
    first = threading.Thread(target=lambda: call(server["port"], "/v1/chat/completions", GOOD))
    first.start()
    assert entered.wait(30)
    sock = send_raw(server["port"], {**GOOD, "messages": [{"role": "user", "content": "left while queued"}]})
    deadline = time.time() + 30
    while service.slots.taken < 2:
        assert time.time() < deadline
        time.sleep(0.02)
    sock.close()
    assert noticed.wait(30)
    release.set()
    first.join(60)
    while service.slots.taken:
        assert time.time() < deadline
        time.sleep(0.02)
    assert len(calls) == 1  # only the first request was generated


def test_tokenization_runs_off_the_event_loop(server, monkeypatch):
    generator, threads = server["service"].generator, []
    real_encode = generator.encode_chat

    def recorded_encode(messages):
        threads.append(threading.current_thread())
        return real_encode(messages)

    monkeypatch.setattr(generator, "encode_chat", recorded_encode)
    answer(server)
    assert len(threads) == 1 and threads[0] is not server["thread"], threads


def test_the_key_comes_from_a_file_or_the_environment(tiny_model_dir, tmp_path):
    key_file = tmp_path / "key.txt"
    key_file.write_text("file-key\n")
    common = ["--base_model", tiny_model_dir, "--template", "human_assistant", "--model_name", MODEL]
    for args, key_variable, key in ((["--api_key_file", key_file], "ignored-env-key", "file-key"),
                                    ([], " env-key\n", "env-key")):
        app, _, result = launch(common + args, key_variable)
        assert "--api_key shows" not in result.stderr  # no warning: the key is out of the command line
        with serving(app) as (port, _):
            assert call(port, "/v1/models")[0] == 401
            for wrong in ("wrong", "ignored-env-key"):  # a key file wins over the environment
                assert call(port, "/v1/models", headers={"Authorization": f"Bearer {wrong}"})[0] == 401
            status, body = call(port, "/v1/chat/completions", GOOD, headers={"Authorization": f"Bearer {key}"})
            assert status == 200 and body["choices"][0]["message"]["content"] is not None, body


def test_a_key_in_argv_works_but_warns(tiny_model_dir):
    app, _, result = launch(["--base_model", tiny_model_dir, "--template", "human_assistant", "--api_key", "argv-key"])
    assert "--api_key shows the key to every user of this machine (ps)" in result.stderr
    with serving(app) as (port, _):
        assert call(port, "/v1/models")[0] == 401
        assert call(port, "/v1/models", headers={"Authorization": "Bearer argv-key"})[0] == 200


@pytest.mark.parametrize("args, expected", [
    (["--api_key", "k", "--api_key_file", "KEY_FILE"], "--api_key and --api_key_file: give the key one way"),
    (["--api_key_file", "MISSING"], "--api_key_file cannot be read"),
    (["--api_key_file", "EMPTY_FILE"], "--api_key_file: the API key is empty"),
    (["--max_stop_sequences", "-1"], "--max_stop_sequences -1: must be at least 0"),
    (["--max_request_bytes", "10"], "--max_request_bytes 10: must be at least 1024"),
], ids=["two_keys", "missing_key_file", "empty_key_file", "negative_stops", "tiny_body_limit"])
def test_bad_key_and_limit_flags_are_refused(tmp_path, args, expected):
    (tmp_path / "key").write_text("k")
    (tmp_path / "empty").write_text("\n")
    paths = {"KEY_FILE": tmp_path / "key", "MISSING": tmp_path / "missing", "EMPTY_FILE": tmp_path / "empty"}
    result = run_in_process(SERVER_SCRIPT, ["--base_model", tmp_path] + [paths.get(arg, arg) for arg in args])
    check_refused(result, expected)


def resident_bytes() -> int:
    """This process's resident memory (the server runs in it)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def streamed_text(port, body) -> tuple:
    """(status, the streamed deltas joined, the finish reason) of a streamed chat completion."""
    status, text = call(port, "/v1/chat/completions", {**body, "stream": True})
    events = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: {")]
    content = "".join(event["choices"][0]["delta"].get("content") or "" for event in events if event["choices"])
    return status, content, events[-1]["choices"][0]["finish_reason"] if events else None


LOAD_CLIENTS, LOAD_ROUNDS = 32, 3
LOAD_PROMPTS = ["the quick brown fox", "我们 今天 学习", "a b c d", "模型 训练 the"]
# What each client sends in a round, by (client + round) % 6, and the status it must get.
LOAD_BAD = {"five stops": ({"stop": ["a", "b", "c", "d", "e"]}, 400), "another model": ({"model": "gpt-4"}, 404),
            "max_tokens beyond the context": ({"max_tokens": 10**6}, 400), "n=2": ({"n": 2}, 400)}


def load_client(port, client: int, expected: dict, outcomes: list) -> None:
    """LOAD_ROUNDS requests of one client: plain, streamed, left early (streamed or not), or bad."""
    for round_ in range(LOAD_ROUNDS):
        kind, prompt = (client + round_) % 6, LOAD_PROMPTS[(client + 2 * round_) % len(LOAD_PROMPTS)]
        body = {**GOOD, "messages": [{"role": "user", "content": prompt}]}
        if kind in (0, 1):
            status, reply = call(port, "/v1/chat/completions", body)
            outcomes.append(("plain", status, reply["choices"][0]["message"]["content"] if status == 200 else reply,
                             expected[prompt]))
        elif kind == 2:
            status, content, finish = streamed_text(port, body)
            outcomes.append(("streamed", status, content if finish else None, expected[prompt]))
        elif kind in (3, 4):  # leaves while its 200-token answer is generated (or still queued)
            sock = send_raw(port, {**body, "max_tokens": 200, "stream": kind == 3})
            if kind == 3:
                sock.recv(64)
            sock.close()
        else:
            name = sorted(LOAD_BAD)[(client + round_) % len(LOAD_BAD)]
            change, status = LOAD_BAD[name]
            got, reply = call(port, "/v1/chat/completions", {**body, **change})
            outcomes.append((name, got, reply.get("error", {}).get("type") if isinstance(reply, dict) else reply,
                             status))


def test_under_load_every_request_gets_its_answer_and_memory_stays_bounded(tiny_model_dir):
    """32 clients at once, 3 requests each, plain, streamed, leaving early and bad: each good one gets the answer
    a direct greedy generate gives, each bad one its 4xx; the server's memory stays flat and it answers after."""
    from lorakit.serve.inference import SamplingSettings

    app, _, _ = launch(["--base_model", tiny_model_dir, "--template", "human_assistant", "--model_name", MODEL,
                        "--max_pending_requests", 2 * LOAD_CLIENTS])
    service = app.state.service
    generator = service.generator
    greedy = SamplingSettings(max_new_tokens=GOOD["max_tokens"], temperature=0, top_p=1.0, top_k=0,
                              repetition_penalty=1.0)
    expected = {prompt: generator.generate([generator.encode_chat([{"role": "user", "content": prompt}])], greedy,
                                           generator.chat_stops([]))[0].text for prompt in LOAD_PROMPTS}
    assert len(set(expected.values())) > 1  # the prompts tell the answers apart
    with serving(app) as (port, _):
        for prompt in LOAD_PROMPTS:  # warm up (first-call allocations) before the baseline
            streamed_text(port, {**GOOD, "messages": [{"role": "user", "content": prompt}]})
        baseline, peak, outcomes, done = resident_bytes(), [0], [], threading.Event()

        def watch_memory():
            while not done.wait(0.05):
                peak[0] = max(peak[0], resident_bytes())

        watcher = threading.Thread(target=watch_memory, daemon=True)
        clients = [threading.Thread(target=load_client, args=(port, client, expected, outcomes))
                   for client in range(LOAD_CLIENTS)]
        started = time.time()
        for thread in [watcher, *clients]:
            thread.start()
        for thread in clients:
            thread.join(60)
        elapsed = time.time() - started
        deadline = time.time() + 30
        while service.slots.taken:  # the generations of clients that left are stopped
            assert time.time() < deadline, service.slots.taken
            time.sleep(0.02)
        done.set()
        watcher.join(5)
        assert not any(thread.is_alive() for thread in clients) and elapsed < 60, elapsed
        good = [(kind, status, text, answer_) for kind, status, text, answer_ in outcomes if kind in ("plain",
                                                                                                     "streamed")]
        bad = [outcome for outcome in outcomes if outcome not in good]
        kinds = [(client + round_) % 6 for client in range(LOAD_CLIENTS) for round_ in range(LOAD_ROUNDS)]
        assert (len(good), len(bad)) == (sum(kind < 3 for kind in kinds), kinds.count(5))
        assert all(status == 200 and text == answer_ for _, status, text, answer_ in good), good
        assert all(got == status and error_type == "invalid_request_error" for _, got, error_type, status in bad), bad
        assert peak[0] - baseline < 200 * 2**20, (baseline, peak[0])
        assert streamed_text(port, GOOD)[1] == call(port, "/v1/chat/completions", GOOD)[1]["choices"][0]["message"][
            "content"]
