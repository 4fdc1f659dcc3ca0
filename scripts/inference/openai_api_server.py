#!/usr/bin/env python
"""An OpenAI-compatible HTTP server for a merged model, or a base model + LoRA adapter.

    python scripts/inference/openai_api_server.py --base_model MERGED_DIR --api_key KEY
    python scripts/inference/openai_api_server.py --base_model BASE --lora_model sft_lora_model \
        --host 0.0.0.0 --port 8000 --api_key KEY

Endpoints: GET /v1/models, POST /v1/chat/completions and POST /v1/completions (both also
streamed as server-sent events). Any OpenAI client works:
OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY).

One worker thread runs every generation, one after the other: requests never share a batch or
a KV cache, so concurrent clients each get the answer they would get alone.
"""

import asyncio
import json
import logging
import os
import secrets
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional, Union

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(SCRIPTS, "inference"), os.path.join(SCRIPTS, "training")]

from fastapi import APIRouter, FastAPI, Request  # noqa: E402
from fastapi.exceptions import RequestValidationError  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402
from starlette.exceptions import HTTPException as StarletteHTTPException  # noqa: E402

from cli import InputError, parse_args, run_cli  # noqa: E402
from inference_utils import (  # noqa: E402
    ChatGenerator,
    InferenceModelArguments,
    SamplingSettings,
    TextDeltaStreamer,
    chat_template_of,
    context_limit,
    inference_tokenizer,
    load_for_inference,
    log_mapped_flags,
    template_kwargs_of,
)
from model_utils import trust_remote_code_field  # noqa: E402
from records import PROMPT, conversation_of  # noqa: E402

logger = logging.getLogger(__name__)


@dataclass
class ServerArguments:
    host: str = field(
        default="127.0.0.1", metadata={"help": "Address to bind; 0.0.0.0 exposes the server to the network."}
    )
    port: int = field(default=8000, metadata={"help": "TCP port."})
    api_key: Optional[str] = field(
        default=None, metadata={"help": "Require 'Authorization: Bearer KEY' on every request."}
    )
    model_name: Optional[str] = field(
        default=None, metadata={"help": "The model id clients name; default: the adapter's or model's directory name."}
    )
    default_max_tokens: int = field(
        default=512,
        metadata={"help": "Answer length limit for requests that set no max_tokens (capped by the context)."},
    )
    trust_remote_code: bool = trust_remote_code_field()


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 error_type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.error_type = status, message, param, code, error_type


def error_body(message: str, error_type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class SamplingRequest(BaseModel):
    """Fields both completion endpoints take. top_k and repetition_penalty are extensions (as in
    vLLM); fields of OpenAI's API that change nothing here are accepted and ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0, le=2)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    top_k: Optional[int] = Field(default=None, ge=0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0)
    n: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[dict[str, Any]] = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[str]]


def sse(payload) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def request_messages(raw: list) -> list:
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


def stop_list(stop) -> list:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else [item for item in stop if item]


class CompletionService:
    """Request checks, the generation worker and the response bodies."""

    def __init__(self, generator: ChatGenerator, model_name: str, default_max_tokens: int):
        self.generator = generator
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        self.created = int(time.time())

    def check_request(self, request: SamplingRequest) -> None:
        if request.model != self.model_name:
            raise APIError(404, f"The model '{request.model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        if request.n not in (None, 1):
            raise APIError(400, f"n={request.n} is not supported: one choice per request", param="n",
                           code="invalid_value")

    def settings_for(self, request: SamplingRequest, prompt_tokens: int, prompt_param: str) -> SamplingSettings:
        context = self.generator.context_tokens
        remaining = context - prompt_tokens
        if remaining < 1:
            raise APIError(400, f"This model's context holds {context} tokens, and the prompt is {prompt_tokens} "
                                "tokens, leaving no room for an answer; shorten the prompt",
                           param=prompt_param, code="context_length_exceeded")
        max_tokens = getattr(request, "max_completion_tokens", None) or request.max_tokens
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, remaining)
        elif max_tokens > remaining:
            raise APIError(400, f"max_tokens is {max_tokens}, but the prompt is {prompt_tokens} tokens and this "
                                f"model's context holds {context}: at most {remaining} tokens are left for the answer",
                           param="max_tokens", code="context_length_exceeded")
        return SamplingSettings(
            max_new_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=request.top_k or 0,
            repetition_penalty=request.repetition_penalty or 1.0,
            seed=request.seed,
        )

    async def complete(self, prompt_ids: list, settings: SamplingSettings, stops: list):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.worker,
                                          lambda: self.generator.generate([prompt_ids], settings, stops)[0])

    async def stream(self, prompt_ids: list, settings: SamplingSettings, stops: list, chunk, opening=None,
                     include_usage: bool = False):
        """Server-sent events: text deltas as the worker generates them, then the finish reason
        (and usage if asked), then [DONE]. A client that goes away stops its generation."""
        loop = asyncio.get_running_loop()
        deltas, end, cancel = asyncio.Queue(), object(), threading.Event()
        streamer = TextDeltaStreamer(self.generator.tokenizer,
                                     lambda delta: loop.call_soon_threadsafe(deltas.put_nowait, delta), stops)

        def job():
            try:
                return self.generator.generate([prompt_ids], settings, stops, streamer, cancel)[0]
            finally:
                loop.call_soon_threadsafe(deltas.put_nowait, end)

        result = loop.run_in_executor(self.worker, job)
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
        except Exception as err:  # the stream has begun: report the failure in it
            logger.exception("generation failed")
            yield sse(error_body(f"generation failed: {err}", "server_error"))
        finally:
            cancel.set()
        yield "data: [DONE]\n\n"


def usage(completion) -> dict:
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens}


def include_usage(request: SamplingRequest) -> bool:
    return bool(request.stream_options and request.stream_options.get("include_usage"))


def create_app(service: CompletionService, api_key: Optional[str]) -> FastAPI:
    """The server: the API key check, OpenAI-style error bodies, and the /v1 endpoints."""
    app = FastAPI(title="OpenAI-compatible API", docs_url=None, redoc_url=None)
    app.middleware("http")(api_key_check(api_key))
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    app.include_router(openai_routes(service))
    return app


def api_key_check(api_key: Optional[str]):
    """HTTP middleware answering 401, in OpenAI's error format, to a request without the key
    (every request passes when the server has no key)."""

    async def require_api_key(request: Request, call_next):
        if api_key is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                return JSONResponse(error_body("Missing API key: send 'Authorization: Bearer KEY'",
                                               code="invalid_api_key"), status_code=401)
            if not secrets.compare_digest(token.strip().encode(), api_key.encode()):
                return JSONResponse(error_body("Incorrect API key provided", code="invalid_api_key"),
                                    status_code=401)
        return await call_next(request)

    return require_api_key


async def api_error(request: Request, err: APIError):
    return JSONResponse(error_body(err.message, err.error_type, err.param, err.code), status_code=err.status)


async def validation_error(request: Request, err: RequestValidationError):
    # FastAPI answers 422 in its own format; OpenAI clients expect 400 with an error body.
    problems = err.errors()
    locations = [".".join(str(part) for part in problem["loc"] if part != "body") for problem in problems]
    message = "; ".join(f"{where}: {problem['msg']}" if where else problem["msg"]
                        for where, problem in zip(locations, problems))
    return JSONResponse(error_body(message or "invalid request", param=locations[0] if locations else None,
                                   code="invalid_value"), status_code=400)


async def http_error(request: Request, err: StarletteHTTPException):
    return JSONResponse(error_body(str(err.detail), code=None), status_code=err.status_code)


async def server_error(request: Request, err: Exception):
    logger.exception("request failed")
    return JSONResponse(error_body(f"the server failed: {err}", "server_error"), status_code=500)


def openai_routes(service: CompletionService) -> APIRouter:
    """GET /v1/models, POST /v1/chat/completions and POST /v1/completions, served by service."""
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model",
                                            "created": service.created, "owned_by": "owner"}]}

    @router.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest):
        return await chat_completion_response(service, request)

    @router.post("/v1/completions")
    async def completions(request: CompletionRequest):
        return await text_completion_response(service, request)

    return router


async def chat_completion_response(service: CompletionService, request: ChatCompletionRequest):
    """A chat.completion body, or a stream of chat.completion.chunk events."""
    generator = service.generator
    service.check_request(request)
    prompt_ids = generator.encode_chat(request_messages(request.messages))
    settings = service.settings_for(request, len(prompt_ids), "messages")
    stops = generator.chat_stops(stop_list(request.stop))
    reply_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": reply_id, "created": created, "model": service.model_name, "system_fingerprint": None}
    if request.stream:
        def chunk(text, finish_reason):
            delta = {} if text is None else {"content": text}
            return {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

        opening = chunk("", None)
        opening["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        events = service.stream(prompt_ids, settings, stops, chunk, opening, include_usage(request))
        return StreamingResponse(events, media_type="text/event-stream")
    completion = await service.complete(prompt_ids, settings, stops)
    return {**head, "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": completion.text},
                         "logprobs": None, "finish_reason": completion.finish_reason}],
            "usage": usage(completion)}


async def text_completion_response(service: CompletionService, request: CompletionRequest):
    """A text_completion body, or a stream of text_completion events."""
    service.check_request(request)
    prompts = [request.prompt] if isinstance(request.prompt, str) else request.prompt
    if len(prompts) != 1:
        raise APIError(400, f"prompt holds {len(prompts)} prompts; send one per request", param="prompt",
                       code="invalid_value")
    prompt_ids = service.generator.encode_text(prompts[0])
    if not prompt_ids:
        raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
    settings = service.settings_for(request, len(prompt_ids), "prompt")
    stops = stop_list(request.stop)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": service.model_name,
            "object": "text_completion", "system_fingerprint": None}
    if request.stream:
        def chunk(text, finish_reason):
            return {**head, "choices": [{"index": 0, "text": text or "", "logprobs": None,
                                         "finish_reason": finish_reason}]}

        events = service.stream(prompt_ids, settings, stops, chunk, include_usage=include_usage(request))
        return StreamingResponse(events, media_type="text/event-stream")
    completion = await service.complete(prompt_ids, settings, stops)
    return {**head, "choices": [{"index": 0, "text": completion.text, "logprobs": None,
                                 "finish_reason": completion.finish_reason}],
            "usage": usage(completion)}


def main():
    model_args, server_args = parse_args((InferenceModelArguments, ServerArguments))
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.INFO, stream=sys.stderr, force=True)
    log_mapped_flags(model_args)
    tokenizer = inference_tokenizer(model_args.base_model, model_args.lora_model,
                                    trust_remote_code=server_args.trust_remote_code,
                                    tokenizer_path=model_args.tokenizer_path)
    template = chat_template_of(tokenizer, model_args.template)
    model, tokenizer = load_for_inference(model_args.base_model, model_args.lora_model,
                                          model_args.load_in_kbits, model_args.dtype, tokenizer,
                                          trust_remote_code=server_args.trust_remote_code,
                                          tokenizer_path=model_args.tokenizer_path, device=model_args.device)
    generator = ChatGenerator(model, tokenizer, template, context_limit(model, model_args.max_context_tokens),
                              template_kwargs_of(model_args))
    name = server_args.model_name or os.path.basename(os.path.normpath(model_args.lora_model or model_args.base_model))
    service = CompletionService(generator, name, server_args.default_max_tokens)
    app = create_app(service, server_args.api_key)
    if server_args.api_key is None and server_args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without --api_key: anyone who can reach it can use it", server_args.host)
    logger.info("serving %s on http://%s:%d/v1", name, server_args.host, server_args.port)
    import uvicorn

    uvicorn.run(app, host=server_args.host, port=server_args.port, log_level="info")


if __name__ == "__main__":
    run_cli(main)
