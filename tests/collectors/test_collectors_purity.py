"""The parsers are pure: no I/O, clock, randomness, processes or logging among their imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE_MODULES = ("collectors/npu_smi.py", "collectors/prometheus.py", "collectors/errors.py", "collectors/npu_exporter.py",
                "collectors/mindie.py", "collectors/faultcodes.py", "collectors/kv_events.py")
FORBIDDEN = {
    "asyncio", "time", "random", "socket", "subprocess", "logging", "os", "sys", "threading",
    "multiprocessing", "urllib", "http", "requests", "aiohttp", "nats", "datetime", "secrets", "io",
    "pathlib", "shutil", "signal", "select", "selectors",
}


def _imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"open", "print", "__import__"}:
            roots.add(f"<call {node.func.id}>")
    return roots


@pytest.mark.parametrize("module", PURE_MODULES)
def test_parser_module_is_pure(module: str) -> None:
    roots = _imported_roots(ROOT / module)
    assert not roots & FORBIDDEN, f"{module} imports {sorted(roots & FORBIDDEN)}"
    assert not {r for r in roots if r.startswith("<call")}, f"{module} does I/O: {roots}"
