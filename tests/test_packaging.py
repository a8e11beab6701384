"""Packaging: the runtime install carries what the services import, and nothing only the benchmarks need."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_FOLDERS = ("laswrr", "schemas", "scheduler", "collectors", "replay", "services")  # not bench/


def _project() -> dict:  # type: ignore[type-arg]
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _imported_top_levels(folder: Path) -> set[str]:
    names: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def test_every_third_party_import_of_the_services_is_a_runtime_dependency() -> None:
    runtime = {_normal(Requirement(r).name) for r in _project()["dependencies"]}
    distributions = metadata.packages_distributions()
    third_party = set()
    for folder in RUNTIME_FOLDERS:
        for name in _imported_top_levels(ROOT / folder):
            if name in sys.stdlib_module_names or name == "laswrr":
                continue
            third_party |= {_normal(d) for d in distributions.get(name, [name])}
    assert third_party, "no third-party imports found: the scan is broken"
    assert third_party <= runtime, f"imported by the services but not a runtime dependency: {third_party - runtime}"


def test_bench_only_packages_are_extras_and_the_cli_starts_without_them() -> None:
    runtime = {Requirement(r).name.lower() for r in _project()["dependencies"]}
    assert "matplotlib" not in runtime and "pyyaml" not in runtime
    assert any(Requirement(r).name == "matplotlib" for r in _project()["optional-dependencies"]["bench"])
    probe = ("import sys; from laswrr.cli import build_parser; build_parser(); "
             "print(sorted(m for m in ('matplotlib', 'yaml', 'pytest', 'openai') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]"  # `laswrr --help` in the runtime-only image imports none of them


def test_the_image_installs_the_runtime_only() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    installs = [line for line in dockerfile.splitlines() if "pip install" in line and not line.startswith("#")]
    assert installs == ["RUN pip install . \\"], installs  # no [extras]


def test_the_license_is_an_spdx_expression_setuptools_reads_without_a_warning() -> None:
    """Issue 43 item 24: a ``license = { text = ... }`` table makes setuptools >= 77 warn on every
    ``make venv``; the SPDX string form needs setuptools >= 77 to build."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert any(Requirement(r).name == "setuptools" and Requirement(r).specifier.contains("77")
               and not Requirement(r).specifier.contains("76") for r in pyproject["build-system"]["requires"])
