"""`laswrr up` supervises its children: kill -9 one (by its own pid) under load and it is back.

Real parts: `laswrr up` as a child process with its four simulated engines, on an external
nats-server on a free port (so the streams can be counted after the stack stopped), and eight
real HTTP clients on the proxy. Each fault prints one line of figures (requests served /
failed / cut by the router, time to recover), collected in the issue note.

* scheduler kill -9: restarted; the proxy keeps serving on the last snapshot meanwhile (no
  client request fails), and snapshots come again.
* recorder kill -9: restarted; at the end, DuckDB rows = stream messages, none duplicated.
* collector kill -9: restarted.
* a child that keeps dying (more than ``max_restarts`` deaths within the window): reported, and
  `laswrr up` stops everything and exits 1.
After each run, ``laswrr replay --db`` on its log is exact.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from laswrr.replay import store
from laswrr.schemas import subjects as sj
from laswrr.services.children import ChildProcesses, RestartPolicy
from laswrr.services.natsbus import connect
from laswrr.services.operator import publish_and_wait
from tests.replay_cli import replay_exact
from tests.up_process import Load, UpStderr, audit_log, no_leftover_stack, start_up

no_leftover_stack = pytest.fixture(autouse=True)(no_leftover_stack)
pytestmark = pytest.mark.timeout(240)


async def working_again(role: str, nc, nats_url: str, data: Path) -> None:  # type: ignore[no-untyped-def]
    """Until the restarted ``role`` does its job again: for the scheduler an operator command is answered, the recorder answers a copy request (it does so once caught up with LB_EVENTS), the
    collector publishes an engine sample."""
    if role == "scheduler":  # an operator command is answered (a rejection: no such node)
        while True:
            outcome = await publish_and_wait(nats_url, sj.admin_capacity("no-such-node"), b'{"capacity": 1}',
                                             "no-such-node", 2.0)
            if outcome is not None and outcome.rejected:
                return
    elif role == "recorder":
        while True:
            target = data / f"copy-{time.monotonic_ns()}.duckdb"
            body = json.dumps({"db": str((data / store.DB_FILE).resolve()), "to": str(target)}).encode()
            try:
                reply = json.loads((await nc.request(sj.RECORDER_SNAPSHOT, body, timeout=2.0)).data)
                if "path" in reply:
                    return
            except Exception:  # noqa: BLE001 - not back yet
                await asyncio.sleep(0.05)
    else:
        sample: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def seen(msg) -> None:  # type: ignore[no-untyped-def]
            if not sample.done():
                sample.set_result(None)

        sub = await nc.subscribe(f"{sj.METRICS_ENGINE}.>", cb=seen)
        await sample
        await sub.unsubscribe()


async def test_killed_children_are_restarted_and_nothing_is_lost(tmp_path: Path, nats_url: str,
                                                                eventually: Callable[..., Awaitable[Any]]) -> None:
    data = tmp_path / "data"
    proc, banner = await start_up("--data-dir", str(data), "--proxy-port", "0", "--dashboard-port", "0",
                                  "--nats-url", nats_url, "--sim-speed", "20")
    stderr = UpStderr(proc)
    nc = await connect(nats_url, "fault-test")
    load = Load(banner["proxy URL"].split()[0])
    load.start()
    await eventually(lambda: load.served >= 20, timeout=60, what="the load served")
    figures = {}
    try:
        for role in ("scheduler", "recorder", "collector"):
            served, failed = load.served, load.failed
            killed_at = time.monotonic()
            os.kill(int(banner[f"pid {role}"]), signal.SIGKILL)
            started = await stderr.wait_for(rf"started {role} \(pid (\d+)\)", count=2)
            restarted_s = time.monotonic() - killed_at
            assert int(started.group(1)) != int(banner[f"pid {role}"])
            assert f"{role} (pid {banner[f'pid {role}']}) exited unexpectedly with -9; restarting" in stderr.text()
            await asyncio.wait_for(working_again(role, nc, nats_url, data), 30)
            recovered_s = time.monotonic() - killed_at
            recovered = load.served
            await eventually(lambda: load.served >= recovered + 20, timeout=60,
                             what=f"the load served on after the {role}'s restart")
            figures[role] = (load.served - served, load.failed - failed, restarted_s, recovered_s)
            assert load.failed == failed, load.reasons  # the proxy served throughout
        assert proc.returncode is None
    finally:
        await load.stop()
        if proc.returncode is not None:
            await nc.close()
    proc.send_signal(signal.SIGINT)
    await asyncio.wait_for(proc.wait(), 90)
    assert proc.returncode == 0, stderr.text()[-3000:]
    audit = await audit_log(nc, data / store.DB_FILE)
    for role, (served, failed, restarted_s, recovered_s) in figures.items():
        print(f"FAULT up/{role} kill -9: served {served} failed {failed}; restarted in {restarted_s:.2f} s, "
              f"working again after {recovered_s:.2f} s")
    print(f"FAULT up totals: served {load.served} failed {load.failed}; {audit.line()}")
    audit.assert_whole()


async def test_a_child_that_keeps_dying_is_given_up(tmp_path: Path) -> None:
    """A real child that exits at once (a usage error, exit 2): restarted max_restarts times,
    then reported, with each death and its exit status logged."""
    policy = RestartPolicy(first_backoff_s=0.05, max_backoff_s=0.2, max_restarts=3, window_s=60)
    children = ChildProcesses(tmp_path / "logs", restart=policy)
    started = time.monotonic()
    child = await children.spawn("broken", "scheduler", "--no-such-flag", role="scheduler")
    failed = await asyncio.wait_for(children.wait_unexpected_exit(), 60)
    assert failed is child and child.restarts == 3 and len(child.deaths) == 4
    assert child.process.returncode == 2
    assert time.monotonic() - started >= 0.05 + 0.1 + 0.2  # the backoff doubled up to its cap
    await children.stop(["scheduler"])


async def test_up_gives_up_on_a_child_that_keeps_dying(tmp_path: Path, nats_url: str) -> None:
    data = tmp_path / "data"
    proc, banner = await start_up("--data-dir", str(data), "--proxy-port", "0", "--dashboard-port", "0",
                                  "--nats-url", nats_url, "--sim-speed", "20", "--max-restarts", "1")
    stderr = UpStderr(proc)
    os.kill(int(banner["pid collector"]), signal.SIGKILL)
    second = await stderr.wait_for(r"started collector \(pid (\d+)\)", count=2)
    os.kill(int(second.group(1)), signal.SIGKILL)  # the second death within the window: give up
    await asyncio.wait_for(proc.wait(), 90)
    assert proc.returncode == 1
    assert "not restarting it again" in stderr.text() and "after 1 restart(s); stopping the rest" in stderr.text()
    replay_exact(data / store.DB_FILE)  # the stack stopped in order: its log is whole
