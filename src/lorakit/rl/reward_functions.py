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
or `path/to/file.py:function`. A function that raises, or returns a non-finite value or a list of another length,
stops the run with one line naming the function and the record (file:line) it failed on, exit status 2.
"""

import importlib
import importlib.util
import math
import numbers
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from lorakit.core.cli import InputError

RewardCallable = Callable[..., list[float | None]]


class RewardFunction(NamedTuple):
    """One `--reward_funcs` entry: its name as given, the callable, and its weight in the score."""

    name: str
    function: RewardCallable
    weight: float


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
    it returned None), by its label (function_label), for the log."""

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
    return {"exact_match": exact_match, "think_format": think_format}.get(name)


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
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - whatever the user's module raises on import is reported in one line
        raise InputError(f"--reward_funcs {spec}: cannot import {module_name}: {type(err).__name__}: {err}") from None
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
    buffer = max_completion_length // 4 if overlong_buffer is None else overlong_buffer
    functions = []
    for index, name in enumerate(names):
        function = built_in(name, max_completion_length, buffer) or import_function(name)
        functions.append(RewardFunction(name, function, float(weights[index]) if weights else 1.0))
    return functions


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


def call_on(function: RewardFunction, batch: RewardBatch, rows: Sequence[int], trainer_state: Any) -> list[Any]:
    """The function's values on the given rows of the batch (TRL's calling convention)."""
    fields = {name: [values[row] for row in rows] for name, values in batch.fields.items()}
    return function.function(prompts=[batch.prompts[row] for row in rows],
                             completions=[batch.completions[row] for row in rows],
                             completion_ids=[batch.completion_ids[row] for row in rows],
                             trainer_state=trainer_state, **fields)


def failing_record(function: RewardFunction, batch: RewardBatch, trainer_state: Any) -> str:
    """Where the function fails when called on one answer at a time: the first record's origin, or the batch's."""
    for row, origin in enumerate(batch.origins):
        try:
            call_on(function, batch, [row], trainer_state)
        except Exception:  # noqa: BLE001 - looking for the row that raises, whatever it raises
            return origin
    return f"the batch of {batch.origins[0]} .. {batch.origins[-1]}"


def function_values(function: RewardFunction, batch: RewardBatch, trainer_state: Any = None) -> torch.Tensor:
    """The function's values on the batch [N] float64, NaN where it returned None; an InputError naming the
    function and the record where it raises, returns a non-finite value or a list of the wrong length."""
    check_fields(function, batch)
    count = len(batch.origins)
    try:
        values = call_on(function, batch, range(count), trainer_state)
    except InputError:
        raise
    except Exception as err:  # noqa: BLE001 - a user's function may raise anything: reported in one line
        where = failing_record(function, batch, trainer_state)
        raise InputError(f"{where}: the reward function {function.name} raised {type(err).__name__}: "
                         f"{' '.join(str(err).split())[:300]}") from None
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
        is_number = isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1)
        number = float(value) if is_number else None
        if number is None or not math.isfinite(number):
            raise InputError(f"{batch.origins[row]}: the reward function {function.name} returned {value!r}: a "
                             "reward must be a finite number (or None where the function does not apply)")
        result[row] = number
    return result


def function_label(name: str) -> str:
    """The name a function's figures are logged under: the function's own name (marker for rewards.py:marker)."""
    return name.rpartition(":")[2]


def score_completions(functions: Sequence[RewardFunction], batch: RewardBatch, trainer_state: Any = None
                      ) -> RewardScores:
    """Each answer's score, the weighted sum of its functions' values (a None adds nothing, as TRL's nansum), and
    each function's values for the log."""
    per_function = {f.name: function_values(f, batch, trainer_state) for f in functions}
    total = torch.zeros(len(batch.origins), dtype=torch.float64)
    for function in functions:
        total += torch.nan_to_num(per_function[function.name], nan=0.0) * function.weight
    return RewardScores(total.float(), {function_label(name): values.float() for name, values in per_function.items()})
