"""The import order of the folders: each one imports only folders listed before it.

    schemas -> scheduler, collectors -> replay -> services -> bench, deploy

``scheduler`` and ``collectors`` share a rank (neither imports the other), as do ``bench`` and
``deploy``. ``laswrr/`` itself (the package root and the ``laswrr`` command) sits above all of
them; tests may import anything. Every ``import`` and ``from ... import`` in a module counts,
including those inside functions, so a deferred import cannot hide a back-edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RANK = {"schemas": 0, "scheduler": 1, "collectors": 1, "replay": 2, "services": 3, "bench": 4, "deploy": 4}


def _imported_folders(path: Path) -> set[tuple[str, int]]:
    """(folder, line) for every import of a project folder in one module."""
    found: set[tuple[str, int]] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "laswrr" and len(parts) > 1 and parts[1] in RANK:
                found.add((parts[1], node.lineno))
            elif parts[0] in RANK and parts[0] != "deploy":
                found.add((f"old top-level name {parts[0]!r}", node.lineno))
    return found


def _violations(folder: str) -> list[str]:
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for imported, line in sorted(_imported_folders(path)):
            rank = RANK.get(imported)
            if rank is None or (imported != folder and rank >= RANK[folder]):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    return bad


@pytest.mark.parametrize("folder", sorted(RANK))
def test_folder_imports_only_earlier_folders(folder: str) -> None:
    assert _violations(folder) == []


def test_the_check_sees_a_back_edge(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from laswrr.bench import load\n    import laswrr.services.up\n")
    assert _imported_folders(module) == {("bench", 2), ("services", 3)}


def test_the_scheduler_core_does_not_import_the_routing_layer() -> None:
    """Inside ``scheduler``, the proxy's routing core (``scheduler/routing``) may use the
    scheduler's modules (weights, policies, ...), never the reverse: what both need lives in the
    core."""
    bad = []
    for path in sorted((ROOT / "scheduler").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("scheduler/routing/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:  # also ``from laswrr.scheduler import routing``
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            bad += [f"{rel}:{node.lineno} imports {name}" for name in names
                    if name.startswith("laswrr.scheduler.routing")]
    assert bad == []
