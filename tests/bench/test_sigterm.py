"""`kill` (SIGTERM) of a running `laswrr bench` tears its stack down like Ctrl-C: no nats-server,
engine or service it started is left behind (before the fix, the embedded nats-server outlived
its parent)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")]


def _alive_processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every live (non-zombie) process."""
    found: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            found[int(entry.name)] = (int(fields[1]), cmdline)
    return found


def _descendants(root: int) -> dict[int, str]:
    procs = _alive_processes()
    out: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, cmdline) in procs.items():
            if ppid == parent and pid not in out:
                out[pid] = cmdline
                frontier.append(pid)
    return out


def _wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


def test_sigterm_stops_the_bench_and_every_process_it_started(tmp_path: Path) -> None:
    bench = subprocess.Popen(
        [sys.executable, "-m", "laswrr", "bench", "--scenario", "smoke", "--policies", "la-swrr",
         "--no-peers", "--no-plots", "--out", str(tmp_path / "out")],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2],
    )
    started: dict[int, str] = {}
    try:
        # the whole stack is up once the proxy runs: nats-server, scheduler, recorder, 2 engines, collector
        def stack_up() -> bool:
            started.update(_descendants(bench.pid))
            return any(" proxy " in cmdline for cmdline in started.values()) or bench.poll() is not None
        assert _wait_for(stack_up, 60) and bench.poll() is None, bench.stderr.read() if bench.stderr else ""
        assert any("nats-server" in cmdline for cmdline in started.values()), started
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 130  # the Ctrl-C exit status, after the stack was stopped
        def alive() -> dict[int, str]:
            now = _alive_processes()  # one /proc scan per check
            return {pid: cmdline for pid, cmdline in started.items() if pid in now}
        assert _wait_for(lambda: not alive(), 15), alive()
    finally:
        if bench.poll() is None:
            bench.kill()
        left = _alive_processes()
        for pid in started:
            if pid in left:
                os.kill(pid, signal.SIGKILL)
