"""The server's completion service: request checks against the model and the limits, the one generation
worker (every generation runs on it, one after the other: requests never share a batch or a KV cache), the
requests held at once (RequestSlots), a generation stopped when its client goes away, the answer whole or
streamed, and the health contract: an accelerator error turns the service unhealthy for good."""

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from lorakit.records.readers import lone_surrogate_in, surrogate_message
from lorakit.serve.inference import ChatGenerator, Completion, NonFiniteScores, SamplingSettings, TextDeltaStreamer
from lorakit.serve.openai_protocol import (
    APIError,
    ChunkMaker,
    SamplingRequest,
    error_body,
    sse,
    unhealthy_error,
    usage,
)
from lorakit.serve.server_config import RequestLimits

logger = logging.getLogger(__name__)


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
    why the server stopped serving; `on_failure` is called once when that happens (the command's main: stop
    uvicorn); `fault_injection`, when set, is called in the worker before each generation (tests: an accelerator
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
        # First: the tokenizer raises TypeError on a lone surrogate (a 500), and no answer can echo one back (an error
        # body naming the model would fail to encode as UTF-8).
        surrogate = lone_surrogate_in(request.model_dump())
        if surrogate is not None:
            raise APIError(400, surrogate_message(surrogate), param=surrogate.field_name, code="invalid_value")
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
               on_end: Callable[[], object] | None = None) -> asyncio.Future[Completion | None]:
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
        on_failure stops it; the command's main (lorakit.commands.serve) then exits with status 1 for a supervisor
        to restart the process."""
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
        deltas: asyncio.Queue[str | None] = asyncio.Queue()  # the text deltas, then None at the end
        cancel = threading.Event()
        streamer = TextDeltaStreamer(self.generator.tokenizer,
                                     lambda delta: loop.call_soon_threadsafe(deltas.put_nowait, delta), stops)
        result = self.submit(slot, prompt_ids, settings, stops, cancel, streamer,
                             on_end=lambda: loop.call_soon_threadsafe(deltas.put_nowait, None))

        async def events() -> AsyncIterator[str]:
            sent = ""
            try:
                if opening is not None:
                    yield sse(opening)
                while (delta := await deltas.get()) is not None:
                    sent += delta
                    yield sse(chunk(delta, None))
                completion = await result
                assert completion is not None  # submit skips a job once cancel is set: only this stream's end sets it
                rest = completion.text[len(sent):] if completion.text.startswith(sent) else ""
                if rest:
                    yield sse(chunk(rest, None))
                yield sse(chunk(None, completion.finish_reason))
                if include_usage:
                    yield sse({**chunk(None, None), "choices": [], "usage": usage(completion)})
            except APIError as err:  # the stream has begun: the error goes in it
                yield sse(error_body(err.message, err.error_type, err.param, err.code))
            except Exception as err:  # noqa: BLE001 likewise, without its details (any failure ends the stream)
                yield sse(error_body(failure_message(err), "server_error"))
            finally:
                cancel.set()
            yield "data: [DONE]\n\n"

        # The background task also stops a generation whose client left before the first event.
        return StreamingResponse(events(), media_type="text/event-stream", background=BackgroundTask(cancel.set))


def failure_message(err: BaseException) -> str:
    """What a client is told of a failure: an id to find it in the server's log, never the exception's
    text (it may hold file paths, settings or another request's prompt)."""
    error_id = uuid.uuid4().hex[:12]
    logger.error("request failed (error id %s)", error_id, exc_info=err)
    return f"The server had an error while processing your request (error id {error_id})"
