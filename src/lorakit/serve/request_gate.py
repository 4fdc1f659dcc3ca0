"""The server's security gate, everything a request meets before any endpoint sees it: the Host check that
keeps a server without an API key from being reached by DNS rebinding, the API key, the refusal of an unhealthy
server, the JSON content type (a browser sends another site text/plain or a form without asking first, never
JSON), and the body size limit (RequestSizeLimit, before any of the body is parsed). GET /health passes the
checks: a supervisor's probe needs neither key nor Host name."""

import secrets
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.middleware.base import RequestResponseEndpoint
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as ASGIMessage

from lorakit.serve.completion_service import CompletionService
from lorakit.serve.openai_protocol import error_body, unhealthy_error

HEALTH_PATH = "/health"


def request_gate(service: CompletionService, api_key: str | None,
                 allowed_hosts: frozenset[str]) -> Callable[[Request, RequestResponseEndpoint], Awaitable[Response]]:
    """HTTP middleware: GET /health passes (a supervisor's probe needs neither key nor Host name); otherwise,
    in this order, without an API key a Host this server does not answer to gets 400 (host_refusal), with one a
    request without the key gets 401, an unhealthy server answers 503, and a POST that is not JSON gets 415."""

    async def gate(request: Request, call_next: RequestResponseEndpoint) -> Response:
        if request.url.path != HEALTH_PATH:
            first_check = host_refusal(request, allowed_hosts) if api_key is None else key_refusal(request, api_key)
            refusal = first_check or unhealthy_refusal(service) or content_type_refusal(request)
            if refusal is not None:
                return refusal
        return await call_next(request)

    return gate


# Names a server without a key always answers to: the machine itself.
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# Bind addresses that name no host (all interfaces).
WILDCARD_ADDRESSES = frozenset({"0.0.0.0", "::", ""})


def allowed_hosts_of(bind_host: str, allowed_hosts: str | None = None) -> frozenset[str]:
    """The Host names a server without a key answers to: the loopback names, the bound address (unless it is
    a wildcard) and the comma list of --allowed_hosts ('*' among them: any)."""
    names = {name.strip().lower().strip("[]") for name in (allowed_hosts or "").split(",")}
    names.add(bind_host.strip().lower().strip("[]"))
    return (LOOPBACK_NAMES | names) - WILDCARD_ADDRESSES


def host_name(header: str) -> str:
    """A Host header's name without its port: 'example.com:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    if header.count(":") == 1:
        header = header.partition(":")[0]
    return header.rstrip(".")


def host_refusal(request: Request, allowed_hosts: frozenset[str]) -> JSONResponse | None:
    """400 to a request whose Host names none of allowed_hosts: a web page that makes its own name resolve to
    this machine (DNS rebinding) sends its own name as Host, so a browser cannot be turned against a server
    without a key. 400 rather than 421, which invites the client to retry elsewhere, or 403, which suggests that
    credentials would help."""
    if "*" in allowed_hosts or host_name(request.headers.get("host", "")) in allowed_hosts:
        return None
    return JSONResponse(error_body("This server has no API key and answers only requests whose Host header names "
                                   "it (localhost, its address or --allowed_hosts)", code="invalid_host"),
                        status_code=400)


def key_refusal(request: Request, api_key: str) -> JSONResponse | None:
    """401, in OpenAI's error format, to a request without the key."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return JSONResponse(error_body("Missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key"),
                            status_code=401)
    if not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        return JSONResponse(error_body("Incorrect API key provided", code="invalid_api_key"), status_code=401)
    return None


def unhealthy_refusal(service: CompletionService) -> JSONResponse | None:
    if service.failure is None:
        return None
    err = unhealthy_error()
    return JSONResponse(error_body(err.message, err.error_type, code=err.code), status_code=err.status)


def content_type_refusal(request: Request) -> JSONResponse | None:
    """415 to a POST whose body is not declared as JSON (application/json, with charset utf-8 if any): a
    browser sends text/plain or a form to another site without asking it first, never JSON."""
    if request.method != "POST":
        return None
    media_type, *parameters = request.headers.get("content-type", "").split(";")
    charsets = [value.strip().strip('"').lower() for key, _, value in (item.partition("=") for item in parameters)
                if key.strip().lower() == "charset"]
    if media_type.strip().lower() == "application/json" and all(c in ("utf-8", "utf8") for c in charsets):
        return None
    return JSONResponse(error_body("The request body must be JSON, sent with 'Content-Type: application/json'",
                                   code="unsupported_media_type"), status_code=415)


# Bytes still read (and dropped) after a body went over the limit: a client that is still sending
# when the server closes the connection sees a reset rather than the 413.
DRAIN_BYTES = 64 << 20


class RequestSizeLimit:
    """ASGI middleware answering 413 to a request body over max_bytes before any of it is parsed:
    a declared Content-Length over the limit is refused unread, and a body without one is counted as
    it arrives. The body (at most max_bytes) is handed on whole."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        # A client waiting for '100 Continue' sends nothing more once it reads the 413.
        drain = headers.get(b"expect", b"").lower() != b"100-continue"
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self.refuse(scope, receive, send, drain)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: nobody to answer
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self.refuse(scope, receive, send, drain and more)
        replayed = False

        async def replay() -> ASGIMessage:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def refuse(self, scope: Scope, receive: Receive, send: Send, drain: bool) -> None:
        dropped = 0
        while drain and dropped < DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return
            dropped += len(message.get("body", b""))
            drain = message.get("more_body", False)
        response = JSONResponse(error_body(f"The request body is over {self.max_bytes} bytes, the most this server "
                                           "accepts", code="request_too_large"), status_code=413)
        await response(scope, receive, send)
