"""The lock the two commands install from (requirements-lock.txt, `make lock`) holds what the ranges ask: every
requirement pinned within its range, so a dependency added to a requirements file without a new lock fails here,
and torch's machine-specific CUDA stack left to the machine."""

import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements-lock.txt"
RANGES = ("requirements.txt", "requirements-dev.txt", "requirements-bench.txt")
# The machine's torch build decides these: the CPU build the Makefile pins, or the user's CUDA build.
MACHINE_SPECIFIC = re.compile(r"^(torch|triton|nvidia-.+|cuda-.+)$")


def requirements(path: Path) -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def test_every_range_is_pinned_within_it_and_torch_is_left_to_the_machine():
    pins: dict[str, list[Requirement]] = {}
    for pin in requirements(LOCK):
        pins.setdefault(canonicalize_name(pin.name), []).append(pin)
    assert not [name for name in pins if MACHINE_SPECIFIC.match(name)]
    # Exact pins only, one per environment (a name pinned twice differs by its Python-version marker).
    assert all(len(pin.specifier) == 1 and next(iter(pin.specifier)).operator == "==" for found in pins.values()
               for pin in found)
    assert all(pin.marker is not None for found in pins.values() if len(found) > 1 for pin in found)
    for file in RANGES:
        for wanted in requirements(REPO / file):
            name = canonicalize_name(wanted.name)
            if MACHINE_SPECIFIC.match(name):
                continue
            assert name in pins, f"{file}: {wanted} is not in {LOCK.name}: run `make lock`"
            for pin in pins[name]:
                version = next(iter(pin.specifier)).version
                assert wanted.specifier.contains(version, prereleases=True), f"{file}: {wanted} but the lock has {pin}"


def test_the_two_commands_install_from_the_lock():
    makefile = (REPO / "Makefile").read_text()
    assert "LOCK := requirements-lock.txt" in makefile
    assert "$(PIP) install -q -c $(LOCK) -r requirements.txt -r requirements-dev.txt" in makefile
    assert "$(PIP) install -q -c $(LOCK) -r requirements-bench.txt" in makefile
