"""Every `laswrr ...` command the README and docs/ show exists (the README once cited
`up --proxy-args`, which no parser had): its sub-command and each of its `--flags`, in the text's
inline code as in its code blocks (tests/integration/test_readme.py parses the ```sh blocks'
whole command lines and runs them)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from laswrr.cli import build_parser, commands

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted(ROOT.glob("docs/**/*.md")) + [ROOT / "README.md"]
PLACEHOLDER = re.compile(r"<[^>]*>|\.\.\.|…|\$")  # <node>, ..., $VAR: not a literal command
COMMAND_START = re.compile(r"^(?:\.venv/bin/|python -m |\S*/)?laswrr\s+(?P<rest>.*)$")


def _fenced(text: str) -> Iterator[str]:
    for block in re.findall(r"^```[\w-]*\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
        for line in block.replace("\\\n", " ").splitlines():
            yield line.strip().removeprefix("$ ")


def _inline(text: str) -> Iterator[str]:
    without_blocks = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    yield from re.findall(r"`([^`\n]+)`", without_blocks)


def _commands(span: str) -> Iterator[str]:
    """The `laswrr ...` commands in one line of shell (split at ; && | and $( )."""
    for part in re.split(r"\s*(?:;|&&|\||\$\(|\))\s*", span.split(" #")[0]):
        match = COMMAND_START.match(part.strip())
        if match and match["rest"] and not match["rest"].startswith("-"):
            yield "laswrr " + match["rest"].strip()


def cited() -> list[tuple[str, str]]:
    """(document, command) for every `laswrr COMMAND ...` the docs show, once each."""
    found: dict[tuple[str, str], None] = {}
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        for span in (*_fenced(text), *_inline(text)):
            found.update(((str(path.relative_to(ROOT)), command), None) for command in _commands(span))
    return list(found)


CITED = cited()
PARSERS = commands(build_parser())


def test_the_docs_cite_commands() -> None:
    assert len(CITED) > 100 and ("README.md", "laswrr up --no-flow-control") in CITED


@pytest.mark.parametrize(("document", "command"), CITED, ids=[f"{d}: {c}" for d, c in CITED])
def test_every_cited_command_and_flag_exists(document: str, command: str) -> None:
    words = command.split()
    name = words[1]
    if PLACEHOLDER.fullmatch(name):
        return  # `laswrr <command> --help`
    assert name in PARSERS, f"{document}: `{command}`: laswrr has no command {name!r}"
    known = {option for action in PARSERS[name]._actions for option in action.option_strings}
    for word in words[2:]:
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and not PLACEHOLDER.search(flag):
            assert flag in known, f"{document}: `{command}`: laswrr {name} has no flag {flag}"
