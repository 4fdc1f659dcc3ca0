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

import logging
import os
import sys

from lorakit.core.cli import InputError, ReportedError, parse_args, run_cli
from lorakit.serve.completion_service import CompletionService
from lorakit.serve.inference import InferenceModelArguments, load_generator, log_mapped_flags
from lorakit.serve.openai_api import create_app
from lorakit.serve.request_gate import LOOPBACK_NAMES, WILDCARD_ADDRESSES, allowed_hosts_of
from lorakit.serve.server_config import API_KEY_VARIABLE, RequestLimits, ServerArguments

logger = logging.getLogger(__name__)


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
