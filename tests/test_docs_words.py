"""The README, the pages of docs/ and the changelog speak of the library: no issue or pull
request numbers, no work-log phrases (sessions, "next time", days of work), nothing about
the machine the project is built on (what it can reach, what it was lent), and every path
of the repository they name exists.

The phrases are precise on purpose: "session" alone is a nox or ONNX Runtime session, and
"the next time you call it" is ordinary prose; see ``WORK_LOG``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]

ISSUE_NUMBER = re.compile(
    r"\bissues?[ -]#?\d+|\b(?:pull request|PR) #?\d+|(?<![\w&/#])#\d+\b", re.IGNORECASE
)
"""``issue 16``, ``issue-20``, ``issues 3``, ``PR 7``, ``#42`` (not ``&#8203;``, ``a#1``)."""

WORK_LOG = [
    r"\b(?:next|previous|first|second|third|fourth|fifth|sixth|seventh|eighth) session\b",
    r"\b(?:for|until|left for) (?:the )?next (?:time|session|run)\b",
    r"\bnext time\b(?! (?:you|it|the|a|an|this|that|one|they|we)\b)",
    r"\bearlier (?:the same|that) day\b",
    r"\b(?:\d+|a|one|two|three|four|five|six|seven) (?:days?|hours?|weeks?) of (?:work|effort)\b",
    r"\bwork[ -]?log\b",
    r"\breaches no GitHub\b|\bno GitHub host\b",
    r"\bno GPU (?:was|has been|is|were) (?:lent|available)\b",
    r"\bsession time\b",
]
"""Phrases of a work diary (case-insensitive)."""

OTHER_REPOSITORIES = {"src/transformers", "tests/models/"}
"""Paths inside transformers' repository, which docs/huggingface.md's test suite runs."""

REPO_PATH = re.compile(
    r"(?<![\w./-])((?:src|tests|tools|docs|examples|\.ci)/[\w./+-]*[\w/])(?![\w*<{])"
)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _lines(doc: Path) -> list[tuple[int, str]]:
    """The lines of ``doc`` outside fenced code blocks (code names what the reader runs)."""
    out, fenced = [], False
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        out.append((number, line))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_issue_numbers_or_work_log(doc: Path) -> None:
    found = [
        f"{doc.name}:{n}: {m.group(0)!r}"
        for n, line in _lines(doc)
        for pattern in (ISSUE_NUMBER, *(re.compile(w, re.IGNORECASE) for w in WORK_LOG))
        for m in pattern.finditer(line)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_path_exists(doc: Path) -> None:
    text = doc.read_text()
    missing = []
    for path in sorted(set(REPO_PATH.findall(text))):
        last = path.rstrip("/").rsplit("/", 1)[-1]
        if "." not in last and not path.endswith("/"):
            continue  # "examples/s" in a table, a module path: not a file named
        if path.startswith("docs/_build") or path in OTHER_REPOSITORIES:
            continue
        if not (ROOT / path).exists():
            missing.append(path)
    for target in sorted(set(LINK.findall(text))):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, an anchor on the page
        if not (doc.parent / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("measured before issue 16 landed", True),
        ("(issue-20 recipe)", True),
        ("see #42", True),
        ("Fifth session: an H100", True),
        ("left for the next session with a GPU", True),
        ("This machine reaches no GitHub host", True),
        ("two days of work", True),
        ("the next time you call it, the cache is used", False),
        ("`nox -s lint` runs one session", False),
        ("ort.InferenceSession(path)", False),
        ("colour &#8203; and section 10.2", False),
        ("no issue with NaN in the padding", False),
    ],
)
def test_the_word_check_catches_the_diary_not_prose(text: str, found: bool) -> None:
    patterns = [ISSUE_NUMBER, *(re.compile(w, re.IGNORECASE) for w in WORK_LOG)]
    assert any(p.search(text) for p in patterns) == found
