"""The routing core keeps the shape its split gave it: no class in ``scheduler/routing/`` or
``services/proxy/`` holds more than 15 methods (a class that grows past that is doing two jobs:
split it, as ``Router`` was split into the table, the routes, the admitter and the channel), and
the two facades that remain, ``Router`` and ``Forwarder``, stay under 200 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_METHODS = 15
MAX_FACADE_LINES = 200


def _classes(folder: str) -> list[tuple[str, ast.ClassDef]]:
    found = []
    for path in sorted((ROOT / folder).glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        found += [(f"{folder}/{path.name}", node) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    return found


def _methods(node: ast.ClassDef) -> int:
    return sum(isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) for item in node.body)


def test_no_class_of_the_routing_core_holds_more_than_15_methods() -> None:
    classes = _classes("scheduler/routing") + _classes("services/proxy")
    assert len(classes) > 20  # the folders were read
    over = [f"{where}: {node.name} ({_methods(node)} methods)" for where, node in classes if _methods(node) > MAX_METHODS]
    assert not over, over


def test_router_and_forwarder_stay_small() -> None:
    sizes = {}
    for where, node in _classes("scheduler/routing") + _classes("services/proxy"):
        if node.name in ("Router", "Forwarder"):
            sizes[node.name] = (node.end_lineno or node.lineno) - node.lineno + 1
    assert set(sizes) == {"Router", "Forwarder"}
    assert all(lines < MAX_FACADE_LINES for lines in sizes.values()), sizes
