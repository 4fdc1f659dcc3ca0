"""A generated SFT task set whose answers can be checked exactly: multi-digit addition and
subtraction answered in a fixed format ("The answer is N."). Used by the demo's SFT stage
(exact-match accuracy before/after, two-digit operands) and by the packing test as realistic
short samples (up to three digits)."""

import random

ANSWER_FORMAT = "The answer is {}."


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


def is_exact_match(generated: str, record: dict[str, str]) -> bool:
    """The first line of the answer, stripped, equals the expected answer exactly."""
    lines = generated.strip().splitlines()
    return bool(lines) and lines[0].strip() == record["output"]
