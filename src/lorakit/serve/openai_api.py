#!/usr/bin/env python
"""An OpenAI-compatible HTTP server for a merged model, or a base model + LoRA adapter.

    python scripts/inference/openai_api_server.py --base_model MERGED_DIR --api_key_file key.txt
    OPENAI_SERVER_API_KEY=KEY python scripts/inference/openai_api_server.py --base_model BASE \
        --lora_model sft_lora_model --host 0.0.0.0 --port 8000

Endpoints: GET /v1/models, POST /v1/chat/completions and POST /v1/completions (both also
streamed as server-sent events). Any OpenAI client works:
OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY).

One worker thread runs every generation, one after the other: requests never share a batch or
a KV cache, so concurrent clients each get the answer they would get alone. No request can take
the server down: bodies, stop sequences, answer lengths (--max_tokens_limit), generation time
(--request_timeout) and the requests held at once are bounded (RequestLimits), sampling values
are bounded to what samples finitely (and a guard before sampling fails a request whose scores are
not finite, alone), tokenization runs off the event loop, and a generation stops when its client
goes away. A client's seed seeds its own generation only.

Without an API key the server answers only requests whose Host header names a loopback name, the
bound address or one of --allowed_hosts (400 otherwise: a web page cannot reach it by DNS
rebinding); with a key, any Host. A POST body must be sent as application/json (415 otherwise).

Health and exit contract: GET /health (no key, any Host) answers 200 {"status": "ok"}. If the
generation worker meets an accelerator error (a CUDA error such as a device-side assert, after
which the CUDA context is broken for every later request), the server turns unhealthy: /health
answers 503 {"status": "unhealthy", "reason": ...}, every other request 503 with OpenAI's error
body (code "server_unhealthy"), the server stops and the process exits with status 1 (one
`error:` line on stderr), for a supervisor to restart it. Bad flags exit with status 2.
"""

import asyncio
import contextlib
import json
import logging
import os
import secrets
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.base import RequestResponseEndpoint
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as ASGIMessage

from lorakit.core.cli import InputError, ReportedError, parse_args, run_cli
from lorakit.models.arguments import trust_remote_code_field
from lorakit.records.readers import PROMPT, Message, conversation_of
from lorakit.serve.inference import (
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
    ChatGenerator,
    Completion,
    InferenceModelArguments,
    NonFiniteScores,
    SamplingSettings,
    TextDeltaStreamer,
    load_generator,
    log_mapped_flags,
)

logger = logging.getLogger(__name__)

# Where the API key may come from without showing in `ps` (as --api_key does).
API_KEY_VARIABLE = "OPENAI_SERVER_API_KEY"


@dataclass
class ServerArguments:
    host: str = field(
        default="127.0.0.1", metadata={"help": "Address to bind; 0.0.0.0 exposes the server to the network."}
    )
    port: int = field(default=8000, metadata={"help": "TCP port."})
    api_key_file: str | None = field(
        default=None, metadata={"help": "A file holding the key that every request must send as 'Authorization: "
                                        f"Bearer KEY'; the key may also come from ${API_KEY_VARIABLE}. Without "
                                        "a key the server serves anyone who can reach it."}
    )
    api_key: str | None = field(
        default=None, metadata={"help": "The key itself: every user of this machine sees it in `ps`; prefer "
                                        f"--api_key_file or ${API_KEY_VARIABLE}."}
    )
    model_name: str | None = field(
        default=None, metadata={"help": "The model id clients name; default: the adapter's or model's directory name."}
    )
    default_max_tokens: int = field(
        default=512,
        metadata={"help": "Answer length limit for requests that set no max_tokens (capped by the context)."},
    )
    max_tokens_limit: int = field(
        default=2048,
        metadata={"help": "The most max_tokens (or max_completion_tokens) a request may ask for: above it the "
                          "request is refused with 400 naming the field, not silently cut short."},
    )
    allowed_hosts: str | None = field(
        default=None,
        metadata={"help": "Without an API key, the server answers only requests whose Host header names "
                          "localhost, 127.0.0.1, ::1 or --host (a web page cannot reach it by DNS rebinding); "
                          "this comma list adds names ('*': any). With a key, any Host is answered."},
    )
    trust_remote_code: bool = trust_remote_code_field()

    def __post_init__(self) -> None:
        if self.default_max_tokens < 1:
            raise InputError(f"--default_max_tokens {self.default_max_tokens}: must be at least 1")
        if self.max_tokens_limit < self.default_max_tokens:
            raise InputError(f"--max_tokens_limit {self.max_tokens_limit}: must be at least --default_max_tokens "
                             f"{self.default_max_tokens}")


@dataclass
class RequestLimits:
    """What one request may ask of the server. Beyond them it is refused with OpenAI's error body
    rather than let it hold the server's memory or its one generation worker."""

    max_request_bytes: int = field(default=1 << 20, metadata={"help": "Largest request body in bytes; 413 beyond."})
    max_pending_requests: int = field(
        default=32, metadata={"help": "Requests held at once (being tokenized, waiting for the generation worker or "
                                      "generating); 503 beyond, at once, instead of an ever longer queue."}
    )
    max_stop_sequences: int = field(default=4, metadata={"help": "Most stop sequences per request (OpenAI's 4)."})
    max_stop_length: int = field(
        default=64, metadata={"help": "Longest stop sequence in characters. For each new set of stops, transformers "
                                      "walks the whole vocabulary and builds a vocabulary x length table: 4 stops of "
                                      "64 characters on a 128k vocabulary take up to ~130 MB and seconds of the "
                                      "generation worker."}
    )
    request_timeout: float = field(
        default=600.0, metadata={"help": "Seconds one generation may run: past them it stops where it is and the "
                                         "answer so far is returned with finish_reason \"length\" (as at "
                                         "max_tokens)."}
    )

    def __post_init__(self) -> None:
        for name, least in (("max_request_bytes", 1024), ("max_pending_requests", 1), ("max_stop_sequences", 0),
                            ("max_stop_length", 1)):
            if getattr(self, name) < least:
                raise InputError(f"--{name} {getattr(self, name)}: must be at least {least}")
        if not 0 < self.request_timeout < float("inf"):
            raise InputError(f"--request_timeout {self.request_timeout}: must be a positive number of seconds")


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.error_type = status, message, param, code, error_type


def error_body(message: str, error_type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class Unsupported(NamedTuple):
    """A request field whose value this server cannot honour, and why."""

    param: str
    reason: str


class SamplingRequest(BaseModel):
    """Fields both completion endpoints take. top_k and repetition_penalty are extensions (as in
    vLLM). Sampling values are bounded to what samples finitely. OpenAI's fields that would change
    the answer's meaning and are not supported are declared, and refused (unsupported) at any value
    but their neutral one, which ordinary clients send; other fields are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = Field(default=None, ge=REPETITION_PENALTY_RANGE[0],
                                             le=REPETITION_PENALTY_RANGE[1], allow_inf_nan=False)
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # OpenAI's range; torch takes it
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @field_validator("temperature")
    @classmethod
    def finite_temperature(cls, value: float | None) -> float | None:
        if value is not None and 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return value

    def unsupported(self) -> list[Unsupported]:
        found = []
        if self.n not in (None, 1):
            found.append(Unsupported("n", f"n={self.n} is not supported: one choice per request"))
        if self.logit_bias:
            found.append(Unsupported("logit_bias", "logit_bias is not supported"))
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                found.append(Unsupported(name, f"{name} is not supported (repetition_penalty is)"))
        return found


def tool_use(tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, names: str) -> list[Unsupported]:
    """Tools (or the older functions) are refused unless the choice is "none": present without a choice
    means "auto"."""
    tools_name, choice_name = names.split()
    if tools and choice != "none":
        return [Unsupported(tools_name, f"{tools_name} are not supported (only with {choice_name} \"none\")")]
    if not tools and choice not in (None, "none"):
        return [Unsupported(choice_name, f"{choice_name} is not supported")]
    return []


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def unsupported(self) -> list[Unsupported]:
        found = super().unsupported()
        found += tool_use(self.tools, self.tool_choice, "tools tool_choice")
        found += tool_use(self.functions, self.function_call, "functions function_call")
        if self.response_format is not None and self.response_format.get("type") != "text":
            found.append(Unsupported("response_format", "response_format is not supported: only {\"type\": "
                                                        "\"text\"}"))
        if self.logprobs:
            found.append(Unsupported("logprobs", "logprobs is not supported"))
        if self.top_logprobs:
            found.append(Unsupported("top_logprobs", "top_logprobs is not supported"))
        return found


class CompletionRequest(SamplingRequest):
    prompt: str | list[str]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[Unsupported]:
        found = super().unsupported()
        if self.logprobs is not None:
            found.append(Unsupported("logprobs", "logprobs is not supported"))
        if self.echo:
            found.append(Unsupported("echo", "echo is not supported"))
        if self.best_of not in (None, 1):
            found.append(Unsupported("best_of", f"best_of={self.best_of} is not supported: one choice per request"))
        if self.suffix:
            found.append(Unsupported("suffix", "suffix is not supported"))
        return found


# A stream's event body from a text delta (None: no text) and a finish reason (None: not finished yet).
ChunkMaker = Callable[[str | None, str | None], dict[str, Any]]


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def request_messages(raw: list[dict[str, Any]]) -> list[Message]:
    """Validated chat messages; text content parts are joined, 'developer' is the system turn."""
    messages = []
    for index, message in enumerate(raw):
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
                       for part in content):
                raise APIError(400, f"messages[{index}].content: only text parts are supported",
                               param=f"messages[{index}].content", code="invalid_value")
            content = "".join(part["text"] for part in content)
        role = "system" if message.get("role") == "developer" else message.get("role")
        messages.append({**message, "role": role, "content": content})
    try:
        return conversation_of("request", {"messages": messages}, PROMPT)
    except InputError as err:
        raise APIError(400, str(err).removeprefix("request: "), param="messages", code="invalid_value") from None


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else [item for item in stop if item]


class RequestSlots:
    """The requests the server holds at once, each from its admission until its generation ends
    (or until it is refused). Touched from the event loop only."""

    def __init__(self, limit: int) -> None:
        self.limit, self.taken = limit, 0

    @contextlib.contextmanager
    def admission(self) -> Iterator["Slot"]:
        """A place for one request, or 503 when all are taken. The place is freed at the end of the
        block, or, once handed to a generation job (Slot.free_when_done), when that job ends."""
        if self.taken >= self.limit:
            raise APIError(503, f"The server is busy: {self.limit} requests are being served or waiting; retry later",
                           error_type="server_error", code="server_overloaded")
        self.taken += 1
        slot = Slot(self)
        try:
            yield slot
        finally:
            if not slot.handed:
                slot.free()


class Slot:
    def __init__(self, slots: RequestSlots) -> None:
        self.slots, self.handed, self.freed = slots, False, False

    def free(self, *_: object) -> None:
        if not self.freed:
            self.freed = True
            self.slots.taken -= 1

    def free_when_done(self, job: asyncio.Future) -> None:
        self.handed = True
        job.add_done_callback(self.free)


async def cancel_when_gone(request: Request, cancel: threading.Event) -> None:
    """Sets cancel once the client has gone away: with the body read, the next ASGI message is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    cancel.set()


# How an accelerator error reads when torch raises it as a plain RuntimeError rather than torch.AcceleratorError.
# Once one happened (a device-side assert, an illegal memory access) the CUDA context is broken for good.
DEVICE_ERROR_MARKERS = ("CUDA error", "device-side assert", "HIP error")


def is_device_error(err: BaseException) -> bool:
    """An accelerator error after which the process cannot generate again: torch.AcceleratorError, or a
    RuntimeError saying "CUDA error" or "device-side assert". Running out of memory is not one: the
    allocator refused, and the context is fine."""
    if isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return isinstance(err, accelerator_error) or (
        isinstance(err, RuntimeError) and any(marker in str(err) for marker in DEVICE_ERROR_MARKERS))


class CompletionService:
    """Request checks, the generation worker and the response bodies. `failure` (None while healthy) says
    why the server stopped serving; `on_failure` is called once when that happens (main: stop uvicorn);
    `fault_injection`, when set, is called in the worker before each generation (tests: an accelerator
    error cannot be caused on a CPU)."""

    def __init__(self, generator: ChatGenerator, model_name: str, default_max_tokens: int,
                 limits: RequestLimits | None = None, max_tokens_limit: int = 2048) -> None:
        self.generator = generator
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.max_tokens_limit = max_tokens_limit
        self.limits = limits or RequestLimits()
        self.slots = RequestSlots(self.limits.max_pending_requests)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        self.created = int(time.time())
        self.failure: str | None = None
        self.on_failure: Callable[[], None] = lambda: None
        self.fault_injection: Callable[[], None] | None = None

    def check_request(self, request: SamplingRequest) -> None:
        if request.model != self.model_name:
            raise APIError(404, f"The model '{request.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        unsupported = request.unsupported()
        if unsupported:
            raise APIError(400, unsupported[0].reason, param=unsupported[0].param, code="unsupported_value")
        stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
        if len(stops) > self.limits.max_stop_sequences:
            raise APIError(400, f"stop holds {len(stops)} sequences; at most {self.limits.max_stop_sequences} "
                                "are allowed", param="stop", code="invalid_value")
        longest = max(map(len, stops), default=0)
        if longest > self.limits.max_stop_length:
            raise APIError(400, f"stop holds a sequence of {longest} characters; at most "
                                f"{self.limits.max_stop_length} are allowed", param="stop", code="invalid_value")

    def settings_for(self, request: SamplingRequest, prompt_tokens: int, prompt_param: str) -> SamplingSettings:
        context = self.generator.context_tokens
        remaining = context - prompt_tokens
        if remaining < 1:
            raise APIError(400, f"This model's context holds {context} tokens, and the prompt is {prompt_tokens} "
                                "tokens, leaving no room for an answer; shorten the prompt",
                           param=prompt_param, code="context_length_exceeded")
        param = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
        max_tokens = getattr(request, "max_completion_tokens", None) or request.max_tokens
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, remaining)
        elif max_tokens > self.max_tokens_limit:
            raise APIError(400, f"{param} is {max_tokens}; this server allows at most {self.max_tokens_limit} tokens "
                                "per answer", param=param, code="invalid_value")
        elif max_tokens > remaining:
            raise APIError(400, f"{param} is {max_tokens}, but the prompt is {prompt_tokens} tokens and this "
                                f"model's context holds {context}: at most {remaining} tokens are left for the answer",
                           param=param, code="context_length_exceeded")
        return SamplingSettings(
            max_new_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            repetition_penalty=request.repetition_penalty or 1.0,
            seed=request.seed,
            time_limit=self.limits.request_timeout,
        )

    def submit(self, slot: Slot, prompt_ids: list[int], settings: SamplingSettings, stops: list[str],
               cancel: threading.Event, streamer: TextDeltaStreamer | None = None,
               on_end: Callable[[], None] | None = None) -> asyncio.Future[Completion | None]:
        """The generation queued on the worker, holding the request's slot until it ends. A job whose
        client left while it waited (cancel set) is skipped: nothing is generated for nobody."""

        def job() -> Completion | None:
            try:
                if cancel.is_set():
                    return None
                return self.generate_one(prompt_ids, settings, stops, streamer, cancel)
            finally:
                if on_end is not None:
                    on_end()

        result = asyncio.get_running_loop().run_in_executor(self.worker, job)
        slot.free_when_done(result)
        return result

    def generate_one(self, prompt_ids: list[int], settings: SamplingSettings, stops: list[str],
                     streamer: TextDeltaStreamer | None, cancel: threading.Event) -> Completion:
        """One generation, on the worker. Scores that are not finite fail this request alone (500); an
        accelerator error fails the server (fail), and every generation after it is refused (503)."""
        if self.failure is not None:
            raise unhealthy_error()
        try:
            if self.fault_injection is not None:
                self.fault_injection()
            return self.generator.generate([prompt_ids], settings, stops, streamer, cancel)[0]
        except NonFiniteScores as err:
            logger.warning("generation refused: %s (temperature %s, top_p %s, top_k %s, repetition_penalty %s)",
                           err, settings.temperature, settings.top_p, settings.top_k, settings.repetition_penalty)
            raise APIError(500, "The model's next-token scores were not finite (NaN or infinity) with this request's "
                                "sampling settings; nothing was sampled", error_type="server_error",
                           code="non_finite_scores") from err
        except Exception as err:
            if not is_device_error(err):
                raise
            self.fail(err)
            raise unhealthy_error() from err

    def fail(self, err: BaseException) -> None:
        """The accelerator failed, and (on CUDA) its context with it: from now on the server answers 503, and
        on_failure stops it; main then exits with status 1 for a supervisor to restart the process."""
        if self.failure is not None:
            return
        self.failure = f"accelerator error ({type(err).__name__}): the server is stopping"
        logger.critical("the accelerator failed: the server stops serving and exits with status 1", exc_info=err)
        self.on_failure()

    async def complete(self, slot: Slot, http_request: Request, prompt_ids: list[int], settings: SamplingSettings,
                       stops: list[str]) -> Completion | None:
        """The completion, or None when the client went away first: its generation then stops (or is
        skipped, if it was still waiting for the worker)."""
        cancel = threading.Event()
        result = self.submit(slot, prompt_ids, settings, stops, cancel)
        watch = asyncio.ensure_future(cancel_when_gone(http_request, cancel))
        try:
            completion = await result
        except asyncio.CancelledError:  # the server is stopping: so does the generation
            cancel.set()
            raise
        finally:
            watch.cancel()
        if cancel.is_set():
            logger.info("client went away: generation stopped after %s tokens",
                        completion.completion_tokens if completion else 0)
            return None
        return completion

    def stream(self, slot: Slot, prompt_ids: list[int], settings: SamplingSettings, stops: list[str],
               chunk: ChunkMaker, opening: dict[str, Any] | None = None,
               include_usage: bool = False) -> StreamingResponse:
        """Server-sent events: text deltas as the worker generates them, then the finish reason
        (and usage if asked), then [DONE]. A client that goes away stops its generation."""
        loop = asyncio.get_running_loop()
        deltas, end, cancel = asyncio.Queue(), object(), threading.Event()
        streamer = TextDeltaStreamer(self.generator.tokenizer,
                                     lambda delta: loop.call_soon_threadsafe(deltas.put_nowait, delta), stops)
        result = self.submit(slot, prompt_ids, settings, stops, cancel, streamer,
                             on_end=lambda: loop.call_soon_threadsafe(deltas.put_nowait, end))

        async def events() -> AsyncIterator[str]:
            sent = ""
            try:
                if opening is not None:
                    yield sse(opening)
                while (delta := await deltas.get()) is not end:
                    sent += delta
                    yield sse(chunk(delta, None))
                completion = await result
                rest = completion.text[len(sent):] if completion.text.startswith(sent) else ""
                if rest:
                    yield sse(chunk(rest, None))
                yield sse(chunk(None, completion.finish_reason))
                if include_usage:
                    yield sse({**chunk(None, None), "choices": [], "usage": usage(completion)})
            except APIError as err:  # the stream has begun: the error goes in it
                yield sse(error_body(err.message, err.error_type, err.param, err.code))
            except Exception as err:  # likewise, without its details
                yield sse(error_body(failure_message(err), "server_error"))
            finally:
                cancel.set()
            yield "data: [DONE]\n\n"

        # The background task also stops a generation whose client left before the first event.
        return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(cancel.set))


# nginx's status for a request whose client went away first: only the access log sees it.
CLIENT_CLOSED_REQUEST = 499


def usage(completion: Completion) -> dict[str, int]:
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens}


def include_usage(request: SamplingRequest) -> bool:
    return bool(request.stream_options and request.stream_options.get("include_usage"))


def create_app(service: CompletionService, api_key: str | None,
               allowed_hosts: frozenset[str] = frozenset()) -> FastAPI:
    """The server: the admission checks (request_gate), the body size limit, OpenAI-style error
    bodies, /health and the /v1 endpoints. The gate comes first (the middleware added last), so that
    a request it refuses gets its answer before any of its body is read."""
    app = FastAPI(title="OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.state.service = service
    app.add_middleware(RequestSizeLimit, max_bytes=service.limits.max_request_bytes)
    app.middleware("http")(request_gate(service, api_key, allowed_hosts_of("127.0.0.1") | allowed_hosts))
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    app.include_router(openai_routes(service))
    return app


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


def unhealthy_error() -> APIError:
    return APIError(503, "The server had an accelerator error and is stopping; retry once it has restarted",
                    error_type="server_error", code="server_unhealthy")


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


async def api_error(request: Request, err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.error_type, err.param, err.code), status_code=err.status)


async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    # FastAPI answers 422 in its own format; OpenAI clients expect 400 with an error body.
    problems = err.errors()
    locations = [".".join(str(part) for part in problem["loc"] if part != "body") for problem in problems]
    message = "; ".join(f"{where}: {problem['msg']}" if where else problem["msg"]
                        for where, problem in zip(locations, problems, strict=True))
    return JSONResponse(error_body(message or "invalid request", param=locations[0] if locations else None,
                                   code="invalid_value"), status_code=400)


async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(err.detail), code=None), status_code=err.status_code)


async def server_error(request: Request, err: Exception) -> JSONResponse:
    return JSONResponse(error_body(failure_message(err), "server_error"), status_code=500)


def failure_message(err: BaseException) -> str:
    """What a client is told of a failure: an id to find it in the server's log, never the exception's
    text (it may hold file paths, settings or another request's prompt)."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("request failed (error id %s)", error_id, exc_info=err)
    return f"The server had an error while processing your request (error id {error_id})"


def openai_routes(service: CompletionService) -> APIRouter:
    """GET /health, GET /v1/models, POST /v1/chat/completions and POST /v1/completions, served by service."""
    router = APIRouter()

    @router.get(HEALTH_PATH, response_model=None)
    async def health() -> JSONResponse:
        if service.failure is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "reason": service.failure}, status_code=503)

    # response_model=None: the return annotations are for readers; FastAPI would otherwise validate and
    # serialize each answer through a model made from them.
    @router.get("/v1/models", response_model=None)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": service.model_name, "object": "model",
                                            "created": service.created, "owned_by": "owner"}]}

    @router.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: ChatCompletionRequest, http_request: Request) -> Response | dict[str, Any]:
        return await chat_completion_response(service, request, http_request)

    @router.post("/v1/completions", response_model=None)
    async def completions(request: CompletionRequest, http_request: Request) -> Response | dict[str, Any]:
        return await text_completion_response(service, request, http_request)

    return router


async def chat_completion_response(service: CompletionService, request: ChatCompletionRequest,
                                   http_request: Request) -> Response | dict[str, Any]:
    """A chat.completion body, or a stream of chat.completion.chunk events."""
    generator = service.generator
    service.check_request(request)
    messages = request_messages(request.messages)
    stops = generator.chat_stops(stop_list(request.stop))
    reply_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": reply_id, "created": created, "model": service.model_name, "system_fingerprint": None}

    def chunk(text: str | None, finish_reason: str | None) -> dict[str, Any]:
        delta = {} if text is None else {"content": text}
        return {**head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    with service.slots.admission() as slot:
        # Off the event loop: rendering and tokenizing a long conversation would hold up every other client.
        prompt_ids = await run_in_threadpool(generator.encode_chat, messages)
        settings = service.settings_for(request, len(prompt_ids), "messages")
        if request.stream:
            opening = chunk("", None)
            opening["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            return service.stream(slot, prompt_ids, settings, stops, chunk, opening, include_usage(request))
        completion = await service.complete(slot, http_request, prompt_ids, settings, stops)
    if completion is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return {**head, "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": completion.text},
                         "logprobs": None, "finish_reason": completion.finish_reason}],
            "usage": usage(completion)}


async def text_completion_response(service: CompletionService, request: CompletionRequest,
                                   http_request: Request) -> Response | dict[str, Any]:
    """A text_completion body, or a stream of text_completion events."""
    service.check_request(request)
    prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
    if len(prompts) != 1:
        raise APIError(400, f"prompt holds {len(prompts)} prompts; send one per request", param="prompt",
                       code="invalid_value")
    stops = stop_list(request.stop)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": service.model_name,
            "object": "text_completion", "system_fingerprint": None}

    def chunk(text: str | None, finish_reason: str | None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "text": text or "", "logprobs": None,
                                     "finish_reason": finish_reason}]}

    with service.slots.admission() as slot:
        prompt_ids = await run_in_threadpool(service.generator.encode_text, prompts[0])  # off the event loop
        if not prompt_ids:
            raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
        settings = service.settings_for(request, len(prompt_ids), "prompt")
        if request.stream:
            return service.stream(slot, prompt_ids, settings, stops, chunk, include_usage=include_usage(request))
        completion = await service.complete(slot, http_request, prompt_ids, settings, stops)
    if completion is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return {**head, "choices": [{"index": 0, "text": completion.text, "logprobs": None,
                                 "finish_reason": completion.finish_reason}],
            "usage": usage(completion)}


def api_key_of(args: ServerArguments) -> str | None:
    """The key every request must send: from --api_key_file, --api_key or $OPENAI_SERVER_API_KEY, in
    that order; None (serve without one) when none is given."""
    if args.api_key is not None and args.api_key_file is not None:
        raise InputError("--api_key and --api_key_file: give the key one way (--api_key_file keeps it out of ps)")
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as key_file:
                key, source = key_file.read().strip(), f"{args.api_key_file}: --api_key_file"
        except OSError as err:
            raise InputError(f"{args.api_key_file}: --api_key_file cannot be read ({err.strerror or err})") from None
    elif args.api_key is not None:
        logger.warning("--api_key shows the key to every user of this machine (ps); prefer --api_key_file or $%s",
                       API_KEY_VARIABLE)
        key, source = args.api_key.strip(), "--api_key"
    elif API_KEY_VARIABLE in os.environ:
        key, source = os.environ[API_KEY_VARIABLE].strip(), f"${API_KEY_VARIABLE}"
    else:
        return None
    if not key:
        raise InputError(f"{source}: the API key is empty")
    return key


def main() -> None:
    model_args, server_args, limits = parse_args((InferenceModelArguments, ServerArguments, RequestLimits))
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.INFO, stream=sys.stderr, force=True)
    log_mapped_flags(model_args)
    api_key = api_key_of(server_args)
    generator = load_generator(model_args, server_args.trust_remote_code)
    name = server_args.model_name or os.path.basename(os.path.normpath(model_args.lora_model or model_args.base_model))
    service = CompletionService(generator, name, server_args.default_max_tokens, limits, server_args.max_tokens_limit)
    allowed_hosts = allowed_hosts_of(server_args.host, server_args.allowed_hosts)
    app = create_app(service, api_key, allowed_hosts)
    log_exposure(server_args.host, api_key, allowed_hosts)
    logger.info("serving %s on http://%s:%d/v1", name, server_args.host, server_args.port)
    import uvicorn

    # A grace period for the responses under way when the server stops: after an accelerator error
    # every generation left fails at once, so only a client that reads slowly can hold it up.
    server = uvicorn.Server(uvicorn.Config(app, host=server_args.host, port=server_args.port, log_level="info",
                                           timeout_graceful_shutdown=10))

    def stop() -> None:
        server.should_exit = True

    service.on_failure = stop
    server.run()
    if service.failure is not None:
        raise ReportedError(f"{service.failure}; exit status 1, for a supervisor to restart the server")


def log_exposure(host: str, api_key: str | None, allowed_hosts: frozenset[str]) -> None:
    """Who the server answers, said at start-up."""
    if api_key is not None:
        return
    if "*" in allowed_hosts:
        logger.warning("serving on %s without an API key (--api_key_file or $%s) and with --allowed_hosts '*': "
                       "anyone who can reach it can use it, a web page in a browser on this machine included",
                       host, API_KEY_VARIABLE)
        return
    logger.info("without an API key, only requests whose Host header names %s are answered (400 otherwise; "
                "--allowed_hosts adds names)", ", ".join(sorted(allowed_hosts)))
    if host in WILDCARD_ADDRESSES:
        named = ", ".join(sorted(allowed_hosts - LOOPBACK_NAMES)) or "none: no --allowed_hosts"
        logger.warning("serving on %s without an API key: other machines are served only under the names of "
                       "--allowed_hosts (%s), and then to anyone who can reach the server; a key (--api_key_file or "
                       "$%s) serves any name", host, named, API_KEY_VARIABLE)
    elif host not in LOOPBACK_NAMES:
        logger.warning("serving on %s without an API key (--api_key_file or $%s): anyone who can reach it can use it",
                       host, API_KEY_VARIABLE)


def entry_point() -> None:
    """The command line's entry point: its script and `lorakit` command (lorakit.commands)."""
    run_cli(main)


if __name__ == "__main__":
    entry_point()
