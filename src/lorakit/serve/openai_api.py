"""The OpenAI-compatible server's app (create_app): the security gate (request_gate) in front, OpenAI-style
error bodies for every failure, GET /health, GET /v1/models, POST /v1/chat/completions and POST
/v1/completions (both also streamed as server-sent events), each answered by the completion service. A failure
is answered with an error id, its details only in the log. The command, its flags and its exit contract:
`lorakit serve`."""

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from lorakit.serve.completion_service import CompletionService, failure_message
from lorakit.serve.openai_protocol import (
    CLIENT_CLOSED_REQUEST,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    include_usage,
    request_messages,
    stop_list,
    usage,
)
from lorakit.serve.request_gate import HEALTH_PATH, RequestSizeLimit, allowed_hosts_of, request_gate


def create_app(service: CompletionService, api_key: str | None,
               allowed_hosts: frozenset[str] = frozenset()) -> FastAPI:
    """The server: the admission checks (request_gate), the body size limit, OpenAI-style error
    bodies, /health and the /v1 endpoints. The gate comes first (the middleware added last), so that
    a request it refuses gets its answer before any of its body is read."""
    app = FastAPI(title="OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.state.service = service
    app.add_middleware(RequestSizeLimit, max_bytes=service.limits.max_request_bytes)
    app.middleware("http")(request_gate(service, api_key, allowed_hosts_of("127.0.0.1") | allowed_hosts))
    add_error_handler(app, APIError, api_error)
    add_error_handler(app, RequestValidationError, validation_error)
    add_error_handler(app, StarletteHTTPException, http_error)
    add_error_handler(app, Exception, server_error)
    app.include_router(openai_routes(service))
    return app


Error = TypeVar("Error", bound=Exception)


def add_error_handler(app: FastAPI, error_type: type[Error],
                      handler: Callable[[Request, Error], Awaitable[JSONResponse]]) -> None:
    """app.add_exception_handler(error_type, handler). Starlette calls the handler with error_type's exceptions alone,
    which its signature (a handler of any Exception) cannot say: the cast is safe for the type registered with it."""
    app.add_exception_handler(error_type, cast(Callable[[Request, Exception], Awaitable[JSONResponse]], handler))


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
