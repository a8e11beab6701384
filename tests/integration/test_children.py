"""services/children.py with programs other than ``laswrr`` (what the proxy benchmark and
deploy/compose_local.py start through it): their URL, working directory and log, and a stop
that ends a child ignoring SIGTERM together with what it started (its process group)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from laswrr.services.children import ChildProcesses
from tests.conftest import Eventually
from laswrr.services.children import exited

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


async def test_a_child_that_ignores_sigterm_is_killed_with_its_process_group(tmp_path: Path,
                                                                             eventually: Eventually) -> None:
    children = ChildProcesses(tmp_path / "logs", stop_timeout_s={"engine": 0.5})
    child = await children.spawn("stubborn", "-c", SERVE, "stubborn", program=(sys.executable,), role="engine",
                                 wait_listening=True)
    lines = await eventually(lambda: [line for line in child.log_path.read_text().splitlines()
                                      if line.startswith("grandchild")], what="the grandchild's pid in the log")
    grandchild = int(lines[0].split()[1])
    assert not exited(grandchild)
    await children.stop(["engine"])
    assert child.process.returncode == -9
    await eventually(lambda: exited(grandchild), what="the child's own process group killed with it")


async def test_a_log_on_a_full_disk_never_blocks_the_child(tmp_path: Path) -> None:
    """Its stdout lines that the log refuses (/dev/full: every write fails with ENOSPC) are
    dropped, not left in the pipe: a child printing 2 MB (far over a pipe's 64 KB) still ends."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "chatty.log").symlink_to("/dev/full")
    children = ChildProcesses(logs)
    chatty = "import sys\nfor i in range(20000):\n    print('x' * 99, flush=True)\n"
    child = await children.spawn("chatty", "-c", chatty, program=(sys.executable,), role="engine")
    try:
        assert await asyncio.wait_for(child.process.wait(), 30) == 0
    finally:
        await children.stop(["engine"])
