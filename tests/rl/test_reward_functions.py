"""Reward functions (rl.reward_functions): TRL's calling convention, so a TRL reward function runs unchanged; the
built-ins against hand-worked cases; bad functions and records refused in one line naming the record."""

import logging
import math
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from lorakit.core.cli import InputError
from lorakit.rl.reward_functions import (
    RewardBatch,
    exact_match,
    final_answer,
    load_reward_functions,
    overlong_penalty,
    score_completions,
    think_format,
    warn_never_applied,
)

# Functions as TRL's GRPOTrainer documentation writes them, in a user's file, untouched.
TRL_STYLE = textwrap.dedent('''
    import re

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    def format_reward_func(completions, **kwargs):
        pattern = r"^<think>.*?</think><answer>.*?</answer>$"
        completion_contents = [completion[0]["content"] for completion in completions]
        matches = [re.match(pattern, content) for content in completion_contents]
        return [1.0 if match else 0.0 for match in matches]

    def reward_func(completions, ground_truth, **kwargs):
        return [1.0 if c.endswith(gt) else 0.0 for c, gt in zip(completions, ground_truth)]

    def seen(prompts, completions, completion_ids, trainer_state, **kwargs):
        return [float(len(ids)) + (0.5 if p.startswith("Q") else 0.0) for p, ids in zip(prompts, completion_ids)]

    def skips_second(completions, **kwargs):
        return [1.0, None, 1.0]

    def divides(completions, **kwargs):
        return [1.0 / (len(c) - 3) for c in completions]

    def not_finite(completions, **kwargs):
        return [0.0, math_nan(), 1.0]

    def math_nan():
        return float("nan")

    def too_few(completions, **kwargs):
        return [1.0]
''')


@pytest.fixture(autouse=True)
def user_module(tmp_path, monkeypatch):
    """my_rewards.py, importable as my_rewards, in every test."""
    (tmp_path / "my_rewards.py").write_text(TRL_STYLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "my_rewards.py"


def batch(completions, prompts=None, **fields):
    count = len(completions)
    ids = [list(range(len(c) if isinstance(c, str) else 2)) for c in completions]
    return RewardBatch(prompts or [f"Q{i}" for i in range(count)], list(completions), ids, fields,
                       [f"prompts.jsonl:{i + 3}" for i in range(count)])


def test_a_trl_reward_function_runs_unchanged_from_a_module_or_a_file(user_module):
    functions = load_reward_functions(["my_rewards:reward_len", f"{user_module}:reward_func",
                                       "my_rewards:seen"], [1.0, 2.0, 1.0], max_completion_length=16)
    scored = score_completions(functions, batch(["abc", "x" * 20, "ends 7"], ground_truth=["zz", "x", "7"]))
    # reward_len: -17, 0, -14; reward_func (weight 2): 0, 1, 1; seen: token count + 0.5 for a prompt "Q...".
    assert scored.per_function["reward_len"].tolist() == [-17.0, 0.0, -14.0]
    assert scored.scores.tolist() == [-17 + 0 + 3.5, 0 + 2 + 20.5, -14 + 2 + 6.5]
    conversational = [[{"role": "assistant", "content": "<think>a</think><answer>4</answer>"}],
                      [{"role": "assistant", "content": "4"}]]
    formatted = load_reward_functions(["my_rewards:format_reward_func"], None, 16)
    assert score_completions(formatted, batch(conversational)).scores.tolist() == [1.0, 0.0]


def test_a_none_adds_nothing_and_weights_multiply():
    functions = load_reward_functions(["my_rewards:skips_second", "think_format"], [1.0, 0.5], 16)
    scored = score_completions(functions, batch(["<think>x</think> 1", "2", "3"]))
    assert scored.scores.tolist() == [1.5, 0.0, 1.0]
    assert math.isnan(scored.per_function["skips_second"][1].item())


def test_exact_match_reads_the_final_answer_of_both_sides():
    completions = ["so the total is 1,234.", "I think \\boxed{\\frac{1}{2}}", "3/4 of it: 0.75", "it is 71",
                   "no number here", "答案是 42", "\\boxed{\\frac{1}{2}}", "the answer is 2", "The answer is 198.",
                   "The answer is 189."]
    answers = ["She pays 1,200 + 34 = 1234\n#### 1234", "\\boxed{\\frac{1}{2}}", "0.75", "72", "5", "42",
               "\\frac{1}{2}", "\\frac{1}{2}", "The answer is 198.", "The answer is 198."]
    # A non-numeric reference is one answer: \\frac{1}{2} is not "the last number", 2; a sentence (an alpaca
    # output) is read for its last number.
    assert exact_match(completions, answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert final_answer("first 3 then \\boxed{x^{2}} then 9") == "x^{2}"


def test_think_format_and_the_overlong_penalty():
    assert think_format(["<think>a\nb</think>\n42", "<think>a</think>", "42 <think>a</think> 1"]) == [1.0, 0.0, 0.0]
    # At most 10 tokens with a buffer of 4: free up to 6, then -1/4 per token, -1 at 10 and beyond.
    penalty = overlong_penalty(10, 4)
    assert penalty(completion_ids=[[0] * n for n in (3, 6, 8, 10, 12)]) == [0.0, 0.0, -0.5, -1.0, -1.0]


@pytest.mark.parametrize("names, weights, message", [
    (["no_such_module:f"], None, "--reward_funcs no_such_module:f: cannot import no_such_module: "
                                 "ModuleNotFoundError"),
    (["missing.py:f"], None, "cannot import missing.py: FileNotFoundError"),
    (["my_rewards:nothing"], None, "my_rewards has no function nothing"),
    (["accuracy"], None, "give a built-in (exact_match, think_format, overlong) or module:function"),
    (["think_format", "overlong"], [1.0], "--reward_weights gives 1 weights for 2 --reward_funcs"),
    (["think_format"], [float("inf")], "every weight must be a finite number"),
])
def test_a_reward_function_that_cannot_be_loaded_is_refused_in_one_line(names, weights, message):
    with pytest.raises(InputError) as refused:
        load_reward_functions(names, weights, 16)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("name, fields, message", [
    ("my_rewards:divides", {}, "prompts.jsonl:5: the reward function my_rewards:divides raised ZeroDivisionError"),
    ("my_rewards:not_finite", {}, "prompts.jsonl:4: the reward function my_rewards:not_finite returned nan: a reward "
                                  "must be a finite number"),
    ("my_rewards:too_few", {}, "returned list of 1 values for 3 completions"),
    ("exact_match", {"answer": ["1", None, "2"]}, "prompts.jsonl:4: field 'answer' is missing (the reward function "
                                                  "exact_match compares"),
    ("my_rewards:reward_func", {}, "prompts.jsonl:3: the reward function my_rewards:reward_func raised TypeError"),
])
def test_a_reward_function_that_fails_names_the_record_it_failed_on(name, fields, message):
    functions = load_reward_functions([name], None, 16)
    with pytest.raises(InputError) as refused:
        score_completions(functions, batch(["ab", "abcd", "abc"], **fields))
    assert message in str(refused.value), str(refused.value)


def test_scores_are_float_tensors_of_one_value_per_answer():
    scored = score_completions(load_reward_functions(["think_format"], None, 16), batch(["a", "b"]))
    assert scored.scores.dtype == torch.float32 and scored.scores.shape == (2,)


# A user's file with the ways a reward function can stop the run other than by raising an Exception.
STOPPING = textwrap.dedent('''
    import sys
    import time

    def exits(completions, **kwargs):
        sys.exit(0)

    def interrupted(completions, **kwargs):
        raise KeyboardInterrupt

    def huge(completions, **kwargs):
        return [1e39] + [0.0] * (len(completions) - 1)

    def large(completions, **kwargs):
        return [1e6] * len(completions)

    def slow(completions, **kwargs):
        time.sleep(60)
        return [0.0] * len(completions)
''')


@pytest.fixture
def stopping(tmp_path):
    (tmp_path / "stopping.py").write_text(STOPPING)
    (tmp_path / "exits_on_import.py").write_text("import sys\n\nsys.exit(0)\n")
    return tmp_path


def test_sys_exit_in_a_reward_function_or_its_import_is_refused_and_ctrl_c_still_stops(stopping):
    """sys.exit(0) is no success: it ended the run with status 0 and no adapter. Ctrl-C is left to stop the run."""
    functions = load_reward_functions([f"{stopping}/stopping.py:exits"], None, 16)
    with pytest.raises(InputError) as refused:
        score_completions(functions, batch(["ab", "abc"]))
    assert str(refused.value) == f"prompts.jsonl:3: the reward function {stopping}/stopping.py:exits called sys.exit(0)"
    with pytest.raises(InputError) as refused:
        load_reward_functions([f"{stopping}/exits_on_import.py:f"], None, 16)
    assert str(refused.value).endswith("exits_on_import.py: called sys.exit(0)")
    interrupted = load_reward_functions([f"{stopping}/stopping.py:interrupted"], None, 16)
    with pytest.raises(KeyboardInterrupt):
        score_completions(interrupted, batch(["ab"]))


def test_a_reward_beyond_what_float32_statistics_hold_is_the_functions_fault(stopping):
    """1e39 is infinite in float32: it reached the loss as NaN and stopped the run as a divergence (exit 3)."""
    with pytest.raises(InputError) as refused:
        score_completions(load_reward_functions([f"{stopping}/stopping.py:huge"], None, 16), batch(["ab", "abc"]))
    assert str(refused.value).startswith(f"prompts.jsonl:3: the reward function {stopping}/stopping.py:huge returned "
                                         "1e+39: a reward must be a finite number of magnitude at most 1e+15")
    weighted = load_reward_functions([f"{stopping}/stopping.py:large", "think_format"], [1e10, 1.0], 16)
    with pytest.raises(InputError, match=r"prompts.jsonl:3: the weighted reward 1e\+10 x .*large \+ 1 x think_format"):
        score_completions(weighted, batch(["ab"]))


def test_a_slow_reward_function_stops_the_run_at_its_timeout(stopping):
    """A 60 s sleep (inside C code, where no signal reaches Python) ends at --reward_timeout: exit 2, one line."""
    script = textwrap.dedent(f'''
        from lorakit.core.cli import run_cli
        from lorakit.rl.reward_functions import RewardBatch, load_reward_functions, score_completions

        def main():
            functions = load_reward_functions(["{stopping}/stopping.py:slow"], None, 16)
            score_completions(functions, RewardBatch(["Q"], ["a"], [[1]], {{}}, ["prompts.jsonl:3"]), timeout=0.5)

        run_cli(main)
    ''')
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=40)
    assert result.returncode == 2 and time.monotonic() - started < 30, result.stderr[-2000:]
    assert result.stderr.splitlines() == [f"error: prompts.jsonl:3: the reward function {stopping}/stopping.py:slow "
                                          "did not return within --reward_timeout 0.5 s; raise --reward_timeout if "
                                          "it needs longer per call"]


def test_functions_of_one_name_are_logged_apart(tmp_path):
    """Two files' accuracy: accuracy and accuracy_3 (accuracy_2 is a third entry's own name), each with its own
    figures; a function named reward_model keeps clear of the reward model's label; the same entry twice is
    refused. (test_grpo's test_each_reward_function_is_logged_and_warned_of_apart: their reward-share components.)"""
    for name, value in (("first", 1.0), ("second", 2.0)):
        (tmp_path / f"{name}.py").write_text(f"def accuracy(completions, **kwargs):\n    return [{value}] * "
                                             "len(completions)\n\nreward_model = accuracy_2 = accuracy\n")
    names = [f"{tmp_path}/first.py:accuracy", f"{tmp_path}/second.py:accuracy", f"{tmp_path}/first.py:accuracy_2",
             f"{tmp_path}/second.py:reward_model"]
    functions = load_reward_functions(names, [1.0, 0.5, 1.0, 1.0], 16)
    assert [function.label for function in functions] == ["accuracy", "accuracy_3", "accuracy_2", "reward_model_2"]
    scored = score_completions(functions, batch(["ab"]))
    assert {label: values.tolist() for label, values in scored.per_function.items()} == {
        "accuracy": [1.0], "accuracy_3": [2.0], "accuracy_2": [1.0], "reward_model_2": [2.0]}
    with pytest.raises(InputError, match="--reward_funcs names think_format twice: give it once"):
        load_reward_functions(["think_format", "think_format"], None, 16)


def test_a_function_that_never_applies_is_warned_of_once(caplog):
    functions = load_reward_functions(["my_rewards:skips_second", "think_format"], None, 16)
    nothing = load_reward_functions(["think_format"], None, 16)[0]._replace(
        name="my_rewards:nothing", label="nothing", function=lambda completions, **_: [None] * len(completions))
    warned = set()
    with caplog.at_level(logging.WARNING, logger="lorakit.rl.reward_functions"):
        for _ in range(2):
            scored = score_completions([*functions, nothing], batch(["a", "b", "c"]))
            warn_never_applied([*functions, nothing], scored, warned)
    assert [record.getMessage() for record in caplog.records] == [
        "the reward function my_rewards:nothing returned None for every one of 3 answers: it adds nothing to their "
        "scores and reward/nothing_mean logs 0.0 (warned once)"]
