"""Every command the docs show runs as written, at argparse's level: each `grpo ...`,
`python benchmarks/...` and `make ...` in README.md, docs/, benchmarks/ and infra/ is parsed
by the real parser with the documented arguments (nothing is run); every file it names exists;
every relative link and image of those files points at a file."""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
               *(ROOT / "benchmarks").glob("*.md"), *(ROOT / "infra").glob("*.md")])  # fmt: skip
PROGRAMS = ("grpo", ".venv/bin/grpo", "python", ".venv/bin/python", "make")
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def _blocks(text: str) -> list[str]:
    """Command lines of fenced blocks (continuations joined) and of inline code spans."""
    lines = []
    # a block marked `<!-- at commit X -->` holds commands of that commit's code (a result
    # file's record of a removed feature), run from a checkout of it
    for marker, block in re.findall(r"(<!-- at commit [0-9a-f]{7,40} -->\n)?```[a-z]*\n(.*?)```",
                                    text, re.S):  # fmt: skip
        if not marker:
            lines += block.replace("\\\n", " ").splitlines()
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    # a span of a program and at most its subcommand names it (`grpo promote`); with
    # arguments it is a command
    lines += [s for s in re.findall(r"`([^`\n]+)`", prose) if len(s.split()) > 2
              or s.split()[0] in ("make", "python", ".venv/bin/python")]  # fmt: skip
    return lines


def _command(line: str) -> list[str] | None:
    """The argv of a documented command: environment assignments dropped, cut at a pipe or
    `;`/`&&`, comments removed; None when the line is not one of ours."""
    line = line.strip().removeprefix("$ ")
    if re.search(r"<[^>]+>", line):
        return None  # a template (`--reference <a reference>`), not a command
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    while words and ENV.match(words[0]):
        words = words[1:]
    if words[:1] == ["env"]:
        return None  # a launcher's line (srun ... env ...) is checked at its grpo part
    for stop in ("|", ";", "&&", "||", ">", "&"):
        if stop in words:
            words = words[: words.index(stop)]
    if not words or words[0] not in PROGRAMS:
        return None
    if words[0].endswith("python") and not (len(words) > 1 and words[1].startswith("benchmarks/")):
        return None
    if any("..." in w for w in words) or words[1:2] == ["-"]:
        return None  # an elided line, or a difference of metric names (`grpo - rft`)
    return words


def _synopsis(words: list[str]) -> list[str]:
    """A usage line's optional parts taken, alternatives at their first choice:
    `[--set k=v]` -> `--set k=v`, `table|markdown` -> `table`."""
    out = []
    for w in words:
        w = w.strip("[]")
        if "|" in w and not w.startswith("models:/") and "=" not in w:
            w = w.split("|")[0]
        if w:
            out.append(w)
    return out


def documented_commands() -> list[tuple[str, list[str]]]:
    found = {}
    for doc in DOCS:
        for line in _blocks(doc.read_text()):
            words = _command(line)
            if words:
                found.setdefault(" ".join(words), (doc.relative_to(ROOT).as_posix(), words))
    return sorted(found.values(), key=lambda x: (x[0], x[1]))


COMMANDS = documented_commands()


class Parsed(Exception):
    """Raised in place of running a script once its arguments parsed."""


def _parse_benchmark(script: Path, args: list[str], monkeypatch) -> None:
    real = argparse.ArgumentParser.parse_args

    def parse_only(self, a=None, ns=None):  # noqa: ANN001, ANN202
        real(self, a, ns)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    monkeypatch.syspath_prepend(str(script.parent))  # as `python benchmarks/x.py` has it
    with pytest.raises(Parsed):
        runpy.run_path(str(script), run_name="__main__")


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-zA-Z][\w-]*):", text, re.M))


def test_the_docs_show_commands_of_every_kind():
    kinds = {w[0].rsplit("/", 1)[-1] for _, w in COMMANDS}
    assert {"grpo", "python", "make"} <= kinds
    assert len(COMMANDS) > 60


@pytest.mark.parametrize("doc,words", COMMANDS, ids=[" ".join(w)[:90] for _, w in COMMANDS])
def test_a_documented_command_parses(doc, words, monkeypatch, capsys):
    words = _synopsis(words)
    prog, args = words[0].rsplit("/", 1)[-1], words[1:]
    if prog == "make":
        missing = [t for t in args if not t.startswith("-") and "=" not in t
                   and t not in _make_targets()]  # fmt: skip
        assert not missing, f"{doc}: make has no target {missing}"
        return
    if prog == "python":
        script = ROOT / args[0]
        assert script.is_file(), f"{doc}: {args[0]} does not exist"
        _parse_benchmark(script, args[1:], monkeypatch)
    else:
        from cli.main import build_parser

        try:
            build_parser().parse_args(args)
        except SystemExit as e:
            err = capsys.readouterr().err.strip().splitlines()[-1:]
            pytest.fail(f"{doc}: `{' '.join(words)}` does not parse: {err} (exit {e.code})")
    for i, w in enumerate(args):  # a config it names is one the project ships (configs/my*
        # is a user's own, written in the recipe that runs it)
        if i and args[i - 1] == "--config" and w.startswith("configs/") and "/my" not in w:
            assert (ROOT / w).is_file(), f"{doc}: {w} does not exist"


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=[d.relative_to(ROOT).as_posix() for d in DOCS])
def test_every_relative_link_and_image_points_at_a_file(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, or an anchor in the same file
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: broken links {broken}"
