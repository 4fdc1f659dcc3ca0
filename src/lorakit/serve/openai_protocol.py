"""OpenAI's wire format as the server speaks it: the request bodies (their bounds, and the fields refused at
any but their neutral value), OpenAI's error body and the APIError answered with it, a request's chat messages
and stop sequences, server-sent events and the usage block. Plain values in, bodies out: no model, no worker."""

import json
from collections.abc import Callable
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lorakit.core.cli import InputError
from lorakit.records.readers import PROMPT, Message, conversation_of
from lorakit.serve.inference import MAX_TEMPERATURE, MIN_TEMPERATURE, REPETITION_PENALTY_RANGE, Completion


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
        # A bias of 0 changes no score: clients send {"50256": 0} as others send presence_penalty 0.
        if self.logit_bias and any(bias != 0 for bias in self.logit_bias.values()):
            found.append(Unsupported("logit_bias", "logit_bias is not supported (only biases of 0)"))
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


# nginx's status for a request whose client went away first: only the access log sees it.
CLIENT_CLOSED_REQUEST = 499


def usage(completion: Completion) -> dict[str, int]:
    return {"prompt_tokens": completion.prompt_tokens, "completion_tokens": completion.completion_tokens,
            "total_tokens": completion.prompt_tokens + completion.completion_tokens}


def include_usage(request: SamplingRequest) -> bool:
    return bool(request.stream_options and request.stream_options.get("include_usage"))


def unhealthy_error() -> APIError:
    return APIError(503, "The server had an accelerator error and is stopping; retry once it has restarted",
                    error_type="server_error", code="server_unhealthy")
