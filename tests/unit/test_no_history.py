"""Code comments, docstrings, the README and docs/ say why, never history: commit hashes, "used to"
accounts and before/after timings belong in benchmarks/ result files and git history."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CODE = ("grpo", "reward_fns", "tasks", "flows", "infra", "cli")
HISTORY = [
    (re.compile(r"`(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}`"), "a commit hash"),
    (re.compile(r"\b(used to|previously|formerly)\b|\(before,", re.I), "a past account"),
    (re.compile(r"CPU-s\b.{0,60}\bbefore\b|\bbefore\b.{0,60}\bCPU-s\b"), "a before/after timing"),
    (
        re.compile(
            r"\b(exactly |just )?as before\b|\buntil .{0,40}\bhad (taken|been|run)\b"
            r"|\banymore\b|(?<!nothing )\b(was|were) (changed|replaced|removed|renamed|rewritten)\b"
            r"|\bsince the [\w -]{0,40}\b(work|change|fix|refactor|rewrite)\b"
            r"|\bthe old (code|behaviou?r|version)\b",
            re.I,
        ),
        "a narrative of the past",
    ),
]


def history_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, line) for each line that tells history."""
    return [(i, what, line.strip()) for i, line in enumerate(text.splitlines(), 1)
            for pattern, what in HISTORY if pattern.search(line)]  # fmt: skip


def test_the_check_finds_each_kind_of_history():
    text = "x = 1  # fixed in `1bfb72c`\n# (Before, it hung.)\n# 27.4 CPU-s before, 16.0 after\n"
    assert [what for _, what, _ in history_lines(text)] == [
        "a commit hash",
        "a past account",
        "a before/after timing",
    ]
    story = (
        "it waits until a day of runs had taken its toll\nthe loss is computed exactly as "
        "before\nthe flag was removed\nsince the truncated-distribution work, it drops\n"
    )
    assert [what for _, what, _ in history_lines(story)] == ["a narrative of the past"] * 4
    # a word or a number in backticks is not a hash: it needs hex letters and digits
    assert history_lines("# `deadbee` and `1234567` are not hashes\n") == []


@pytest.mark.parametrize(
    "path",
    [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "infra").glob("*.md")),
    ]
    + sorted(p for d in CODE for p in (ROOT / d).rglob("*.py")),
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_no_history_in_code_comments_docstrings_or_the_readme(path):
    found = history_lines(path.read_text())
    assert not found, "\n".join(f"{path.name}:{i}: {what}: {line}" for i, what, line in found)
