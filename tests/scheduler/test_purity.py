"""The core and the parsers are pure (style.md, from h11): no clock, randomness, IO, logging,
threads, processes or network among their imports. An ``import`` anywhere in the module counts,
including inside functions (except the one documented file read in ``scheduler/config.py``'s
``load_file``, which is only called by services and the replay CLI, never by ``apply``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {"asyncio", "time", "random", "socket", "threading", "nats", "aiohttp", "duckdb", "logging", "os",
             "subprocess", "datetime", "multiprocessing", "secrets", "uuid", "signal", "selectors", "io", "pathlib"}
PURE = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "scheduler").rglob("*.py")) + [
    "collectors/npu_smi.py", "collectors/prometheus.py", "collectors/npu_exporter.py", "collectors/mindie.py",
    "collectors/faultcodes.py"]
ALLOWED_CALLS = {("scheduler/config.py", "open")}  # load_file: the configuration file, read by callers


def _imports_and_io(path: str, source: str | None = None) -> tuple[set[str], set[str]]:
    roots: set[str] = set()
    calls: set[str] = set()
    text = (ROOT / path).read_text(encoding="utf-8") if source is None else source
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in {"open", "print", "input", "__import__", "exec", "eval"}:
            if (path, node.func.id) not in ALLOWED_CALLS:
                calls.add(node.func.id)
    return roots, calls


def test_the_scan_covers_the_core() -> None:
    assert {"scheduler/core.py", "scheduler/swrr.py", "scheduler/policies/la_swrr.py",
            "scheduler/routing/router.py", "scheduler/routing/admission.py", "scheduler/routing/table.py",
            "scheduler/routing/peers.py", "scheduler/routing/continuation.py"} <= set(PURE)


@pytest.mark.parametrize("module", PURE)
def test_module_is_pure(module: str) -> None:
    roots, calls = _imports_and_io(module)
    assert not roots & FORBIDDEN, f"{module} imports {sorted(roots & FORBIDDEN)}"
    assert not calls, f"{module} calls {sorted(calls)}"


def test_the_scan_would_catch_impurity() -> None:
    source = (ROOT / "scheduler" / "core.py").read_text(encoding="utf-8")
    tainted = source + "\n\ndef _f():\n    import time\n    from os import path\n    print(time.time())\n"
    roots, calls = _imports_and_io("scheduler/core.py", tainted)
    assert {"time", "os"} <= roots & FORBIDDEN and calls == {"print"}
