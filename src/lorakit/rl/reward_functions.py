"""Rewards a program computes (`--reward_funcs`), for the group-relative methods: loaded by name, called exactly
as TRL's GRPOTrainer calls them, so that a user's TRL reward function runs unchanged:

    function(prompts=[...], completions=[...], completion_ids=[[...]], trainer_state=..., **record_fields)
        -> list[float | None]

one value per completion (None: the function does not apply to it, it adds nothing), every other field of the
prompt records passed by name as a list over the batch (a record lacking the field gives None there). Prompts and
completions are plain strings, or for conversational records a list of messages and [{"role": "assistant",
"content": text}], as TRL passes them. Each answer's score is the weighted sum of its functions' values
(`--reward_weights`, default 1 each).

A name is a built-in (BUILT_IN: exact_match, think_format, overlong) or `module:function` (an importable module)
or `path/to/file.py:function`. A function that raises (sys.exit included), or returns a value that is not a finite
number within REWARD_LIMIT or a list of another length, stops the run with one line naming the function and the
record (file:line) it failed on, exit status 2; so does a call that outlives --reward_timeout (CallWatchdog).
Ctrl-C (KeyboardInterrupt) stops the run as it does anywhere else. Each function's figures are logged under its
label: its function name, made unique (accuracy, accuracy_2) where two files define functions of one name.
"""

import importlib
import importlib.util
import logging
import math
import numbers
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, NamedTuple

import torch

from lorakit.core.cli import InputError, hand_to_launcher

logger = logging.getLogger(__name__)

# TRL's reward function: one float (or None where it does not apply) per completion.
RewardCallable = Callable[..., Sequence[float | None]]

# What a user's reward code may raise that is its failure, reported in one line: any Exception, and SystemExit
# (sys.exit() in a function or at its module's import is no request to end the run successfully: left alone it ended
# run_grpo with status 0 and no adapter). KeyboardInterrupt is not among them: Ctrl-C stops the run as anywhere else.
USER_CODE_FAILURES = (Exception, SystemExit)
# The largest reward magnitude taken: the statistics square the scores and sum the squares over a batch in float32
# (reward_std, --scale_rewards batch), so 1e15 leaves room for 1e8 answers; a reward past it (1e39 is infinite in
# float32) would reach the loss as NaN and stop the run as a divergence (exit 3) while the function is at fault.
REWARD_LIMIT = 1e15
# The label the reward model's score is logged under (grpo_trainer): never a function's.
REWARD_MODEL_LABEL = "reward_model"


class RewardFunction(NamedTuple):
    """One `--reward_funcs` entry: its name as given, the callable, its weight in the score, and the label its
    figures are logged under (unique among the run's functions: function_labels)."""

    name: str
    function: RewardCallable
    weight: float
    label: str


class RewardBatch(NamedTuple):
    """What the reward functions see of one batch of N answers: the prompts and completions (strings, or messages
    for conversational records), the completions' token ids, every other record field as a list of N values, and
    each answer's record origin (file:line) for the error that names it."""

    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[list[int]]
    fields: dict[str, list[Any]]
    origins: list[str]


class RewardScores(NamedTuple):
    """score_completions' result: the weighted score of each answer [N], and each function's values [N] (NaN where
    it returned None), by its label (RewardFunction.label), for the log."""

    scores: torch.Tensor
    per_function: dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- built-in reward functions

BOXED = "\\boxed{"
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
THINK_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*\S", re.DOTALL)


def completion_text(completion: Any) -> str:
    """The text of a completion as TRL passes it: a string, or the messages of a conversational record."""
    if isinstance(completion, str):
        return completion
    return "".join(str(message.get("content") or "") for message in completion)


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in text (braces balanced), or None."""
    start = text.rfind(BOXED)
    if start < 0:
        return None
    depth, position = 1, start + len(BOXED)
    for index in range(position, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[position:index]
    return None


def final_answer(text: str) -> str | None:
    """A completion's (or a reference's) final answer: the last \\boxed{} content, else the last number in it."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def as_number(answer: str) -> float | None:
    """answer as a number (thousands separators, a $ and a trailing period dropped; a/b as a fraction), or None."""
    cleaned = answer.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        if "/" in cleaned:
            numerator, denominator = cleaned.split("/", 1)
            return float(numerator) / float(denominator)
        return float(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def same_answer(given: str | None, reference: str | None) -> bool:
    if given is None or reference is None:
        return False
    given_number, reference_number = as_number(given), as_number(reference)
    if given_number is not None and reference_number is not None:
        return math.isclose(given_number, reference_number, rel_tol=1e-9, abs_tol=1e-9)
    return " ".join(given.split()) == " ".join(reference.split())


def reference_final_answer(reference: Any) -> str:
    """A reference answer's final answer: its last \\boxed{} content, or what follows its last "####" (GSM8K's
    solutions), or the last number of a reference written as a sentence (an alpaca `output` such as "The answer is
    198." serves as the answer), else the whole reference (\\frac{1}{2} is one answer, not the number 2)."""
    text = str(reference).strip()
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rpartition("####")[2].strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers and len(text.split()) > 1 else text


def exact_match(completions: list[Any], answer: list[Any], **_: Any) -> list[float]:
    """1.0 where the completion's final answer (final_answer) equals the record's reference answer
    (reference_final_answer: "#### 72", "\\boxed{72}" and "72" all read 72), numerically where both are numbers,
    else 0.0."""
    return [float(same_answer(final_answer(completion_text(c)), reference_final_answer(a)))
            for c, a in zip(completions, answer, strict=True)]


def think_format(completions: list[Any], **_: Any) -> list[float]:
    """1.0 where the completion reasons inside <think>...</think> and then answers (DeepSeek-R1's format)."""
    return [float(bool(THINK_FORMAT.match(completion_text(c)))) for c in completions]


def overlong_penalty(max_completion_length: int, buffer: int) -> RewardCallable:
    """DAPO's soft overlong punishment: 0 up to max_completion_length - buffer tokens, then falling linearly to -1
    at max_completion_length (an answer cut at the limit gets -1)."""
    def overlong(completion_ids: list[list[int]], **_: Any) -> list[float]:
        start = max_completion_length - buffer
        return [0.0 if len(ids) <= start else max(-1.0, (start - len(ids)) / max(buffer, 1))
                for ids in completion_ids]
    return overlong


# The fields each built-in reads from the records (a record without one is refused by name).
BUILT_IN_FIELDS = {"exact_match": ("answer",), "think_format": (), "overlong": ()}


def built_in(name: str, max_completion_length: int, overlong_buffer: int) -> RewardCallable | None:
    if name == "overlong":
        return overlong_penalty(max_completion_length, overlong_buffer)
    functions: dict[str, RewardCallable] = {"exact_match": exact_match, "think_format": think_format}
    return functions.get(name)


# ----------------------------------------------------------------------------- loading


def import_function(spec: str) -> RewardCallable:
    """`module:function` or `path/to/file.py:function` -> the callable; an InputError naming what failed."""
    module_name, _, function_name = spec.rpartition(":")
    if not module_name or not function_name:
        raise InputError(f"--reward_funcs {spec}: give a built-in ({', '.join(BUILT_IN_FIELDS)}) or "
                         "module:function (or path/to/file.py:function)")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise FileNotFoundError(f"no file {module_name}")
            loader_spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
            if loader_spec is None or loader_spec.loader is None:  # a .py file always has a loader
                raise ImportError(f"no loader for {module_name}")
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except USER_CODE_FAILURES as err:  # whatever the user's module raises on import is reported in one line
        raise InputError(f"--reward_funcs {spec}: cannot import {module_name}: {failure_text(err)}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise InputError(f"--reward_funcs {spec}: {module_name} has no function {function_name}")
    return function


def load_reward_functions(names: Sequence[str], weights: Sequence[float] | None, max_completion_length: int,
                          overlong_buffer: int | None = None) -> list[RewardFunction]:
    """The `--reward_funcs` (with `--reward_weights`, default 1 each) as RewardFunctions. overlong_buffer (default a
    quarter of max_completion_length) sets where the overlong penalty starts."""
    if weights and len(weights) != len(names):
        raise InputError(f"--reward_weights gives {len(weights)} weights for {len(names)} --reward_funcs")
    if weights and not all(math.isfinite(w) for w in weights):
        raise InputError(f"--reward_weights {' '.join(map(str, weights))}: every weight must be a finite number")
    twice = next((name for index, name in enumerate(names) if name in names[:index]), None)
    if twice is not None:
        raise InputError(f"--reward_funcs names {twice} twice: give it once (--reward_weights sets its weight)")
    buffer = max_completion_length // 4 if overlong_buffer is None else overlong_buffer
    labels = function_labels(names)
    functions = []
    for index, name in enumerate(names):
        function = built_in(name, max_completion_length, buffer) or import_function(name)
        functions.append(RewardFunction(name, function, float(weights[index]) if weights else 1.0, labels[index]))
    if any(label != function_label(name) for name, label in zip(names, labels, strict=True)):
        logger.info("reward functions of one name are logged apart: %s",
                    ", ".join(f"{name} as reward/{label}_*" for name, label in zip(names, labels, strict=True)))
    return functions


def function_label(name: str) -> str:
    """A function's own name, the label it is logged under unless another takes it (marker for rewards.py:marker)."""
    return name.rpartition(":")[2]


def function_labels(names: Sequence[str]) -> list[str]:
    """Each entry's label: its function's name; a second function of that name (another file's accuracy) gets
    accuracy_2, a third accuracy_3, skipping labels some entry has as its own name, and the reward model's: one shared
    label would merge their figures in the log and hide each one's share from the reward-share alarms."""
    own = [function_label(name) for name in names]
    taken, labels = {*own, REWARD_MODEL_LABEL}, []
    for label in own:
        if label in labels or label == REWARD_MODEL_LABEL:
            suffix = 2
            while f"{label}_{suffix}" in taken:
                suffix += 1
            label = f"{label}_{suffix}"
            taken.add(label)
        labels.append(label)
    return labels


def check_record_fields(functions: Sequence[RewardFunction], records: Sequence[Any]) -> None:
    """Before training: every record (a data.prompts.Prompt: .where, .fields) has the fields the built-in functions
    read, else one line naming the first record without."""
    for function in functions:
        for field in BUILT_IN_FIELDS.get(function.name, ()):
            missing = next((record for record in records if record.fields.get(field) is None), None)
            if missing is not None:
                raise InputError(f"{missing.where}: field '{field}' is missing (the reward function "
                                 f"{function.name} compares each answer with it; an alpaca \"output\" or a final "
                                 "assistant turn serves too)")


# ----------------------------------------------------------------------------- calling


def check_fields(function: RewardFunction, batch: RewardBatch) -> None:
    """A built-in's record fields are there for every answer, else one line naming the first record without."""
    for field in BUILT_IN_FIELDS.get(function.name, ()):
        values = batch.fields.get(field) or [None] * len(batch.origins)
        for value, origin in zip(values, batch.origins, strict=True):
            if value is None:
                raise InputError(f"{origin}: field '{field}' is missing (the reward function {function.name} "
                                 f"compares each answer with it)")


def failure_text(err: BaseException) -> str:
    """What a user's code raised, for the one line: a sys.exit() said as such (it is no error of its own)."""
    if isinstance(err, SystemExit):
        return f"called sys.exit({err.code!r})"
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def stop_process(message: str) -> None:
    """Report message as run_cli reports an InputError (one line, or the launcher's error file) and end the process
    at once with its exit status: the main thread is stuck in the user's code and cannot raise."""
    if not hand_to_launcher(message):
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(InputError.exit_status)


class CallWatchdog:
    """Around one call of a reward function: a thread that ends the process (exit status 2, one line naming the
    function and the limit) if the call has not returned within limit seconds (0: no limit). A thread, not a
    signal: SIGALRM reaches Python code only between bytecodes of the main thread, never inside the C code (a regex,
    a socket read, a lock) where a hung reward function usually waits. expire: what to do then (tests)."""

    def __init__(self, function: RewardFunction, limit: float, where: str,
                 expire: Callable[[str], None] = stop_process) -> None:
        self.message = (f"{where}: the reward function {function.name} did not return within --reward_timeout "
                        f"{limit:g} s; raise --reward_timeout if it needs longer per call")
        self.limit, self.expire, self.returned = limit, expire, threading.Event()

    def __enter__(self) -> "CallWatchdog":
        if self.limit > 0:
            threading.Thread(target=self.watch, name="reward-watchdog", daemon=True).start()
        return self

    def watch(self) -> None:
        if not self.returned.wait(self.limit):
            self.expire(self.message)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.returned.set()


def call_on(function: RewardFunction, batch: RewardBatch, rows: Sequence[int], trainer_state: Any,
            timeout: float = 0) -> Sequence[Any]:
    """The function's values on the given rows of the batch (TRL's calling convention), within timeout seconds."""
    fields = {name: [values[row] for row in rows] for name, values in batch.fields.items()}
    where = (batch.origins[rows[0]] if len(rows) == 1
             else f"the batch of {batch.origins[0]} .. {batch.origins[-1]}" if batch.origins else "an empty batch")
    with CallWatchdog(function, timeout, where):
        return function.function(prompts=[batch.prompts[row] for row in rows],
                                 completions=[batch.completions[row] for row in rows],
                                 completion_ids=[batch.completion_ids[row] for row in rows],
                                 trainer_state=trainer_state, **fields)


def failing_record(function: RewardFunction, batch: RewardBatch, trainer_state: Any, timeout: float = 0) -> str:
    """Where the function fails when called on one answer at a time: the first record's origin, or the batch's."""
    for row, origin in enumerate(batch.origins):
        try:
            call_on(function, batch, [row], trainer_state, timeout)
        except USER_CODE_FAILURES:  # looking for the row that raises, whatever it raises
            return origin
    return f"the batch of {batch.origins[0]} .. {batch.origins[-1]}"


def reward_number(value: Any) -> float | None:
    """value as a float if it is one real number (a Python or numpy number, a one-element tensor), else None."""
    is_number = isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1)
    if not is_number:
        return None
    try:
        return float(value)
    except OverflowError:  # an int past float's range (10**400): as infinite, refused by the caller
        return math.inf


def function_values(function: RewardFunction, batch: RewardBatch, trainer_state: Any = None,
                    timeout: float = 0) -> torch.Tensor:
    """The function's values on the batch [N] float64, NaN where it returned None; an InputError naming the
    function and the record where it raises (or calls sys.exit), returns a value that is not a finite number within
    REWARD_LIMIT, or a list of the wrong length; the process ends (CallWatchdog) where a call outlives timeout."""
    check_fields(function, batch)
    count = len(batch.origins)
    try:
        values = call_on(function, batch, range(count), trainer_state, timeout)
    except InputError:
        raise
    except USER_CODE_FAILURES as err:  # a user's function may raise anything: reported in one line
        where = failing_record(function, batch, trainer_state, timeout)
        raise InputError(f"{where}: the reward function {function.name} {raised(err)}") from None
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # a numpy array or tensor, as TRL takes
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != count:
        raise InputError(f"the reward function {function.name} returned {type(values).__name__} of "
                         f"{len(values) if hasattr(values, '__len__') else '?'} values for {count} completions "
                         f"({batch.origins[0]} ..); it must return a list of one float (or None) per completion")
    result = torch.full((count,), math.nan, dtype=torch.float64)
    for row, value in enumerate(values):
        if value is None:
            continue
        number = reward_number(value)
        if number is None or not abs(number) <= REWARD_LIMIT:  # NaN fails the comparison too
            raise InputError(f"{batch.origins[row]}: the reward function {function.name} returned {value!r:.60}: a "
                             f"reward must be a finite number of magnitude at most {REWARD_LIMIT:g} (or None where "
                             "the function does not apply)")
        result[row] = number
    return result


def raised(err: BaseException) -> str:
    """The verb and what for the one line: 'raised ValueError: ...', or 'called sys.exit(0)'."""
    return failure_text(err) if isinstance(err, SystemExit) else f"raised {failure_text(err)}"


def score_completions(functions: Sequence[RewardFunction], batch: RewardBatch, trainer_state: Any = None,
                      timeout: float = 0) -> RewardScores:
    """Each answer's score, the weighted sum of its functions' values (a None adds nothing, as TRL's nansum), and
    each function's values for the log, by label; each call limited to timeout seconds (0: no limit)."""
    per_function = {f.label: function_values(f, batch, trainer_state, timeout) for f in functions}
    total = torch.zeros(len(batch.origins), dtype=torch.float64)
    for function in functions:
        total += torch.nan_to_num(per_function[function.label], nan=0.0) * function.weight
    beyond = torch.nonzero(~(total.abs() <= REWARD_LIMIT)).flatten().tolist()
    if beyond:  # each value within the limit, their weighted sum not: the weights are too
        weighted = " + ".join(f"{function.weight:g} x {function.name}" for function in functions)
        raise InputError(f"{batch.origins[beyond[0]]}: the weighted reward {weighted} is {total[beyond[0]].item():g}, "
                         f"beyond {REWARD_LIMIT:g}: scale the reward functions or --reward_weights down")
    return RewardScores(total.float(), {label: values.float() for label, values in per_function.items()})


def warn_never_applied(functions: Sequence[RewardFunction], scored: RewardScores, warned: set[str]) -> None:
    """Warn once per function (its label added to warned) where it returned None for every answer of a batch: it
    adds nothing to any score and its mean is logged as 0.0, which reads as a reward never earned; TRL warns too.
    The caller logs on rank 0 only."""
    for function in functions:
        values = scored.per_function[function.label]
        if function.label not in warned and values.numel() and torch.isnan(values).all():
            warned.add(function.label)
            logger.warning("the reward function %s returned None for every one of %d answers: it adds nothing to "
                           "their scores and reward/%s_mean logs 0.0 (warned once)", function.name, values.numel(),
                           function.label)
