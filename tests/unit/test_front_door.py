"""The README is the front door: short, its two commands first, every file it names there."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_is_short_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    first_block = text.split("```bash", 1)[1].split("```", 1)[0]
    assert [ln.split()[:2] for ln in first_block.strip().splitlines()] == [
        ["make", "run"], ["make", "test"]
    ]  # fmt: skip
    assert "make test" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's command


def test_every_file_the_readme_names_exists():
    text = (ROOT / "README.md").read_text()
    named = set(re.findall(r"`((?:docs|benchmarks|infra|configs|tests|flows|tasks|grpo|cli)/"
                           r"[A-Za-z0-9_./-]+\.(?:md|py|yaml|png|example))`", text))  # fmt: skip
    named |= set(re.findall(r"\]\(((?:docs|benchmarks)/[^)]+)\)", text))
    assert named, "the README names its docs"
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert not missing, missing
