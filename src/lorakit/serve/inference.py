"""What the chat CLI, batch generation and the OpenAI-compatible server share: loading a merged
model or base + LoRA for generation, prompts rendered with the chat template saved at training
time, history trimmed to the context, left-padded batched generation with stop strings, and
streaming text deltas."""

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from time import monotonic
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.streamers import BaseStreamer

from lorakit.core.cli import InputError, ReportedError
from lorakit.core.fingerprints import FingerprintMemo, save_weights_memo, user_memo_root
from lorakit.core.model_files import check_adapter_base, check_adapter_fits_base, checkpoint_shapes, has_tokenizer
from lorakit.models.arguments import DTYPES, FlagTable, MappedFlag, ModelArguments, map_flags
from lorakit.models.loader import load_model, load_model_config, load_tokenizer
from lorakit.records.chat_templates import (
    TEMPLATES,
    named_template,
    parse_template_kwargs,
    render_text,
    saved_template_kwargs,
    special_token_texts,
    turn_end_text,
)
from lorakit.records.control_text import encode_prompt, encode_text_prompt
from lorakit.records.readers import Message

if TYPE_CHECKING:  # annotations only: transformers' model and tokenizer classes load with the model
    from peft import PeftModel
    from transformers import GenerationMixin, PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass
class InferenceModelArguments:
    """Which model to serve and how prompts are rendered."""

    base_model: str = field(metadata={"help": "A merged model, or the base of --lora_model (HF format directory)."})
    lora_model: str | None = field(
        default=None,
        metadata={"help": "A LoRA adapter directory (e.g. sft_lora_model); its tokenizer is used if it has one."},
    )
    load_in_kbits: int = field(
        default=16, metadata={"help": "4 or 8: quantize the base with bitsandbytes; 16: no.", "choices": [4, 8, 16]}
    )
    dtype: str = field(default="auto", metadata={"help": "dtype of the loaded weights.", "choices": list(DTYPES)})
    template: str | None = field(
        default=None,
        metadata={"help": f"Chat template if the tokenizer saved none: {', '.join(sorted(TEMPLATES))}."},
    )
    template_kwargs: str | None = field(
        default=None, metadata={"help": "Keyword arguments of the chat template as a JSON object; default: those "
                                "training saved with the tokenizer (chat_template_kwargs.json)."})
    enable_thinking: bool | None = field(
        default=None, metadata={"help": "Passed to templates that take it (Qwen3); overrides the saved value."})
    max_context_tokens: int | None = field(
        default=None, metadata={"help": "Prompt + answer tokens; default: the model's max_position_embeddings."}
    )
    tokenizer_path: str | None = field(
        default=None,
        metadata={"help": "Tokenizer directory; default: --lora_model's if it saved one, else --base_model's."},
    )
    allow_other_base: bool = field(
        default=False,
        metadata={"help": "Serve --lora_model although its recorded base (lorakit_base.json) has other weights than "
                          "--base_model's (refused otherwise)."},
    )
    device: str | None = field(
        default=None, metadata={"help": "cpu, cuda or cuda:N; default: the first GPU if there is one, else the CPU."}
    )
    load_in_8bit: bool = field(default=False, metadata={"help": "Chinese-LLaMA-Alpaca-2's --load_in_kbits 8."})
    load_in_4bit: bool = field(default=False, metadata={"help": "Chinese-LLaMA-Alpaca-2's --load_in_kbits 4."})
    only_cpu: bool = field(default=False, metadata={"help": "Chinese-LLaMA-Alpaca-2's --device cpu."})
    gpus: str | None = field(
        default=None, metadata={"help": "Chinese-LLaMA-Alpaca-2's GPU choice: one index N is --device cuda:N, "
                                        "an empty string --device cpu."}
    )

    def __post_init__(self) -> None:
        # Logged by log_mapped_flags once the script has configured logging.
        self.mapped_flags: list[str] = []
        map_flags(self, ANCHOR_INFERENCE_FLAGS, self.mapped_flags)


def device_of_gpus(gpus: str) -> MappedFlag:
    """Chinese-LLaMA-Alpaca-2's --gpus (it sets CUDA_VISIBLE_DEVICES and spreads the model over those
    GPUs) as one device: the model runs on one device here; with no GPU, as there, on the CPU."""
    indices = [index.strip() for index in gpus.split(",") if index.strip()]
    if not indices:
        return MappedFlag("device", "cpu")
    if len(indices) > 1 or not indices[0].isdigit():
        raise InputError(f"--gpus {gpus}: the model runs on one device here, not spread over several GPUs; "
                         "choose it with --device cuda:N (or --device cpu)")
    if not torch.cuda.is_available():
        return MappedFlag("device", "cpu", "no GPU here")
    return MappedFlag("device", f"cuda:{indices[0]}", "the GPU of that index among the visible ones")


# Chinese-LLaMA-Alpaca-2's inference flags (inference_hf.py, openai_api_server.py) -> what each means here.
ANCHOR_INFERENCE_FLAGS: FlagTable = {
    "load_in_8bit": lambda on: MappedFlag("load_in_kbits", 8),
    "load_in_4bit": lambda on: MappedFlag("load_in_kbits", 4),
    "only_cpu": lambda on: MappedFlag("device", "cpu"),
    "gpus": device_of_gpus,
}


def log_mapped_flags(*argument_groups: object) -> None:
    """The 'flag mapped' lines of the parsed argument dataclasses, once logging is configured."""
    for arguments in argument_groups:
        for note in getattr(arguments, "mapped_flags", []):
            logger.info("flag mapped: %s", note)


# Sampling values that sample finitely (the server and chat refuse others): below 0.01 a temperature scales the
# scores to infinity; a repetition penalty far from 1 does the same to the repeated tokens' scores.
MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 2.0
REPETITION_PENALTY_RANGE = (0.5, 2.0)


@dataclass
class SamplingSettings:
    """How one generation samples; temperature 0 means greedy."""

    max_new_tokens: int = 400
    temperature: float = 0.2
    top_p: float = 0.9
    top_k: int = 40
    repetition_penalty: float = 1.1
    # Seeds this generation alone (private_rng): the process's random state is left as it was.
    seed: int | None = None
    # Seconds the generation may run; past them it stops where it is, finish_reason "length". None: no limit.
    time_limit: float | None = None


@dataclass
class Completion:
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int


def tokenizer_dir_of(base_model: str, lora_model: str | None, tokenizer_path: str | None = None) -> str:
    """--tokenizer_path, else the adapter directory when it has a tokenizer (training saved it there
    with the chat template and any added tokens), else the base model's."""
    if tokenizer_path:
        return tokenizer_path
    return lora_model if has_tokenizer(lora_model) else base_model


def inference_model_arguments(base_model: str, lora_model: str | None, load_in_kbits: int = 16,
                              dtype: str = "auto", trust_remote_code: bool = False,
                              tokenizer_path: str | None = None) -> ModelArguments:
    """The training scripts' ModelArguments for this model, its directories checked."""
    if not os.path.isfile(os.path.join(base_model, "config.json")):
        raise InputError(f"{base_model}: --base_model is not a model directory (no config.json)")
    if lora_model and not os.path.isfile(os.path.join(lora_model, "adapter_config.json")):
        raise InputError(f"{lora_model}: --lora_model is not a LoRA adapter (no adapter_config.json)")
    checkpoint_shapes(base_model)  # a truncated or damaged weights file is refused here
    if lora_model:
        check_adapter_fits_base(lora_model, base_model, "--lora_model")
    tokenizer_dir = tokenizer_dir_of(base_model, lora_model, tokenizer_path)
    return ModelArguments(model_name_or_path=base_model, tokenizer_name_or_path=tokenizer_dir, peft_path=lora_model,
                          torch_dtype=dtype, load_in_kbits=load_in_kbits, trust_remote_code=trust_remote_code)


def inference_tokenizer(base_model: str, lora_model: str | None = None, trust_remote_code: bool = False,
                        tokenizer_path: str | None = None) -> "PreTrainedTokenizerBase":
    return load_tokenizer(inference_model_arguments(base_model, lora_model, trust_remote_code=trust_remote_code,
                                                    tokenizer_path=tokenizer_path))


def inference_device(requested: str | None, load_in_kbits: int = 16) -> torch.device:
    """Where the model runs: --device, else the first GPU if there is one, else the CPU. A quantized
    model is placed by its loader (on the first GPU if there is one), so it takes no other device."""
    default = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if requested is None:
        return default
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise InputError(f"--device {requested}: not a device (cpu, cuda or cuda:N)") from None
    if device.type == "cuda":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= visible:
            raise InputError(f"--device {requested}: {visible} GPU(s) visible here; use --device cpu or cuda:N")
        device = torch.device("cuda", device.index or 0)
    if load_in_kbits != 16 and device != default:
        raise InputError(f"--device {requested} with --load_in_kbits {load_in_kbits}: a quantized model loads on "
                         f"{default} here; drop one of them")
    return device


class LoadedModel(NamedTuple):
    """A model ready to generate (eval mode, on its device) and the tokenizer it goes with."""

    model: "PreTrainedModel | PeftModel"  # peft's wrapper where the adapter stays apart (a quantized base)
    tokenizer: "PreTrainedTokenizerBase"


def load_for_inference(base_model: str, lora_model: str | None = None, load_in_kbits: int = 16,
                       dtype: str = "auto", tokenizer: "PreTrainedTokenizerBase | None" = None,
                       trust_remote_code: bool = False, tokenizer_path: str | None = None,
                       device: str | None = None) -> LoadedModel:
    """(model in eval mode, tokenizer) from a merged model or base + LoRA adapter (merged into
    the base unless the base is quantized), on --device."""
    model_args = inference_model_arguments(base_model, lora_model, load_in_kbits, dtype, trust_remote_code,
                                           tokenizer_path)
    place = inference_device(device, load_in_kbits)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_args)
    # The config passed in skips the training checks: rows the tokenizer adds beyond the base's
    # come from the adapter's saved embed_tokens/lm_head (vocabulary extension), or start at the mean.
    model = load_model(model_args, None, tokenizer, config=load_model_config(model_args), trainable=False,
                       adapter_flag="--lora_model")
    if load_in_kbits == 16 and place.type != "cpu":
        # transformers wraps PreTrainedModel.to in functools.wraps, whose stub leaves self unbound.
        model = model.to(place)  # type: ignore[arg-type]
    model.eval()
    logger.info("loaded %s%s (%s, %s)", base_model, f" + {lora_model}" if lora_model else "",
                next(model.parameters()).dtype, model.device)
    return LoadedModel(model, tokenizer)


def chat_template_of(tokenizer: "PreTrainedTokenizerBase", requested: str | None) -> str:
    """--template, else the template training saved with the tokenizer; none at all is refused,
    since a guessed format would not be the one the model was trained on."""
    if requested:
        return named_template(requested, tokenizer)
    if tokenizer.chat_template:
        return tokenizer.chat_template
    raise InputError(
        f"the tokenizer has no chat_template: give --template ({', '.join(sorted(TEMPLATES))}) "
        "as used in training"
    )


def template_kwargs_of(model_args: InferenceModelArguments) -> dict[str, Any]:
    """The template's keyword arguments: those training saved with the tokenizer in use (the
    adapter's if it has one), overridden by --template_kwargs / --enable_thinking."""
    saved = saved_template_kwargs(tokenizer_dir_of(model_args.base_model, model_args.lora_model,
                                                   model_args.tokenizer_path))
    return saved | parse_template_kwargs(model_args.template_kwargs, model_args.enable_thinking)


def template_turn_end(tokenizer: "PreTrainedTokenizerBase", template: str,
                      template_kwargs: dict[str, Any] | None = None) -> str:
    """What the template writes after an answer before EOS (e.g. chatml's <|im_end|> when EOS is
    </s>): generation stops there too, so it never shows up in a reply."""
    text, special = turn_end_text(tokenizer, template, template_kwargs)
    if special and tokenizer.eos_token and text.endswith(tokenizer.eos_token):
        text = text[: -len(tokenizer.eos_token)]
    return text.strip()


def context_limit(model: "PreTrainedModel | PeftModel", requested: int | None) -> int:
    max_positions = getattr(model.config, "max_position_embeddings", None) or 2048
    if requested is None:
        return max_positions
    if not 2 <= requested <= max_positions:
        raise InputError(f"--max_context_tokens {requested} must be between 2 and the model's "
                         f"max_position_embeddings {max_positions}")
    return requested


class PromptTooLong(Exception):
    def __init__(self, tokens: int, budget: int) -> None:
        super().__init__(f"the prompt is {tokens} tokens, over the {budget} tokens the context leaves for it")
        self.tokens, self.budget = tokens, budget


class TrimmedHistory(NamedTuple):
    """The conversation that fits the prompt budget, and how many of the oldest exchanges were dropped."""

    messages: list[Message]
    dropped: int


def trim_history(messages: list[Message], count_tokens: Callable[[list[Message]], int], budget: int) -> TrimmedHistory:
    """Drop the oldest user/assistant exchanges until the rendered prompt fits in budget tokens.
    The system turn and the last user turn are always kept. Returns (messages, exchanges dropped);
    PromptTooLong if even those two do not fit."""
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(system):]
    dropped = 0
    while True:
        kept = system + turns
        tokens = count_tokens(kept)
        if tokens <= budget:
            return TrimmedHistory(kept, dropped)
        if len(turns) <= 1:
            raise PromptTooLong(tokens, budget)
        # An exchange is a user turn and the answers up to the next user turn.
        cut = next((i for i in range(1, len(turns)) if turns[i]["role"] == "user"), len(turns) - 1)
        turns = turns[cut:]
        dropped += 1


class StopCut(NamedTuple):
    """Text up to the earliest stop string, and whether one occurred."""

    text: str
    hit: bool


def cut_at_stop(text: str, stops: Sequence[str]) -> StopCut:
    """(text before the earliest stop string, whether one occurred)."""
    positions = [text.find(stop) for stop in stops if stop and stop in text]
    if not positions:
        return StopCut(text, False)
    return StopCut(text[: min(positions)], True)


def held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of text that may be the start of a stop string: not sent yet."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


# Tokens an unsettled window (text ending in a partial character) may grow to before its text is passed on
# anyway: a UTF-8 character is at most 4 bytes, so 4 byte-fallback tokens; only a run of invalid bytes gets here.
MAX_UNSETTLED_TOKENS = 8


def decoded_text(tokenizer: "PreTrainedTokenizerBase", token_ids: list[int]) -> str:
    """The text of one sequence of ids, special tokens skipped."""
    # One sequence decodes to one string; transformers types decode for a batch of them too (str | list[str]).
    return cast(str, tokenizer.decode(token_ids, skip_special_tokens=True))


class IncrementalDecoder:
    """The text of a growing reply, decoded a bounded window at a time, text-generation-inference's and vLLM's
    prefix/read offsets: the text of the tokens from `prefix` to the end, less that of the tokens from `prefix`
    to `read` (decoded the same way, so that what a tokenizer does at the start of a decode, such as dropping
    SentencePiece's leading space, cancels out), is the new text. The window moves on once its text is settled
    (no half UTF-8 character at its end), so each token is decoded a few times, however long the reply. Special
    tokens are left out as they come (decoding skips them, and one at the start of a window would leave the
    leading space to the token after it). The text equals the reply decoded at once but where the reply holds
    invalid UTF-8: byte-fallback tokens that make no character decode to one U+FFFD each when decoded together,
    and then split into windows they may not."""

    def __init__(self, tokenizer: "PreTrainedTokenizerBase") -> None:
        self.tokenizer = tokenizer
        self.skipped = set(tokenizer.all_special_ids)
        self.token_ids: list[int] = []
        self.prefix = self.read = 0

    def push(self, token_ids: Sequence[int]) -> str:
        """The text the new tokens settle (often "", while a character's bytes are still coming)."""
        self.token_ids.extend(token for token in token_ids if token not in self.skipped)
        return self.settle(final=False)

    def finish(self) -> str:
        """What is left, a partial character included: the reply is complete."""
        return self.settle(final=True)

    def decode(self, start: int, end: int) -> str:
        return decoded_text(self.tokenizer, self.token_ids[start:end])

    def settle(self, final: bool) -> str:
        if self.read == len(self.token_ids):
            return ""
        before, text = self.decode(self.prefix, self.read), self.decode(self.prefix, len(self.token_ids))
        unsettled = text.endswith("\ufffd") or not text.startswith(before)
        if unsettled and not final and len(self.token_ids) - self.read < MAX_UNSETTLED_TOKENS:
            return ""
        self.prefix, self.read = self.read, len(self.token_ids)
        return text[len(before):]


class StopScanner:
    """Passes settled text on up to the first stop string, holding back only what may begin one: a stop can
    then only begin in the held-back text, so each piece is searched with at most the longest stop's length
    before it, and the whole reply costs time linear in its length."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [stop for stop in stops if stop]
        self.pending = ""
        self.hit = False

    def feed(self, text: str, final: bool = False) -> str:
        """What of the text held back so far + text can be passed on now; after a stop, nothing more."""
        if self.hit:
            return ""
        pending, self.hit = cut_at_stop(self.pending + text, self.stops)
        keep = 0 if final or self.hit else held_back(pending, self.stops)
        self.pending = pending[len(pending) - keep:]
        return pending[: len(pending) - keep]


def tokens_until_stop(tokenizer: "PreTrainedTokenizerBase", token_ids: Sequence[int], stops: Sequence[str]) -> int:
    """How many of token_ids it takes for the text to hold a stop string (all of them if it never does), in
    one incremental pass."""
    decoder, scanner = IncrementalDecoder(tokenizer), StopScanner(stops)
    for count, token in enumerate(token_ids, start=1):
        scanner.feed(decoder.push([token]))
        if scanner.hit:
            return count
    scanner.feed(decoder.finish(), final=True)
    return len(token_ids)


class TextDeltaStreamer(BaseStreamer):
    """Streams the reply of a batch-1 generate as text deltas: what is new and settled (no half UTF-8
    character, nothing that may begin a stop string), decoded incrementally (IncrementalDecoder) so that a
    long reply costs linear time; unlike transformers' TextStreamer, which restarts after each newline, the
    concatenated deltas equal the reply decoded at once."""

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", on_text: Callable[[str], object],
                 stops: Sequence[str] = ()) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.scanner = StopScanner(stops)
        self.on_text = on_text
        self.prompt_seen = False

    @property
    def stopped(self) -> bool:
        return self.scanner.hit

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate first hands over the prompt
            self.prompt_seen = True
            return
        if not self.stopped:
            self.send(self.scanner.feed(self.decoder.push(value.reshape(-1).tolist())))

    def end(self) -> None:
        if not self.stopped:
            self.send(self.scanner.feed(self.decoder.finish(), final=True))

    def send(self, text: str) -> None:
        if text:
            self.on_text(text)


class NonFiniteScores(ReportedError):
    """A generation's next-token scores held NaN or infinity (or no finite score at all) where it would sample."""


class FiniteScoresGuard(LogitsProcessor):
    """The last logits processor before sampling: a row with NaN or +inf, or none finite, would become
    non-finite probabilities, and torch.multinomial on a GPU then fires a device-side assert that breaks the
    CUDA context for every later generation of the process. Such a row ends this generation with
    NonFiniteScores instead. (transformers' remove_invalid_values runs before temperature and the warpers,
    so it cannot catch what they produce.)"""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        bad = scores.isnan().any(dim=-1) | scores.isposinf().any(dim=-1) | scores.isneginf().all(dim=-1)
        if bool(bad.any()):
            raise NonFiniteScores(f"the next-token scores of {int(bad.sum())} row(s) are not finite (NaN or "
                                  "infinity) after the sampling settings were applied")
        return scores


def sampling_processors(settings: SamplingSettings) -> LogitsProcessorList:
    """Temperature, top-k and top-p in transformers' order, then the guard. generate puts the processors it is
    given after its own (repetition penalty among them) but before the warpers it builds from temperature,
    top_k and top_p, so generate is asked for none (GENERATE_BUILDS_NO_WARPER) and the guard is the last
    processor: it sees the very scores that are sampled."""
    processors = LogitsProcessorList()
    if settings.temperature > 0:
        if settings.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(settings.temperature))
        if settings.top_k:
            processors.append(TopKLogitsWarper(top_k=settings.top_k))
        if settings.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=settings.top_p))
    processors.append(FiniteScoresGuard())
    return processors


# generate's settings from which it builds warpers (or a processor after the given ones), each neutral: the
# checkpoint's generation_config may set some (top_k=50, typical_p, ...), and generate would then run them after
# the guard.
GENERATE_BUILDS_NO_WARPER = {"temperature": None, "top_k": None, "top_p": None, "min_p": None, "typical_p": None,
                             "epsilon_cutoff": None, "eta_cutoff": None, "top_h": None, "watermarking_config": None,
                             "renormalize_logits": False}


@contextlib.contextmanager
def private_rng(seed: int | None, device: torch.device) -> Iterator[None]:
    """Within the block, the CPU's random state (and that of the model's accelerator) starts from seed, and
    afterwards it is what it was: a client's seed never reseeds the process for the requests after it. Without a
    seed, nothing changes."""
    if seed is None:
        yield
        return
    accelerator = device.type != "cpu"
    index = device.index or 0
    with torch.random.fork_rng(devices=[index] if accelerator else [],
                               device_type=device.type if accelerator else None):
        torch.default_generator.manual_seed(seed)
        if accelerator:
            module = torch.get_device_module(device.type)
            with module.device(index):
                module.manual_seed(seed)
        yield


class CancelledCriteria(StoppingCriteria):
    """Stops generation when its event is set (a streaming client went away)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class DeadlineCriteria(StoppingCriteria):
    """Stops generation once `seconds` have passed since it was made (time.monotonic: a clock change does
    not move it); `reached` tells afterwards whether it did."""

    def __init__(self, seconds: float) -> None:
        self.deadline = monotonic() + seconds
        self.reached = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.reached = self.reached or monotonic() >= self.deadline
        return torch.full((input_ids.shape[0],), self.reached, dtype=torch.bool, device=input_ids.device)


class ChatGenerator:
    """A loaded model and tokenizer with the chat template they were trained with."""

    def __init__(self, model: "PreTrainedModel | PeftModel", tokenizer: "PreTrainedTokenizerBase", template: str | None,
                 context_tokens: int, template_kwargs: dict[str, Any] | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.template = template
        self.template_kwargs = dict(template_kwargs or {})
        self.context_tokens = context_tokens
        self.turn_end = template_turn_end(tokenizer, template, self.template_kwargs) if template else ""
        self.eos_ids = self.eos_token_ids()
        self.specials = special_token_texts(tokenizer)  # what a message's text may not turn into (control_text)
        # Padding is masked out by the attention mask, so any id serves; EOS when there is no pad.
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    def eos_token_ids(self) -> list[int]:
        ids: list[int] = []
        # The template's turn-end token (Phi-3's <|end|>, Gemma's <end_of_turn>) ends a reply too.
        turn_end_id = self.tokenizer.convert_tokens_to_ids(self.turn_end) if self.turn_end else None
        turn_end_id = turn_end_id if turn_end_id != self.tokenizer.unk_token_id else None
        for source in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None),
                       turn_end_id):
            for token in source if isinstance(source, (list, tuple)) else [source]:
                if token is not None and token not in ids:
                    ids.append(int(token))
        if not ids:
            raise InputError("the tokenizer has no eos_token: replies could not end")
        return ids

    def render(self, messages: list[Message]) -> str:
        return render_text(
            self.tokenizer, messages, chat_template=self.template, add_generation_prompt=True, **self.template_kwargs
        )

    def encode_chat(self, messages: list[Message]) -> list[int]:
        # The template writes BOS itself where the tokenizer uses one: nothing added around it, and a special
        # token's text in a message is text (records.control_text), exactly as training tokenized the conversation.
        return encode_prompt(self.tokenizer, self.specials, lambda marked, _: self.render(marked), messages)

    def encode_text(self, prompt: str) -> list[int]:
        """A plain-text prompt, with the tokenizer's BOS convention as in pretraining; a special token's text in it is
        text, as in a chat message (records.control_text)."""
        return encode_text_prompt(self.tokenizer, self.specials, prompt)

    def chat_stops(self, stops: Sequence[str] = ()) -> list[str]:
        return [stop for stop in list(stops) + [self.turn_end] if stop]

    def generation_kwargs(self, settings: SamplingSettings, stops: Sequence[str]) -> dict[str, Any]:
        """generate's arguments: sampling (temperature > 0) or greedy; temperature, top_k and top_p are
        applied by sampling_processors, so that nothing runs between its guard and the sampling."""
        kwargs = {"max_new_tokens": settings.max_new_tokens, "pad_token_id": self.pad_id,
                  "eos_token_id": self.eos_ids, "repetition_penalty": settings.repetition_penalty,
                  "do_sample": settings.temperature > 0, "logits_processor": sampling_processors(settings),
                  **GENERATE_BUILDS_NO_WARPER}
        if stops:
            kwargs.update(stop_strings=list(stops), tokenizer=self.tokenizer)
        return kwargs

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], settings: SamplingSettings, stops: Sequence[str] = (),
                 streamer: BaseStreamer | None = None, cancel: threading.Event | None = None) -> list[Completion]:
        """Completions of prompts (lists of token ids), generated together with LEFT padding
        (every row's next token then sits at the same position) and an attention mask from the
        lengths, never from comparing ids with the pad id. NonFiniteScores if the scores to sample
        from are not finite."""
        stops = [stop for stop in stops if stop]
        width = max(len(ids) for ids in prompts)
        input_ids = torch.tensor([[self.pad_id] * (width - len(ids)) + list(ids) for ids in prompts])
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])
        criteria = StoppingCriteriaList([CancelledCriteria(cancel)] if cancel is not None else [])
        deadline = DeadlineCriteria(settings.time_limit) if settings.time_limit is not None else None
        if deadline is not None:
            criteria.append(deadline)
        # A causal LM, whose class mixes GenerationMixin in (PreTrainedModel itself declares no generate), or peft's
        # wrapper of one, whose generate calls it.
        generating = cast("GenerationMixin", self.model)
        with private_rng(settings.seed, self.model.device):
            output = generating.generate(
                input_ids=input_ids.to(self.model.device), attention_mask=attention_mask.to(self.model.device),
                streamer=streamer, stopping_criteria=criteria, **self.generation_kwargs(settings, stops),
            )
        timed_out = deadline is not None and deadline.reached
        if timed_out:
            logger.info("generation stopped at its time limit of %s s", settings.time_limit)
        return [self.completion(row[width:].tolist(), len(ids), settings.max_new_tokens, stops, timed_out)
                for row, ids in zip(output.cpu(), prompts, strict=True)]

    def completion(self, generated: list[int], prompt_tokens: int, max_new_tokens: int,
                   stops: Sequence[str], timed_out: bool = False) -> Completion:
        """finish_reason "stop" at EOS or a stop string, "length" at max_new_tokens or the time limit."""
        eos_at = next((i for i, token in enumerate(generated) if token in self.eos_ids), None)
        if eos_at is not None:
            generated = generated[: eos_at + 1]  # what follows in a batch is padding
        text, hit = cut_at_stop(decoded_text(self.tokenizer, generated), stops)
        if hit:
            # Count the tokens up to the one completing the stop string; padding may follow it.
            generated = generated[: tokens_until_stop(self.tokenizer, generated, stops)]
        if eos_at is not None or hit:
            finish_reason = "stop"
        elif timed_out or len(generated) >= max_new_tokens:
            finish_reason = "length"
        else:  # cancelled
            finish_reason = "stop"
        return Completion(text, finish_reason, prompt_tokens, len(generated))


def check_served_adapter(model_args: InferenceModelArguments) -> None:
    """--lora_model must have been trained on --base_model's weights (core.model_files.check_adapter_base, the
    fingerprint memoized user-wide: a base is read once); one made elsewhere records none: a warning."""
    if not model_args.lora_model:
        return
    memo = FingerprintMemo(user_memo_root())
    warning = check_adapter_base(model_args.lora_model, model_args.base_model, "--lora_model", memo,
                                 model_args.allow_other_base)
    if warning:
        logger.warning(warning)
    save_weights_memo(memo, user_memo_root())


def load_generator(model_args: InferenceModelArguments, trust_remote_code: bool) -> ChatGenerator:
    """What chat and the server serve: the tokenizer and its chat template checked first (a bad one is refused
    before any weight is read), then the model, within --max_context_tokens."""
    tokenizer = inference_tokenizer(model_args.base_model, model_args.lora_model, trust_remote_code=trust_remote_code,
                                    tokenizer_path=model_args.tokenizer_path)
    check_served_adapter(model_args)
    template = chat_template_of(tokenizer, model_args.template)
    model, tokenizer = load_for_inference(model_args.base_model, model_args.lora_model, model_args.load_in_kbits,
                                          model_args.dtype, tokenizer, trust_remote_code=trust_remote_code,
                                          tokenizer_path=model_args.tokenizer_path, device=model_args.device)
    return ChatGenerator(model, tokenizer, template, context_limit(model, model_args.max_context_tokens),
                         template_kwargs_of(model_args))
