"""The OpenAI-compatible server's arguments (`lorakit serve`, lorakit.commands.serve): how it binds and who it
answers (ServerArguments), and what one request may ask of it (RequestLimits, which the completion service
also reads)."""

from dataclasses import dataclass, field

from lorakit.core.cli import InputError
from lorakit.models.arguments import trust_remote_code_field

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
