"""A generated SFT task set whose answers can be checked exactly: multi-digit addition and
subtraction answered in a fixed format ("The answer is N."). Used by the demo's SFT stage
(exact-match accuracy before/after, two-digit operands) and by the packing test as realistic
short samples (up to three digits)."""

import random
import re

ANSWER_FORMAT = "The answer is {}."
QUESTION = re.compile(r"What is (\d+) ([+-]) (\d+)\?")


def arithmetic_records(count: int, seed: int, max_operand: int = 999) -> list[dict[str, str]]:
    """Alpaca records: {"instruction": "What is 347 + 589?", "output": "The answer is 936."},
    operands from 10 to max_operand."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        a, b = rng.randint(10, max_operand), rng.randint(10, max_operand)
        if rng.random() < 0.5:
            question, answer = f"What is {a} + {b}?", a + b
        else:
            a, b = max(a, b), min(a, b)
            question, answer = f"What is {a} - {b}?", a - b
        records.append({"instruction": question, "output": ANSWER_FORMAT.format(answer)})
    return records


def question_key(question: str) -> str:
    """What makes two questions the same question: "What is 47 + 89?" and "What is 89 + 47?" are one (addition
    commutes, so a model trained on one has seen the other's answer); a subtraction keeps its order. Any other
    text is its own key."""
    match = QUESTION.fullmatch(question)
    if match is None:
        return question
    first, operator, second = match.groups()
    if operator == "+":
        first, second = sorted((first, second), key=int)
    return f"{first} {operator} {second}"


def is_exact_match(generated: str, record: dict[str, str]) -> bool:
    """The first line of the answer, stripped, equals the expected answer exactly."""
    lines = generated.strip().splitlines()
    return bool(lines) and lines[0].strip() == record["output"]
