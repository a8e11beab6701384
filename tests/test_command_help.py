"""`laswrr <command> --help`: one paragraph of what the command does and examples that parse."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from laswrr.cli import build_parser, commands
from laswrr.command_help import HELP

COMMANDS = sorted(commands(build_parser()))


def test_every_command_has_a_paragraph_and_examples() -> None:
    assert set(COMMANDS) == set(HELP), "add the new command to laswrr/command_help.py HELP"
    for name, (paragraph, examples) in HELP.items():
        assert "\n\n" not in paragraph and len(paragraph) < 600, name
        assert not any(mark in paragraph for mark in ("``", "§", "Theory of operation")), name  # not a docstring
        assert examples, name


@pytest.mark.parametrize("name", COMMANDS)
def test_examples_parse(name: str) -> None:
    for example in HELP[name][1]:
        words = shlex.split(example.split("|")[-1])
        assert words[0] == "laswrr" and words[1] == name, example
        try:
            build_parser().parse_args(words[1:])
        except SystemExit as exc:
            if exc.code != 0:  # --list and the like exit 0 after printing
                raise AssertionError(f"example does not parse: {example}") from exc


def test_help_shows_the_paragraph_and_examples_not_the_module_docstring() -> None:
    run = subprocess.run([sys.executable, "-m", "laswrr", "proxy", "--help"], capture_output=True, text=True,
                         check=True)
    text = " ".join(run.stdout.split())
    assert "Run one OpenAI-compatible proxy replica" in text and "examples: laswrr proxy --port 8000" in text
    assert "Runnable without the dispatcher" not in text and "``" not in text


@pytest.mark.parametrize("name", COMMANDS)
def test_every_flag_shows_its_default(name: str) -> None:
    """`laswrr NAME --help`, as printed: every flag's entry says its default (or that it is
    required), so `up --tick-ms` and `--sim-speed` are not left to guess."""
    import argparse

    parser = commands(build_parser())[name]
    formatter = parser._get_formatter()
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or isinstance(
                action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        said = " ".join(formatter._expand_help(action).split())  # the entry's text as --help prints it
        assert "default" in said.lower() or "required" in said.lower(), \
            f"laswrr {name} --help: {action.option_strings[-1]} shows no default: {said!r}"
        assert "%(default)" not in said


def test_version_answers_without_importing_the_commands() -> None:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "laswrr", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("laswrr ")
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert not {m for m in imported if m.startswith(("laswrr.services", "laswrr.bench", "laswrr.replay",
                                                     "aiohttp", "nats", "duckdb"))}, sorted(imported)[:20]
