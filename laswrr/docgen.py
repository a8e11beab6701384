"""Generated sections of the docs, written from the declarations they describe.

A Markdown file (docs/*.md, README.md) marks a section it does not write by hand::

    <!-- generated: NAME -->
    ...
    <!-- end generated -->

``SECTIONS`` maps each NAME to a function that returns the section's body (Markdown) from the
code's own declarations, so a default or a key can only be stated once:

* ``proxy-settings``: ``ProxyConfig``'s declared settings (services/proxy/config.py);
* ``command-flags``: every command's flags, from the argparse parsers themselves (each command's
  own defaults and help, as ``laswrr COMMAND --help`` prints them);
* ``scheduler-keys``: ``SchedulerConfig``'s keys (scheduler/config.py);
* ``facts``: docs/wire.md's fact table, ``schemas.facts.markdown`` (the fact table in schemas/).

More sections plug in by name: decorate a function with ``@section("name")`` in a module listed in
``SECTION_MODULES`` (or add it here). ``python -m laswrr.docgen`` rewrites every marked section;
``python -m laswrr.docgen --check`` changes nothing and exits 1 naming the stale files (a test runs
it). The parsers are built with the ``LASWRR_*`` and ``NATS_*`` variables cleared, so the output
does not depend on the environment of whoever runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python -m laswrr.docgen"
SECTION_MODULES: tuple[str, ...] = ()  # modules whose @section functions add sections
MARKED = re.compile(r"(?P<head><!-- generated: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(?P<tail><!-- end generated -->)",
                    re.DOTALL)

SECTIONS: dict[str, Callable[[], str]] = {}


def section(name: str) -> Callable[[Callable[[], str]], Callable[[], str]]:
    """Register ``function`` as the writer of the generated section ``name``."""
    def register(function: Callable[[], str]) -> Callable[[], str]:
        if name in SECTIONS:
            raise ValueError(f"generated section {name!r} registered twice")
        SECTIONS[name] = function
        return function
    return register


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (cells on one line, ``|`` escaped)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def clean_environment() -> Iterator[None]:
    """No ``LASWRR_*``/``NATS_*`` variables while the parsers are built (their defaults read some)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(("LASWRR_", "NATS_"))}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


# -- the sections -----------------------------------------------------------------------------------


@section("proxy-settings")
def proxy_settings() -> str:
    from laswrr.cli import env_name
    from laswrr.services.proxy.cli import default_text
    from laswrr.services.proxy.config import SAME, flag_of, settings_of

    rows = []
    for field, how in settings_of():
        flag = flag_of(field, how)
        variables = [f"`{env_name(flag)}`"] if flag else []
        variables += [f"`{how.env}`"] if how.env else []
        if flag is None:
            up = "fixed" if field.name != "nats_auth" else "the `--nats-*` flags"
        elif field.name == "proxy_id":
            up = "named by `up`: proxy, proxy-2, ..."
        elif how.up:
            up = f"`{how.up}`" + (f" (default {default_text(how.up_default, how)})" if how.up_default is not SAME
                                  else "")
        elif how.shared:
            up = "`up`'s own"
        else:
            up = f"`--proxy-arg {field.name}=…`"
        rows.append((f"`{field.name}`", f"`{flag}`" if flag else "—", ", ".join(variables) or "—", how.unit or "",
                     default_text(field.default, how), up, how.help))
    return table(("setting", "`laswrr proxy` flag", "environment", "unit", "default", "`laswrr up`", "what"), rows)


def _flag_rows(command: argparse.ArgumentParser) -> list[tuple[str, str, str]]:
    from laswrr.cli import env_name

    formatter = command._get_formatter()
    rows = []
    for action in command._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        text = formatter._expand_help(action) if action.help else ""
        if not action.option_strings:
            rows.append((f"`{action.metavar or action.dest}` (positional)", "—", text))
            continue
        long = [o for o in action.option_strings if o.startswith("--")]
        if not long:
            continue  # -v: a deprecated short alias
        rows.append((", ".join(f"`{o}`" for o in long), f"`{env_name(long[0])}`", text))
    return rows


@section("command-flags")
def command_flags() -> str:
    from laswrr.cli import build_parser, commands

    with clean_environment():
        parser = build_parser()
    parts = []
    for name, command in commands(parser).items():
        parts.append(f"### `laswrr {name}`\n\n" + table(("flag", "environment variable", "what (default)"),
                                                        _flag_rows(command)))
    return "\n".join(parts)


@section("scheduler-keys")
def scheduler_keys() -> str:
    from laswrr.scheduler.config import keys

    return table(("key", "default", "unit", "what"),
                 [(f"`{key}`", f"`{default!r}`" if isinstance(default, str) else f"`{default}`", unit, text)
                  for key, default, unit, text in keys()])


@section("facts")
def facts() -> str:
    """docs/wire.md's fact table (schemas/facts.py, ``markdown``)."""
    from laswrr.schemas.facts import markdown

    return markdown()


# -- files --------------------------------------------------------------------------------------------


def _sections() -> dict[str, Callable[[], str]]:
    for module in SECTION_MODULES:
        importlib.import_module(module)
    return SECTIONS


def documents(root: Path = ROOT) -> list[Path]:
    return sorted((root / "docs").rglob("*.md")) + [root / "README.md"]


def render(text: str, where: str = "") -> str:
    """``text`` with every marked section's body written anew; an unknown NAME is a ValueError."""
    sections = _sections()
    cache: dict[str, str] = {}

    def body(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in sections:
            raise ValueError(f"{where}: no generated section {name!r} (known: {', '.join(sorted(sections))})")
        if name not in cache:
            written = sections[name]()
            cache[name] = written if written.endswith("\n") else written + "\n"
        return f"{match['head']}{cache[name]}{match['tail']}"

    return MARKED.sub(body, text)


def stale(root: Path = ROOT) -> list[Path]:
    """The documents whose generated sections differ from what the code says now."""
    return [path for path in documents(root) if path.exists()
            and render(text := path.read_text(encoding="utf-8"), str(path)) != text]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 naming the stale files")
    args = parser.parse_args(argv)
    if args.check:
        behind = stale()
        for path in behind:
            print(f"{path.relative_to(ROOT)}: generated sections are stale: run `{COMMAND}`", file=sys.stderr)
        return 1 if behind else 0
    for path in documents():
        if path.exists() and (new := render(old := path.read_text(encoding="utf-8"), str(path))) != old:
            path.write_text(new, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
