"""The README and docs/: a README a newcomer finishes (at most 300 lines), every relative link resolving to a file
and, where it names one, to a heading of that file; every scripts/, tests/ and benchmarks/ file they name
existing; every docs page reachable from the README or the docs index. Reads files only: fast, no subprocess."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
MAX_README_LINES = 300

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
# A file of the repository's code that a page names: a script, a test (the tests mirror the package's folders, so
# a move shows here) or a benchmark.
CODE_PATH = re.compile(r"(?<![\w/.-])(?:scripts|tests|benchmarks)/[\w/.-]*?\.(?:py|sh)\b")


def page_id(path: Path) -> str:
    return str(path.relative_to(REPO))


def prose(text: str) -> str:
    """The text without code blocks and code spans, where a bracket is not a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation (backticks, colons, apostrophes...) dropped,
    spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set:
    found, seen = set(), {}
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path) -> list:
    targets = LINK.findall(prose(path.read_text(encoding="utf-8")))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # no http:, https:, mailto:


def test_the_readme_is_short_enough_to_finish():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; at most {MAX_README_LINES}"


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_every_relative_link_resolves_to_a_file_and_a_heading(path):
    broken = []
    for target in relative_links(path):
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        if not destination.exists():
            broken.append(f"{target}: no file {destination}")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {page_id(destination)}")
    assert not broken, f"{page_id(path)}: " + "; ".join(broken)


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_every_script_test_and_benchmark_named_exists(path):
    named = set(CODE_PATH.findall(path.read_text(encoding="utf-8")))
    missing = sorted(p for p in named if not (REPO / p).is_file())
    assert not missing, f"{page_id(path)} names files that do not exist: {missing}"


def test_every_docs_page_is_linked_from_the_readme_or_the_index():
    linked = set()
    for index in (README, DOCS / "README.md"):
        for target in relative_links(index):
            file_part = target.partition("#")[0]
            if file_part:
                linked.add((index.parent / file_part).resolve())
    orphans = [page_id(p) for p in DOCS.glob("*.md") if p.name != "README.md" and p.resolve() not in linked]
    assert not orphans, f"docs pages linked from neither README.md nor docs/README.md: {orphans}"


def test_the_checks_themselves_see_links_anchors_and_scripts():
    """The helpers find what they must, so an empty result above means something."""
    assert slug("On a GPU: `make gpu-check`") == "on-a-gpu-make-gpu-check"
    assert slug("PPO's memory at a large vocabulary") == "ppos-memory-at-a-large-vocabulary"
    assert "docs/pipeline.md" in relative_links(README)
    assert "supported-models" in anchors(README)
    sample = ("run `python scripts/training/run_ppo.py` or scripts/training/run_pt.sh; not `[B, T](x)`; "
              "`tests/rl/test_ppo.py::test_x`, `benchmarks/bench_sft.py` (a link, ../tests/x.py, is checked above)")
    assert CODE_PATH.findall(sample) == ["scripts/training/run_ppo.py", "scripts/training/run_pt.sh",
                                           "tests/rl/test_ppo.py", "benchmarks/bench_sft.py"]
    assert LINK.findall(prose(sample)) == []
