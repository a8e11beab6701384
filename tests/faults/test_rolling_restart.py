"""A rolling restart under load, as an operator upgrading a `laswrr up` stack does it
(docs/runbook.md): SIGTERM (by its own pid) the scheduler, the recorder, the collector, then
each proxy worker in turn, waiting each time until the new process does its job again. Clients
see no error and no stream is cut; at the end the log holds every stream message once and
replay is exact.

Real parts: `laswrr up --proxy-workers 2` as a child process (embedded-style external
nats-server on a free port, the simulated engines at speed 20) and eight streaming clients
(``Load``).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import pytest

from laswrr.replay import store
from laswrr.services.natsbus import connect
from tests.conftest import wait_until
from tests.faults.test_up_supervision import working_again
from tests.up_process import Load, UpStderr, audit_log, no_leftover_stack, start_up

no_leftover_stack = pytest.fixture(autouse=True)(no_leftover_stack)
pytestmark = pytest.mark.timeout(300)
WORKERS = 2


def worker_pids(log: Path) -> dict[str, int]:
    """The proxy's workers, as its log last named them (``worker proxy-k (pid N) listening``)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"worker (\S+) \(pid (\d+)\) listening", text)}


async def test_rolling_restart_under_load_is_invisible_to_clients(tmp_path: Path, nats_url: str) -> None:
    data = tmp_path / "data"
    proc, banner = await start_up("--data-dir", str(data), "--proxy-port", "0", "--dashboard-port", "0",
                                  "--nats-url", nats_url, "--sim-speed", "20", "--proxy-workers", str(WORKERS))
    stderr = UpStderr(proc)
    proxy_log = data / "logs" / "proxy.log"
    await wait_until(lambda: len(worker_pids(proxy_log)) == WORKERS, 60, "the proxy's workers")
    nc = await connect(nats_url, "fault-test")
    load = Load(banner["proxy URL"].split()[0], stream=True, max_tokens=64)
    load.start()
    await wait_until(lambda: load.served >= 20, 60, "the load to run")
    figures: list[str] = []
    try:
        for role in ("scheduler", "recorder", "collector"):  # each while the proxy serves on
            served, began = load.served, time.monotonic()
            os.kill(int(banner[f"pid {role}"]), signal.SIGTERM)
            started = await stderr.wait_for(rf"started {role} \(pid (\d+)\)", count=2, timeout_s=60)
            await asyncio.wait_for(working_again(role, nc, nats_url, data), 60)
            figures.append(f"{role}: back in {time.monotonic() - began:.2f} s (pid {started.group(1)}), "
                           f"served {load.served - served} meanwhile, failed {load.failed}")
        services_failed = load.failed
        for name, pid in sorted(worker_pids(proxy_log).items()):
            served, began = load.served, time.monotonic()
            os.kill(pid, signal.SIGTERM)
            await wait_until(lambda: worker_pids(proxy_log).get(name, pid) != pid, 60, f"{name} restarted")
            served_by_others = load.served - served
            await wait_until(lambda: load.served > served + 20, 60, "requests served after the restart")
            figures.append(f"{name}: back in {time.monotonic() - began:.2f} s, served {served_by_others} while "
                           f"it restarted, failed {load.failed} (at {[round(t - began, 2) for t in load.failed_at]} s)")
        assert proc.returncode is None
    finally:
        await load.stop()
    await interrupt_and_wait(proc)
    audit = await audit_log(nc, data / store.DB_FILE)
    for line in figures:
        print(f"FAULT rolling restart {line}")
    print(f"FAULT rolling restart totals: served {load.served} failed {load.failed} (cut streams {load.cut}, "
          f"first reasons {load.reasons}), {audit.line()}")
    assert services_failed == 0 and load.failed == 0, load.reasons
    audit.assert_whole()


async def interrupt_and_wait(proc: asyncio.subprocess.Process) -> None:
    proc.send_signal(signal.SIGINT)
    await asyncio.wait_for(proc.wait(), 120)
    assert proc.returncode == 0
