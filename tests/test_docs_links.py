"""Every document the repository cites exists, and so does every section it names.

Two forms of citation are checked, in code (comments, docstrings, help text) and in the docs:

* a path ``docs/<page>.md`` anywhere, and in a Markdown file a link ``[text](<path>.md)``
  relative to that file: the file must exist;
* the section names that follow such a citation, ``docs/proxy.md, "Flow control", "Several
  proxies"`` or ``docs/algorithm.md §5a``: each quoted name must be a heading of the cited page
  (its number, ``5a.``, left out) or a bold or italic lead of a paragraph or bullet there
  (``**Several proxies.**``, ``* *When.*``), and each ``§N`` a numbered heading ``N.`` of it.

A citation split over lines (a comment wrapped mid-name) is read as one line.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".laswrr", "build", "dist"}
# samples from other projects, whose provenance names those projects' own docs
SKIP_PATHS = {Path("tests/fixtures"), Path("tests/test_docs_links.py")}
SUFFIXES = {".py", ".md", ".sql", ".toml", ".js", ".html", ".yaml", ".yml", ".cfg", ".txt", ".sh"}

# what may follow a citation: a closing backtick or parenthesis, an opening parenthesis, then
# "Section", "Section", ... or §N
_TAIL = r"""(?P<tail>[`)]*(?:\s*,)?\s*\(?(?:(?:"[^"\n]{1,100}"|§\s?\d+[a-z]?)(?:\s*(?:,|-|and)\s*)?)*)"""
_DOCS_PATH = re.compile(r"(?<![\w./-])(?P<path>docs/[\w./-]+?\.md)\b" + _TAIL)
_MD_LINK = re.compile(r"\]\((?P<path>[^)#\s]+?\.md)(?:#[^)]*)?\)" + _TAIL)
_QUOTED = re.compile(r'"([^"\n]{1,100})"')
_PARAGRAPH_NUMBER = re.compile(r"§\s?(\d+[a-z]?)")


def _sources() -> list[Path]:
    found = []
    for path in ROOT.rglob("*"):
        relative = path.relative_to(ROOT)
        if any(part in SKIP_DIRS for part in relative.parts) or any(relative.is_relative_to(p) for p in SKIP_PATHS):
            continue
        if path.is_file() and path.suffix in SUFFIXES and path.stat().st_size < 2_000_000:
            found.append(path)
    return sorted(found)


def _joined(text: str) -> str:
    """The text with each line break, and the comment marker or indent after it, made one space."""
    text = text.replace('\\"', '"')
    return re.sub(r"[ \t]*\n[ \t]*(?:#+|//|--|\*(?=\s))?[ \t]*", " ", text)


@cache
def _sections(page: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(names a quoted section may have, paragraph numbers) of one Markdown page."""
    names: set[str] = set()
    numbers: set[str] = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            title = heading.group(1).strip()
            names.add(title)
            numbered = re.match(r"§?(\d+[a-z]?)\.\s+(.*)", title)
            if numbered:
                numbers.add(numbered.group(1))
                names.add(numbered.group(2))
    for lead in re.findall(r"\*\*(.+?)\*\*|(?<![*\w])\*([^*\s][^*]*?)\*(?![*\w])", _joined(page.read_text(encoding="utf-8"))):
        text = (lead[0] or lead[1]).strip()
        names.add(text)
        names.add(text.rstrip(".:"))
    return frozenset(_norm(name) for name in names), frozenset(numbers)


def _norm(name: str) -> str:
    return re.sub(r"\s+", " ", name.replace("`", "")).strip().rstrip(".:").lower()


def _citations(path: Path) -> list[tuple[str, Path, str]]:
    """(what was cited, the page it resolves to, the tail naming sections) of one source file."""
    text = _joined(path.read_text(encoding="utf-8", errors="replace"))
    cited = [(m.group("path"), ROOT / m.group("path"), m.group("tail")) for m in _DOCS_PATH.finditer(text)]
    if path.suffix == ".md":
        for m in _MD_LINK.finditer(text):
            target = m.group("path")
            if "://" in target:
                continue
            cited.append((target, (path.parent / target).resolve(), m.group("tail")))
    return cited


def _problems() -> list[str]:
    problems = []
    for source in _sources():
        where = source.relative_to(ROOT)
        for cited, page, tail in _citations(source):
            if not page.is_file():
                problems.append(f"{where}: cites {cited}, which does not exist")
                continue
            if page.suffix != ".md" or not tail:
                continue
            names, numbers = _sections(page)
            for name in _QUOTED.findall(tail):
                if _norm(name) not in names:
                    problems.append(f'{where}: cites {cited}, "{name}": no such section there')
            for number in _PARAGRAPH_NUMBER.findall(tail):
                if number not in numbers:
                    problems.append(f"{where}: cites {cited} §{number}: no such section there")
    return problems


def test_every_cited_document_and_section_exists() -> None:
    problems = _problems()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text, page, expected", [
    ('see docs/design.md, "Hazards designed for"', "docs/design.md", ["Hazards designed for"]),
    ("# wrapped (docs/proxy.md, \"Flow\n    # control\", \"Several proxies\")", "docs/proxy.md",
     ["Flow control", "Several proxies"]),
    ("the formulas (docs/algorithm.md §5a)", "docs/algorithm.md", ["§5a"]),
    ('every rule is in `docs/proxy.md` ("Flow control")', "docs/proxy.md", ["Flow control"]),
])
def test_citations_are_read_across_lines(tmp_path: Path, text: str, page: str, expected: list[str]) -> None:
    """The reader itself: a citation, wrapped or not, yields the page and every section it names."""
    source = tmp_path / "x.py"
    source.write_text(text, encoding="utf-8")
    [(cited, resolved, tail)] = _citations(source)
    assert cited == page and resolved == ROOT / page
    assert [*_QUOTED.findall(tail), *(f"§{n}" for n in _PARAGRAPH_NUMBER.findall(tail))] == expected


def test_a_missing_section_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a section that no page has, and a page that does not exist."""
    bad = ROOT / "docs" / "_docs_links_probe.md"
    bad.write_text('See [design](design.md), "No such section here", and docs/nowhere.md.\n', encoding="utf-8")
    try:
        problems = _problems()
    finally:
        bad.unlink()
    assert any('"No such section here": no such section there' in p for p in problems), problems
    assert any("docs/nowhere.md, which does not exist" in p for p in problems), problems
