"""The OpenAI-compatible server in this process, for the server tests (tests/serve/test_server_limits.py,
tests/serve/test_server_safety.py):

    launch(args)          main() with args as users start it, the server made, not run: (app, its config, the run)
    serving(app)          app served by uvicorn from a thread of this process: yields (port, the server's thread)
    call(port, path, ...) one HTTP request: (status, parsed JSON body or the text)
    assert_error_body     OpenAI's error body, of the type given
"""

import contextlib
import http.client
import json
import threading
import time

import pytest
import uvicorn

from helpers.commands import REPO, assert_ok, free_port, run_in_process
from lorakit.serve.server_config import API_KEY_VARIABLE

SERVER_SCRIPT = f"{REPO}/scripts/inference/openai_api_server.py"


def launch(args: list, key_variable=None, expect_ok=True):
    """(app, the uvicorn.Config main() made, the run) of main() with args: uvicorn.Server.run is recorded, not
    run."""
    servers = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(uvicorn.Server, "run", lambda server, sockets=None: servers.append(server))
        if key_variable is None:
            patch.delenv(API_KEY_VARIABLE, raising=False)
        else:
            patch.setenv(API_KEY_VARIABLE, key_variable)
        result = run_in_process(SERVER_SCRIPT, args)
    if expect_ok:
        assert_ok(result)
    return servers[0].config.app, servers[0].config, result


@contextlib.contextmanager
def serving(app):
    """app served by uvicorn from a thread of this process; yields (port, the server's thread)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_config=None,
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield server.config.port, thread
    finally:
        server.should_exit = True
        thread.join(30)


def call(port, path, body=None, raw=None, headers=None, chunks=None):
    """(status, parsed JSON body or the text) of one request: body as JSON, raw bytes, or chunks sent
    with chunked transfer encoding (no Content-Length). A header given as None is not sent."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json", **(headers or {})}
    headers = {name: value for name, value in headers.items() if value is not None}
    if chunks is not None:
        connection.request("POST", path, body=iter(chunks), headers=headers, encode_chunked=True)
    elif body is None and raw is None:
        connection.request("GET", path, headers=headers)
    else:
        connection.request("POST", path, body=raw if raw is not None else json.dumps(body).encode(), headers=headers)
    response = connection.getresponse()
    text = response.read().decode()
    connection.close()
    try:
        return response.status, json.loads(text)
    except json.JSONDecodeError:
        return response.status, text


def assert_error_body(body, status_type="invalid_request_error"):
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == status_type, body
