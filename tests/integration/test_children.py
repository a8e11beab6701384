"""services/children.py with programs other than ``laswrr`` (what the proxy benchmark and
deploy/compose_local.py start through it): their URL, working directory and log, and a stop
that ends a child ignoring SIGTERM together with what it started (its process group)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from laswrr.services.children import ChildProcesses

pytestmark = pytest.mark.timeout(60)

SERVE = """
import os, signal, subprocess, sys, time
print("cwd", os.getcwd(), flush=True)
print("engine listening on http://127.0.0.1:4321", flush=True)
if sys.argv[1] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
    print("grandchild", grandchild.pid, flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead too
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


async def test_a_program_child_reports_its_url_runs_in_its_directory_and_logs(tmp_path: Path) -> None:
    children = ChildProcesses(tmp_path / "logs")
    (tmp_path / "here").mkdir()
    child = await children.spawn("engine", "-c", SERVE, "polite", program=(sys.executable,), role="engine",
                                 wait_listening=True, cwd=tmp_path / "here")
    try:
        assert child.url == "http://127.0.0.1:4321" and child.program == (sys.executable,)
    finally:
        await children.stop(["engine"])
    assert child.process.returncode == -15  # SIGTERM, not a kill
    log = child.log_path.read_text()
    assert f"cwd {tmp_path / 'here'}" in log and "listening on" in log


async def test_a_child_that_ignores_sigterm_is_killed_with_its_process_group(tmp_path: Path) -> None:
    children = ChildProcesses(tmp_path / "logs", stop_timeout_s={"engine": 0.5})
    child = await children.spawn("stubborn", "-c", SERVE, "stubborn", program=(sys.executable,), role="engine",
                                 wait_listening=True)
    grandchild = 0
    for _ in range(100):
        lines = [line for line in child.log_path.read_text().splitlines() if line.startswith("grandchild")]
        if lines:
            grandchild = int(lines[0].split()[1])
            break
        await asyncio.sleep(0.05)
    assert grandchild and alive(grandchild)
    await children.stop(["engine"])
    assert child.process.returncode == -9
    for _ in range(100):
        if not alive(grandchild):
            break
        await asyncio.sleep(0.05)
    assert not alive(grandchild), "the child's own process group is killed with it"
